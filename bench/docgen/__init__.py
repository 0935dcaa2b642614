"""Generators of doc sections from the code, and the one way a generated section is spliced into a doc."""
