"""Visible tests of 04_performance_analysis's exercises (its test cells call them)."""
