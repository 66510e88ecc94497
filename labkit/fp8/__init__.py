"""Attention in FP8: the formats read from torch (formats), the input cases of the accuracy study (inputs), the
study itself (study), an exact e4m3 cast for Triton kernels run by the interpreter (cast), the GPU sweep against
bf16 kernels (bench), the measured GEMM ceilings it is scored against (ceilings) and its table, plot and
reference-run record (benchview).

Used in: 10.
"""
