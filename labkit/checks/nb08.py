"""Visible tests of 08_decode_attention's exercises (its test cells call them)."""
