"""`python -m ckptguard.cli`."""

from ckptguard.cli import main

main()
