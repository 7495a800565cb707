"""Keeping what a child printed: the same bytes, with arrival times, in bounded space.

A stream's bytes go to ``<name>.log`` until ``cap // 2`` bytes are written (the head: where a
job's configuration and first errors are). After that, bytes go to two tail segments in turn,
each at most ``cap // 4`` bytes: when the current one is full the other is emptied and written
next. At the end the newest ``cap // 4 .. cap // 2`` bytes (the tail: where the failure is) are
appended to the head after one line that says how many bytes were left out. So the file never
grows past ``cap`` plus that line, and the runner's memory does not grow with the output.

Arrival times go to ``.<name>.times``: one line ``<byte offset> <unix time>`` per read that
brings the start of a line (offsets count every byte the stream produced, so they keep their
meaning across the part left out). Its name starts with a dot, so `ckptguard diagnose` on the
directory does not read it as a log.

Keeping is never allowed to disturb the child: when a write to the log directory fails (disk
full, EIO, the directory removed), the capture stops there, keeps what it had written, and
``failure`` says why, for the runner to report once at the end.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import BinaryIO

DEFAULT_CAP = 256 << 20
OMITTED_NOTE = b"\n[ckptguard run: %d bytes left out here (--max-log-bytes); the head and the tail are kept]\n"


class StreamCapture:
    """One stream's capture file (``<dir>/<name>.log``) and its arrival times."""

    def __init__(self, directory: str, name: str, cap: int = DEFAULT_CAP) -> None:
        self.path = os.path.join(directory, f"{name}.log")
        self.times_path = os.path.join(directory, f".{name}.times")
        self._head_limit = max(cap // 2, 1)
        self._seg_limit = max(cap // 4, 1)
        self._head: BinaryIO = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._times: BinaryIO = open(self.times_path, "wb")  # noqa: SIM115
        self._seg_paths = [os.path.join(directory, f".{name}.tail{i}") for i in (0, 1)]
        self._segs: list[BinaryIO | None] = [None, None]
        self._seg = 0
        self._seg_bytes = 0
        self.total = 0  # every byte the stream produced
        self._at_line_start = True
        #: Why keeping stopped (a write to the log directory failed), or None while it works.
        self.failure: str | None = None

    def write(self, data: bytes, now: float | None = None) -> None:
        """Keep ``data``, which arrived at ``now`` (default: the current time)."""
        if not data or self.failure is not None:
            self.total += len(data)
            return
        try:
            self._write(data, now)
        except OSError as e:
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        if self.failure is None:
            self.failure = f"stopped keeping {os.path.basename(self.path)} after {self.total} bytes: {e.strerror or e}"

    def _write(self, data: bytes, now: float | None) -> None:
        if self._at_line_start:
            self._stamp(self.total, now)
        elif (nl := data.find(b"\n")) >= 0 and nl + 1 < len(data):
            self._stamp(self.total + nl + 1, now)
        self._at_line_start = data.endswith(b"\n")
        head_room = self._head_limit - self.total
        self.total += len(data)
        if head_room > 0:
            self._head.write(data[:head_room])
            data = data[head_room:]
        while data:
            seg = self._segs[self._seg]
            if seg is None or self._seg_bytes >= self._seg_limit:
                if seg is not None:
                    self._seg ^= 1
                seg = self._open_segment(self._seg)
                self._seg_bytes = 0
            room = self._seg_limit - self._seg_bytes
            seg.write(data[:room])
            self._seg_bytes += min(room, len(data))
            data = data[room:]

    def flush(self) -> None:
        """Make what was kept so far readable by other processes (other nodes' runners)."""
        if self.failure is not None:
            return
        try:
            self._flush()
        except OSError as e:
            self._fail(e)

    def _flush(self) -> None:
        self._head.flush()
        self._times.flush()
        for seg in self._segs:
            if seg is not None:
                seg.flush()

    def close(self) -> None:
        """Join head and tail into ``<name>.log``; remove the segments. Never raises: a failure
        to write is recorded in ``failure``."""
        try:
            if self.failure is None:
                self._join()
        except OSError as e:
            self._fail(e)
        for f in (self._head, self._times, *self._segs):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        for p in self._seg_paths:
            with contextlib.suppress(OSError):
                if os.path.exists(p):
                    os.unlink(p)

    def _join(self) -> None:
        cur = self._segs[self._seg]
        other = self._segs[self._seg ^ 1]
        kept_tail = 0
        parts: list[str] = []
        if cur is not None:
            if other is not None:
                other.close()
                parts.append(self._seg_paths[self._seg ^ 1])
                kept_tail += os.path.getsize(parts[-1])
            cur.close()
            parts.append(self._seg_paths[self._seg])
            kept_tail += os.path.getsize(parts[-1])
        if parts:
            omitted = self.total - self._head_limit - kept_tail
            if omitted > 0:
                self._head.write(OMITTED_NOTE % omitted)
            for p in parts:
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 20):
                        self._head.write(chunk)
        self._head.flush()
        self._times.flush()

    def _stamp(self, offset: int, now: float | None) -> None:
        self._times.write(b"%d %.6f\n" % (offset, time.time() if now is None else now))

    def _open_segment(self, i: int) -> BinaryIO:
        seg = self._segs[i]
        if seg is not None:
            seg.close()
        self._segs[i] = open(self._seg_paths[i], "wb")  # noqa: SIM115 - closed in close()
        return self._segs[i]  # type: ignore[return-value]
