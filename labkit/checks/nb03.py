"""Visible tests of 03_long_sequence_training's exercises (its test cells call them)."""
