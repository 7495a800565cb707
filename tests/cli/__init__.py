"""The command line: ls, verify, export and their output."""
