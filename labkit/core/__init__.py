"""The floor: timing and memory measurement, device facts, the problem sizes (profiles), plots, the test cells'
assertion helpers (grading) and the command line's argument types. Imports no other part of labkit.

Used in: every notebook and every other part of labkit.
"""
