"""`python -m ckptguard`: the command line (same as the `ckptguard` script)."""

from ckptguard.cli import main

main()
