"""Helpers shared by the tests and by the child-process scripts they start."""
