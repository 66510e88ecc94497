"""Attention in FP8: the formats read from torch (formats), the input cases of the accuracy study (inputs), the
study itself (study), an exact e4m3 cast for Triton kernels run by the interpreter (cast) and the GPU sweep against
bf16 kernels and FP8 ceilings (bench).

Used in: 10.
"""
