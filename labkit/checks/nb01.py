"""Visible tests of 01_setup_and_comparison's exercises (its test cells call them)."""
