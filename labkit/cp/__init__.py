"""Context parallelism: memory on P devices (memory), the ring simulated on a CPU (ring), context-parallel
training (train), its torchrun launcher ``python -m labkit cp-train`` (run) and the CPU shim for gloo (cpu).

Used in: 07.
"""
