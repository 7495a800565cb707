"""Loads: the checks before a read, planning, pinning, refusals, cached plans, quarantine of a corrupt step."""
