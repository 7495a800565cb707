"""ckptguard run: the runner, hang detection, restarts, reports and masking."""
