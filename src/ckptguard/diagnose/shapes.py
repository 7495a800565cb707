"""Line shapes: what lets a log whose every line holds an anchor word be read at block speed.

A line's shape is its leading rank tag (``[rank12]``, ``12:``, NCCL's ``host:pid:tid [0]``,
each naming one process) and its text with every digit removed. A log whose every line holds an
anchor word (retried errors, warnings, NCCL WARN lines) repeats a few shapes millions of times,
and the first copies of each shape on each rank already hold all that they can tell: once a
shape has been read ``SHAPE_LIMIT`` times on a rank (``UNTAGGED_SHAPE_LIMIT`` without a tag),
its further copies are skipped.

Two tests share that table. `Shapes.repeated` is the per-line one (a C-level translate and a dict
lookup per candidate line). `Shapes.unread` looks at a whole block at once with C-level operations
only (translate, split, one ``findall`` for the tags, a set difference) and lists the lines that
the per-line test may still read: none where each line's shape is read often enough already or
holds no anchor (with its digits removed too, so that no digit can hide one). Only the shapes new
to the table cost Python work, at most ``MAX_NEW`` per part of a block; the lines read are the
ones the per-line test alone would read, so the diagnosis does not depend on which of them ran.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from itertools import accumulate

DIGITS = b"0123456789"
SHAPE_LIMIT = 4  # copies of one line shape on one rank read before the rest are skipped
UNTAGGED_SHAPE_LIMIT = 16_384  # the same for a line without a rank tag (its rank is further in)
MAX_SHAPES = 200_000  # shapes counted; beyond it a new shape is never skipped (memory bound)
MAX_QUIET = 65_536  # shapes known to hold no anchor (memory bound)
MAX_NEW = 2_048  # new shapes looked at in a part of a block before it is read line by line
SHORT = 24  # a line this short is never skipped: its shape says too little

# A line's rank tag: up to the first "]" in the first 24 bytes of a line that starts with "[";
# NCCL's "host:pid:tid [device]" (a process is one rank); else up to the first ": " in its
# first 8 bytes.
_TAG = rb"\[[^\]\n]{0,22}\]|[^\s:\[\]]{1,64}:[0-9]{1,10}:[0-9]{1,10} \[[0-9]{1,4}\]|(?!\[)[^\n]{0,6}?:(?= )"
_TAG_RE = re.compile(_TAG)
# The same for every line of a block at once: each match takes a whole line (a search for "^"
# at every byte would cost three times as much).
_TAGS_RE = re.compile(rb"(" + _TAG + rb")?[^\n]*\n")

Shape = tuple[bytes, bytes]  # (rank tag, the whole line without its digits)


def _tag_len(raw: bytes) -> int:
    m = _TAG_RE.match(raw)
    return m.end() if m else 0


def shape(raw: bytes) -> Shape:
    """A line's shape: its rank tag, and the whole line without its digits."""
    return raw[: _tag_len(raw)], raw.translate(None, DIGITS)


class Shapes:
    """The shapes read so far in a diagnosis (bounded: ``MAX_SHAPES`` + ``MAX_QUIET``).

    Args:
        anchors: every literal that makes a line a candidate of the Python prefilter: a shape
            that holds none of them (digits removed from both) is one no line is read for.
        max_line: the length at which the scan cuts a line (a longer one is looked at cut, so a
            block holding one is left to the per-line test).
    """

    def __init__(self, anchors: Iterable[bytes], max_line: int) -> None:
        self._counts: dict[Shape, int] = {}
        self._spent: set[Shape] = set()  # counted up to the limit, or holding no anchor
        self._quiet = 0
        self._max_line = max_line
        bare = sorted({a.translate(None, DIGITS) for a in anchors}, key=len, reverse=True)
        # an anchor of digits only would be in every line: then no shape is ever quiet
        self._anchor_re = re.compile(b"|".join(re.escape(a) for a in bare)) if bare and all(bare) else re.compile(b"")

    def repeated(self, raw: bytes) -> bool:
        """Whether this line's shape has been read its limit of times already (and count it
        when not). A line of ``SHORT`` bytes or fewer never is."""
        if len(raw) <= SHORT:
            return False
        key = shape(raw)
        n = self._counts.get(key, 0)
        limit = SHAPE_LIMIT if key[0] else UNTAGGED_SHAPE_LIMIT
        if n >= limit:
            return True
        if n or len(self._counts) < MAX_SHAPES:
            self._counts[key] = n + 1
            if n + 1 >= limit and len(key[1]) > SHORT:
                # a line short without its digits may be short with them: never skipped
                self._spent.add(key)
        return False

    def unread(self, block: bytes) -> list[int] | None:
        """The starts of the lines of ``block`` (whole lines, each ending in a newline) that the
        per-line test may still read: those whose shape is neither read its limit of times nor
        free of anchors (an empty list: none). None where a part of the block has more new
        shapes than ``MAX_NEW``, or a line is longer than the scan's cut: it is then read line
        by line.

        A line left out here is one that `repeated` would skip without counting it, or one
        that no anchor makes a candidate: reading only the lines listed, with the per-line test,
        reads what reading every candidate line would. The block is looked at in parts no
        longer than the scan's cut: no line of a part is cut, and the lists of a part's lines
        (a few pointers a line) stay small however short its lines are."""
        if block[-1:] != b"\n":
            return None
        out: list[int] = []
        pos, n, size = 0, len(block), self._max_line
        while pos < n:
            end = block.rfind(b"\n", pos, pos + size) + 1 if pos + size < n else n
            if end <= pos:
                return None  # a line longer than the scan's cut: it is looked at cut
            starts = self._unread_part(block[pos:end])
            if starts is None:
                return None
            out += [pos + s for s in starts] if pos else starts
            pos = end
        return out

    def _unread_part(self, part: bytes) -> list[int] | None:
        bare = part.translate(None, DIGITS).split(b"\n")
        tags = _TAGS_RE.findall(part)
        tags.append(b"")  # the empty piece after the part's last newline
        new = set(zip(tags, bare, strict=True))
        new.difference_update(self._spent)
        if not new:
            return []
        if len(new) > MAX_NEW:
            return None
        search = self._anchor_re.search
        quiet = [k for k in new if search(k[1]) is None]
        room = MAX_QUIET - self._quiet
        if room > 0:
            self._spent.update(quiet[:room])
            self._quiet += min(room, len(quiet))
        if len(quiet) == len(new):
            return []
        new.difference_update(quiet)
        ends = accumulate(map((1).__add__, map(len, part.split(b"\n"))), initial=0)
        return [start for start, k in zip(ends, zip(tags, bare, strict=True), strict=False) if k in new]
