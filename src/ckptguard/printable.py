"""Data strings made safe to print on a terminal: control characters written as escapes.

A checkpoint's metadata, item names and paths, and a job's log lines, are data: no byte of them
may move the cursor, recolour or retitle the terminal, or make text display in another order.
"""

from __future__ import annotations

import re

# C0 and C1 controls, DEL, the line and paragraph separators and the bidirectional marks, overrides
# and isolates.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escaped(m: re.Match[str]) -> str:
    code = ord(m.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(value: str) -> str:
    """``value`` with every control character written as an escape (ESC as ``\\x1b``, CR as ``\\x0d``).

    Args:
        value: a string from data.

    Returns:
        A string of printable characters only; a backslash is kept as it is.
    """
    return _CONTROL.sub(_escaped, value)
