"""The visible tests of the notebooks' exercises, one module per notebook (``nbNN``).

A notebook's test cell calls them (``lk.checks.nb06.forward(flash_attention_forward)``) and then holds its
hidden block. They check what the prose states, with messages in lk.grading's style, and never hold an answer
(labkit ships to students): the references they use compute another way (float64, the naive formula).
The board's speed checks live apart (instructors only).

Used in: every notebook's test cells; tests/mutants (through tests/test_grader_strength.py).
"""
