"""Generators of the pages under docs/ that must not drift from the code or the results."""
