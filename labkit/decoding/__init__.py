"""Decode-time attention: the decode helpers and the face for the rest (decode: lk.decode.*), timing by CUDA
graphs (graphtime), the read-bandwidth ceiling (readbw) and the paged KV cache (paged).

Used in: 08.
"""
