"""Models of performance and memory: the training-memory model (memory), the IO / roofline model (roofline),
the fitted time predictor (predictor) and torch.profiler wrappers (profiling).

Used in: 04 (03, 06 and 07 use memory and roofline).
"""
