"""Visible tests of 06_triton_flashattention's exercises (its test cells call them)."""
