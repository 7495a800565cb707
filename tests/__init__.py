"""ckptguard's test suite; shared beds, job runner and campaign engine are in tests/support."""
