"""A part of labkit (docstring below in the layout commit)."""
