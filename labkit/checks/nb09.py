"""Visible tests of 09_flex_attention's exercises (its test cells call them)."""
