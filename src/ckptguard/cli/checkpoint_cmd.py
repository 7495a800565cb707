"""`ckptguard ls` and `ckptguard verify` (filled in by the verify work)."""
