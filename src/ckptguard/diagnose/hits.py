"""Multi-pattern engines that find the prefilter's anchors outside Python's loop.

The scan (`ingest.scan`) asks one of these for the lines of each block that hold an anchor;
Python then reads only those lines. Engines, tried in the order of `ENGINES`:

- ``hyperscan``: Intel's Hyperscan, compiled from the anchors as literals, scans each block in
  process at several GB/s on any input (files, stdin, ``.gz``, UTF-16, a pasted log after
  normalisation). Installed with ckptguard on x86-64 Linux (the ``hyperscan`` wheel bundles its
  library); it needs SSSE3, which every x86-64 CPU of the last fifteen years has.
- ``grep``: ``grep -a -b -o -F`` over a plain file, a child process that streams the byte
  offsets of the matches (GNU grep's multi-pattern search runs at about a quarter of its
  single-pattern speed).
- none: the Python prefilter (`Prefilter.line_starts`, one compiled ``re`` pass per distinct
  first character of the anchors).

All three feed the scan exactly the same lines (`tests/diagnose/test_scan_speed_paths.py`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from ckptguard.diagnose.ingest import AnchorHits, Prefilter, Source
from ckptguard.diagnose.normalize import looks_utf16


def _line_starts(block: bytes, ends: list[int]) -> list[int]:
    """Starts of the lines of ``block`` that hold the match ending at each of ``ends`` (sorted
    offsets just past a match's last byte), each line once."""
    out: list[int] = []
    last_end = -1
    rfind, find = block.rfind, block.find
    for end in ends:
        pos = end - 1
        if pos > last_end:
            out.append(rfind(b"\n", 0, pos) + 1)
            e = find(b"\n", pos)
            last_end = len(block) if e < 0 else e
    return out


_DATABASES: weakref.WeakKeyDictionary[Prefilter, Any] = weakref.WeakKeyDictionary()


def _compile(prefilter: Prefilter) -> Any:
    """A Hyperscan block-mode database of the prefilter's anchors, or None."""
    try:
        import hyperscan  # optional: wheels for x86-64 Linux only
    except ImportError:
        return None
    try:
        db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        db.compile(
            expressions=list(prefilter.exact),
            ids=list(range(len(prefilter.exact))),
            elements=len(prefilter.exact),
            literal=True,
        )
    except hyperscan.error:  # a CPU without SSSE3, or a literal it refuses
        return None
    return db


class HyperscanHits:
    """The anchors found by a Hyperscan block-mode database compiled from them as literals.

    The database (with its scratch space) is compiled once per `Prefilter` and reused for every
    source of that diagnosis; a scratch space must not be used by two threads at once, and one
    diagnosis reads its sources one after another, each with its own prefilter.

    Every match costs a call into Python, so a line that holds an anchor many times (a progress
    bar's updates joined by carriage returns, each with its ``it/s``) would cost a call per
    occurrence: after ``LINE_MATCHES`` matches in one line the scan is stopped and resumed after
    that line, which bounds the cost per line."""

    LINE_MATCHES = 16

    def __init__(self, database: Any) -> None:
        self._db = database
        self._block = b""
        self._offset = 0  # where in the block the current scan started
        self._starts: list[int] = []
        self._line = (-1, -1)  # start and end (its newline) of the line of the last match
        self._repeats = 0

    def _on_match(self, _id: int, _start: int, end: int, _flags: int, _ctx: object) -> bool | None:
        pos = self._offset + end - 1
        first, last = self._line
        if first <= pos <= last:
            self._repeats += 1
            return self._repeats >= self.LINE_MATCHES or None  # True stops the scan
        block = self._block
        first = block.rfind(b"\n", 0, pos) + 1
        last = block.find(b"\n", pos)
        self._line = (first, len(block) if last < 0 else last)
        self._starts.append(first)
        self._repeats = 0
        return None

    @classmethod
    def open(cls, source: Source, prefilter: Prefilter) -> HyperscanHits | None:
        """Compile the anchors (about 2 ms, once per prefilter); None where Hyperscan is not
        installed or cannot run on this CPU."""
        del source  # scans the blocks it is given, whatever their source
        if not prefilter.exact:
            return None
        if prefilter not in _DATABASES:
            _DATABASES[prefilter] = _compile(prefilter)
        db = _DATABASES[prefilter]
        return None if db is None else cls(db)

    def starts(self, block: bytes, base: int) -> list[int]:
        """Line starts, in ``block``, of the lines that hold an anchor (``base`` is not needed:
        the block itself is scanned)."""
        import hyperscan

        del base
        self._block, self._starts, self._line, self._repeats = block, [], (-1, -1), 0
        view = memoryview(block)
        self._offset = 0
        while True:
            try:
                self._db.scan(view[self._offset :], match_event_handler=self._on_match)
                break
            except hyperscan.ScanTerminated:  # a line with many matches: go on after it
                self._offset = self._line[1] + 1
                self._repeats = 0
                if self._offset >= len(block):
                    break
        starts, self._starts, self._block = self._starts, [], b""
        # Hyperscan reports matches in the order of their ends within one scan; sorted and
        # unique makes that certain whatever its engines do
        return sorted(set(starts)) if any(a >= b for a, b in pairwise(starts)) else starts

    def close(self) -> None:
        """Nothing to stop: the database is freed with the object."""
        self._starts, self._block = [], b""


class GrepHits:
    """The anchors found by ``grep -F`` in a plain file: the byte offsets of the matches,
    streamed in file order, turned into line starts block by block.

    ``open`` returns None where it cannot apply (no grep, a compressed or UTF-16 file, stdin)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        assert proc.stdout is not None
        self._out = proc.stdout
        self._next = self._read()

    @classmethod
    def open(cls, source: Source, prefilter: Prefilter) -> GrepHits | None:
        """Start grep over ``source`` (None where the Python prefilter must do the work)."""
        grep = shutil.which("grep")
        if grep is None or source.path is None or source.path.suffix == ".gz" or not prefilter.anchors:
            return None
        try:
            with source.path.open("rb") as f:
                if looks_utf16(f.read(4096)):
                    return None
            pats = [x for a in prefilter.exact for x in ("-e", a.decode("utf-8", "surrogateescape"))]
            proc = subprocess.Popen(
                [grep, "-a", "-b", "-o", "-F", *pats, "--", str(source.path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env={**os.environ, "LC_ALL": "C"},
                bufsize=1 << 16,
            )
        except (OSError, ValueError):
            return None
        hits = cls(proc)
        if hits._next is None and proc.wait() > 1:  # grep itself failed: not a result
            return None
        return hits

    def _read(self) -> int | None:
        line = self._out.readline()
        if not line:
            return None
        off, _, _ = line.partition(b":")
        return int(off)

    def starts(self, block: bytes, base: int) -> list[int]:
        """Line starts (offsets into ``block``, which begins at file offset ``base``) of the lines
        that hold a match; matches before ``base`` (inside a skipped over-long line) are dropped."""
        ends: list[int] = []
        end = base + len(block)
        nxt, read = self._next, self._read
        while nxt is not None and nxt < end:
            if nxt >= base:
                ends.append(nxt - base + 1)
            nxt = read()
        self._next = nxt
        return _line_starts(block, ends)

    def close(self) -> None:
        """Stop grep (the scan may end early) and reap it."""
        self._out.close()
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()


Opener = Callable[[Source, Prefilter], AnchorHits | None]


@dataclass(frozen=True)
class Engine:
    """One way to find the anchors. ``open`` returns None where it cannot apply to a source;
    ``any_stream``: whether it scans the blocks it is given (grep reads the file itself, so it
    cannot see a pasted log's normalised text or a transcoded one)."""

    open: Opener
    any_stream: bool


#: The engines, in the order they are tried.
ENGINES: dict[str, Engine] = {
    "hyperscan": Engine(HyperscanHits.open, any_stream=True),
    "grep": Engine(GrepHits.open, any_stream=False),
}


def open_hits(source: Source, prefilter: Prefilter, *, transformed: bool) -> AnchorHits | None:
    """The first engine of `ENGINES` that applies to ``source``; None where none does (the scan
    then uses the Python prefilter).

    Args:
        source: the log being read.
        prefilter: its anchors.
        transformed: whether the scan reads something else than the file's own bytes (a pasted
            log's normalised text, stdin).

    Returns:
        The engine, opened on ``source``, or None.
    """
    for engine in ENGINES.values():
        if transformed and not engine.any_stream:
            continue
        hits = engine.open(source, prefilter)
        if hits is not None:
            return hits
    return None
