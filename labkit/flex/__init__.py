"""Programmable attention: FlexAttention across torch versions (lib), the block-sparse sweep (bench),
variable-length kernels (varlen) and packed training (packtrain).

Used in: 09.
"""
