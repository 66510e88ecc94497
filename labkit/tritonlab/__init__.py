"""The students' Triton kernels: the interpreter or the compiler (mode: the face imports it first), bounds
checks on loads and stores (bounds), compiling for sm80/sm90 without a GPU (compile, compile_worker: a script run by
path, so this folder must never hold a module named after a top-level package) and timing a kernel against the
hardware's roofs (bench).

Used in: 06, 08, 09.
"""
