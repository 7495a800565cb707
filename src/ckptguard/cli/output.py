"""One way for every command to print: rich on a terminal; whole, unwrapped lines into pipes and logs."""

from __future__ import annotations

from rich.console import Console


def console(stderr: bool = False, **options: object) -> Console:
    probe = Console(stderr=stderr, **options)  # type: ignore[arg-type]
    if probe.is_terminal:
        return probe
    # Rich would wrap at 80 columns: fine on a screen, wrong in a log someone greps.
    return Console(stderr=stderr, width=200, soft_wrap=True, **options)  # type: ignore[arg-type]
