"""Untrusted input: hostile or damaged checkpoints, control records and imported files."""
