"""Cheaper regex tests for the knowledge base's signatures, with the same answers.

CPython's regex engine tries every alternative of an alternation at every position of a text
(a ten-way alternation costs about 20 µs on a 120-character line), but it finds a literal at
the speed of ``str.find``. So a signature's pattern is split into its top-level alternatives,
and each is searched only where a literal it cannot match without (the longest run of plain
characters it requires, found here from the pattern's text) occurs in the line.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from itertools import pairwise

_QUANT_RE = re.compile(r"(?:[*+?]|\{\d*(?:,\d*)?\})[?+]?")
# Global inline flags belong to the whole pattern; back-references to groups of other branches.
_UNSPLITTABLE_RE = re.compile(r"^\(\?[aiLmsux]+\)|\\[1-9]|\(\?P=")


def _skip_class(p: str, i: int) -> int:
    """The index after the character class that starts at ``p[i] == "["``."""
    i += 1
    if p[i : i + 1] == "^":
        i += 1
    if p[i : i + 1] == "]":  # "[]...]" and "[^]...]": a first "]" is a member
        i += 1
    while i < len(p) and p[i] != "]":
        i += 2 if p[i] == "\\" else 1
    return i + 1


def _skip_group(p: str, i: int) -> int:
    """The index after the group that starts at ``p[i] == "("``."""
    depth = 0
    while i < len(p):
        c = p[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i = _skip_class(p, i)
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def _atoms(p: str) -> Iterator[tuple[str | None, str, int]]:
    """The top-level atoms of a pattern: (its literal character or None, its quantifier, the
    index where it starts); a top-level ``|`` is the atom (None, "|", index)."""
    i = 0
    while i < len(p):
        start, c = i, p[i]
        lit: str | None = None
        if c == "|":
            yield None, "|", i
            i += 1
            continue
        if c == "\\":
            nxt = p[i + 1 : i + 2]
            lit = nxt if nxt and not nxt.isalnum() else None  # \d, \b, \n...: not one literal
            i += 2
        elif c == "[":
            i = _skip_class(p, i)
        elif c == "(":
            i = _skip_group(p, i)
        else:
            lit = None if c in ".^$*+?{}" else c
            i += 1
        q = _QUANT_RE.match(p, i)
        quant = q.group() if q else ""
        i = q.end() if q else i
        yield lit, quant, start


def branches(pattern: str) -> list[str]:
    """The top-level alternatives of a regex (``a|b(c|d)|e``: ``a``, ``b(c|d)``, ``e``); the
    pattern alone where splitting would change what it means (global inline flags,
    back-references)."""
    if _UNSPLITTABLE_RE.search(pattern):
        return [pattern]
    cuts = [i for _, quant, i in _atoms(pattern) if quant == "|"]
    edges = [-1, *cuts, len(pattern)]
    return [pattern[a + 1 : b] for a, b in pairwise(edges)]


def required_literal(branch: str) -> str:
    """The longest run of characters that every match of ``branch`` (one alternative, no
    top-level ``|``) holds: plain or escaped characters at the top level, each exactly once
    (one with ``+`` ends a run)."""
    best, run = "", ""
    for lit, quant, _ in _atoms(branch):
        if lit is not None and quant in ("", "+", "++", "+?"):
            run += lit
            if quant:
                best, run = max(best, run, key=len), ""
            continue
        best, run = max(best, run, key=len), ""
    return max(best, run, key=len)


def searcher(pattern: re.Pattern[str]) -> Callable[[str], bool]:
    """A test equal to ``bool(pattern.search(text))``, cheaper (see the module's docstring).
    The alternatives are compiled on the first call: most signatures never reach their regex
    in a run, and compiling them all would add to every run's start-up."""
    whole = pattern.search
    if pattern.flags & (re.VERBOSE | re.IGNORECASE):
        return lambda text: whole(text) is not None
    parts = branches(pattern.pattern)
    if len(parts) == 1:
        lit = required_literal(parts[0])
        return lambda text: lit in text and whole(text) is not None
    compiled: list[tuple[str, Callable[[str], re.Match[str] | None]]] = []

    def test(text: str) -> bool:
        if not compiled:
            try:
                compiled.extend((required_literal(b), re.compile(b, pattern.flags).search) for b in parts)
            except re.error:  # an alternative that is no regex alone: the whole pattern, then
                compiled[:] = [("", whole)]
        return any(lit in text and search(text) is not None for lit, search in compiled)

    return test


# Printable ASCII from the most to the least frequent in crash logs (counted over a corpus of
# real ones): an anchor is indexed by its rarest pair of adjacent characters.
_BY_FREQUENCY = " eintarosl/cpd0um.h1:_,gy32fb-k\"()84569v][w7FECTSRNx=*IA^GODLPUzjqW'M><|B?V`H%+#KQ{Z}!&YXJ@~$"
_RARITY = {c: i for i, c in enumerate(_BY_FREQUENCY)}


def _rarity(pair: tuple[str, str]) -> int:
    return _RARITY.get(pair[0], len(_RARITY)) + _RARITY.get(pair[1], len(_RARITY))


class AnchorIndex:
    """Which of many literal anchors a text holds, in their given order, without testing each:
    only the anchors whose rarest pair of adjacent characters the text holds are tested (about
    8 of 170 on a log line; a third of the cost of testing them all).

    Args:
        anchors: the literals, in the order `present` returns them in.
    """

    def __init__(self, anchors: list[str]) -> None:
        self._order = {a: i for i, a in enumerate(anchors)}
        self._short = [a for a in anchors if len(a) < 2]
        self._by_pair: dict[tuple[str, str], list[str]] = {}
        for a in anchors:
            if len(a) >= 2:
                self._by_pair.setdefault(max(pairwise(a), key=_rarity), []).append(a)
        self._pairs = frozenset(self._by_pair)

    def present(self, text: str) -> list[str]:
        """The anchors that occur in ``text``."""
        found = [a for a in self._short if a in text]
        for pair in self._pairs.intersection(pairwise(text)):
            found.extend(a for a in self._by_pair[pair] if a in text)
        if len(found) > 1:
            found.sort(key=self._order.__getitem__)
        return found
