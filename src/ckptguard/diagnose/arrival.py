"""Arrival times that `ckptguard run` recorded for a captured stream (``.<name>.times`` next to
``<name>.log``: one ``<byte offset> <unix time>`` line per read that brought the start of a
line), turned into a time for each line number of the log.

A line of a captured log carries the time its bytes reached the runner even when the process
printed no timestamp of its own, so the ranks of a run can be ordered by when they failed, not
by where their lines landed in the file.
"""

from __future__ import annotations

import bisect
from pathlib import Path

MAX_STAMPS = 2_000_000  # a bound on the times read (16 bytes or so each)
_CHUNK = 4 << 20


class Arrival:
    """Line number (1-based) -> the arrival time of the read that brought it (or the latest read
    before it)."""

    def __init__(self, lines: list[int], times: list[float]) -> None:
        self._lines, self._times = lines, times

    @classmethod
    def for_log(cls, log: Path) -> Arrival | None:
        """The arrival times recorded for ``log``, or None where there are none (or they cannot
        be read: the log is then ordered as any other)."""
        times_path = log.with_name(f".{log.stem}.times")
        if log.suffix != ".log" or not times_path.is_file():
            return None
        try:
            stamps = _read_stamps(times_path)
            if not stamps:
                return None
            return cls(*_to_lines(log, stamps))
        except (OSError, ValueError):
            return None

    def at(self, lineno: int) -> float | None:
        """When line ``lineno`` arrived (None before the first stamp)."""
        i = bisect.bisect_right(self._lines, lineno) - 1
        return self._times[i] if i >= 0 else None


def _read_stamps(path: Path) -> list[tuple[int, float]]:
    out: list[tuple[int, float]] = []
    with path.open("rb") as f:
        for raw in f:
            off, _, t = raw.partition(b" ")
            out.append((int(off), float(t)))
            if len(out) >= MAX_STAMPS:
                break
    return out


def _to_lines(log: Path, stamps: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    """Byte offsets -> line numbers, counting newlines in one streaming pass over the log. The
    offsets count the bytes the stream produced; past a part the capture left out they no longer
    match the file's, so only the stamps before that part are used."""
    lines: list[int] = []
    times: list[float] = []
    pos, newlines, i = 0, 0, 0
    with log.open("rb") as f:
        while i < len(stamps):
            block = f.read(_CHUNK)
            if not block:
                break
            cut = block.find(b"[ckptguard run: ")
            end = pos + (cut if cut >= 0 else len(block))
            while i < len(stamps) and stamps[i][0] < end:
                off, t = stamps[i]
                lines.append(newlines + block.count(b"\n", 0, off - pos) + 1)
                times.append(t)
                i += 1
            if cut >= 0:
                break
            newlines += block.count(b"\n")
            pos += len(block)
    return lines, times
