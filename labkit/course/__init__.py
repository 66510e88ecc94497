"""The course pipeline that ships to students: running the solution notebooks (execute) under the no-network
guard (runguard), the stored reference run of GPU-only cells (reference, reference_runs/) and the student bundle
(bundle).

Used in: the Makefile, ``python -m labkit``, every notebook (lk.reference).
"""
