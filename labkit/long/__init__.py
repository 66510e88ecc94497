"""Long-sequence training on one GPU: configurations and the training comparison (ctx, summary), long documents
available offline (data), the levers that make a long sequence fit (levers) and the activation-memory model (memory).

Used in: 03 (07 reuses levers and memory).
"""
