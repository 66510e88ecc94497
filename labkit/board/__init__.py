"""The speed-of-light board (instructors only; never imported by the face, left out of the student bundle):
``python -m labkit board`` ranks the students' kernels (rank), each submission in its own process (worker), against
the per-notebook checks and shapes (specs, common, nb06, nb08, nb09, nb10), and writes the page (report).

Used in: ``python -m labkit board`` (instructors).
"""
