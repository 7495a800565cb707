"""Every regex of the knowledge base and its rules costs time linear in the line, not exponential.

A pattern with nested quantifiers over overlapping classes (``(?:\\d[\\d:]*\\s*){1,8}?``) tries
every way to cut a run of digits into fields before it fails: on a line that opens with 40 digits
and holds no match that is seconds, with 60 minutes. Lines that shape are ordinary in logs
(counters, hashes, timestamps run together), so each pattern is run on such runs here; the
timeout fails a pattern that backtracks exponentially.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import fields, is_dataclass

import pytest

from ckptguard.diagnose.kb import load_kb

# Runs of the characters that fields, timestamps and names are made of, each long enough that
# exponential backtracking over them cannot finish, and none holding a failure's words.
_HOSTILE = [
    "1" * 80 + " x",
    "12:" * 30 + " x",
    "2024-05-01 " * 12 + "x",
    "a.b" * 30 + " - x",
    "[x] " * 30 + "y",
    "- " * 60 + "z",
    "| " * 60 + "z",
    " " * 100 + "x",
    "a_" * 50 + "Z",
]


def _patterns(obj: object, seen: set[int] | None = None) -> Iterator[re.Pattern[str]]:
    """Every compiled pattern reachable from ``obj`` (dataclasses, mappings, sequences)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, re.Pattern):
        yield obj
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            yield from _patterns(getattr(obj, f.name), seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _patterns(v, seen)
    elif isinstance(obj, list | tuple | set | frozenset):
        for v in obj:
            yield from _patterns(v, seen)


@pytest.mark.timeout(120)
def test_no_pattern_backtracks_exponentially() -> None:
    kb = load_kb()
    patterns = {p.pattern: p for p in _patterns(kb.rules)}
    for fc in kb.classes.values():
        patterns.update({p.pattern: p for p in _patterns(fc)})
    assert len(patterns) > 50, len(patterns)
    for p in patterns.values():
        for text in _HOSTILE:
            p.search(text)
