"""`ckptguard diagnose` and `ckptguard explain` (filled in by the diagnose work)."""
