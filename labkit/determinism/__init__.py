"""Same input, same bits: what makes a kernel's result depend on the order its programs run in or on the batch it runs
in, and the given kernels notebook 11 builds on. A sum over programs by atomics (reduce, with the
program-order tools), FlashAttention-2's backward with dQ added by atomics (backward), split-KV decode with today's
launch heuristic (decode), torch's determinism switches read on this machine (switches) and the GPU sweep (bench).

Used in: 11.
"""
