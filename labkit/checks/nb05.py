"""Visible tests of 05_precision_analysis's exercises (its test cells call them)."""
