"""The course pipeline that ships to students: running the solution notebooks (execute) under the no-network
guard (runguard), the stored reference run of GPU-only cells (reference, reference_runs/) and the student bundle
(bundle), and the nbgrader preprocessors nbgrader_config.py installs (nbgrader_plugins: hidden tests stay out
of feedback, autograde warns only about edited test cells).

Used in: the Makefile, ``python -m labkit``, every notebook (lk.reference).
"""
