"""The attention engine: one ``attention(q, k, v, backend=...)`` over the named kernels (kernels), its input
check (check), the "auto" choice explained (explain), sweeps and the FLOP model (bench), what runs here and why
(doctor), and the time a call spends outside the kernel (overhead).

Used in: 01, 02, 04, 05, 06 directly; every notebook through lk.doctor and lk.bench.
"""
