"""The visible tests of the notebooks' exercises: a module per notebook (``nbNN``), or a few by exercise where one would
pass 320 lines (``nbNN_<part>``: nb06_forward, nb06_backward, ...).

A notebook's test cell calls them by name (``lk.checks.nb07.merge_equals_full_attention(merge_partials)``) and then
holds its hidden block. They check what the prose states, with messages in lk.grading's style, and never hold an answer
(labkit ships to students): the references they use compute another way (float64, the naive formula).
The board's speed checks live apart (instructors only).

Used in: every notebook's test cells; tests/course/test_grader_strength.py tries them on tests/mutants' wrong answers.
"""
from labkit.checks import (nb01, nb01_backward, nb01_forward, nb01_function, nb01_softmax, nb01_standard,
                           nb02, nb02_model, nb03, nb03_positions, nb04, nb05,
                           nb05_layernorm, nb05_policy, nb06, nb06_backward, nb06_forward, nb06_window,
                           nb07, nb08, nb08_combine, nb08_decode, nb08_kernels, nb08_paged,
                           nb08_split, nb09, nb09_backward, nb09_forward)  # noqa: F401
