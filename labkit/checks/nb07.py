"""Visible tests of 07_context_parallel's exercises (its test cells call them)."""
