"""Floating-point formats and error: error metrics and the format table (precision), mixed precision and
its policies (amp).

Used in: 05 (03 uses amp).
"""
