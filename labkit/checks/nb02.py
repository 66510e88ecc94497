"""Visible tests of 02_gpt2_integration's exercises (its test cells call them)."""
