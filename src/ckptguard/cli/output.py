"""One way for every command to print: rich on a terminal; whole, unwrapped lines into pipes and logs.

Strings that come from data (checkpoint metadata, item names, tags, paths, log lines) are printed
with :func:`text` or :func:`say`: never read as rich markup (``[bold]`` or ``[/]`` in a metadata value
is printed as it is, never raises), and with control characters escaped (``\\x1b``), so no byte of a
checkpoint or a log moves the cursor, recolours or retitles the user's terminal.
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from ckptguard.printable import escape_controls

__all__ = ["console", "escape_controls", "say", "text"]


def text(value: object, style: str = "") -> Text:
    """A table cell or line for a data string: no markup, control characters escaped.

    Args:
        value: the value (``str()`` of it is printed).
        style: a rich style for the whole text (e.g. ``"red"``).

    Returns:
        A rich ``Text`` that prints exactly the escaped string.
    """
    return Text(escape_controls(str(value)), style=style)


def say(con: Console, message: str) -> None:
    """Print one line holding data strings: no markup, no highlighting, controls escaped, unwrapped."""
    con.print(text(message), highlight=False, soft_wrap=True)


def console(stderr: bool = False, **options: object) -> Console:
    probe = Console(stderr=stderr, **options)  # type: ignore[arg-type]
    if probe.is_terminal:
        return probe
    # Rich would wrap at 80 columns: fine on a screen, wrong in a log someone greps.
    return Console(stderr=stderr, width=200, soft_wrap=True, **options)  # type: ignore[arg-type]
