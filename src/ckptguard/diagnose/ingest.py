"""Reading logs: sources, and a fast prefilter over large blocks (line prefixes and timestamps
are read by `prefixes`).

The hot loop never touches a line in Python unless one of the prefilter's literal anchors occurs
in it: the prefilter runs one `re` search per distinct first character of the anchors, each of
the form ``c(?:rest|rest2)``, which CPython scans at memory speed. Lines are cut at
``MAX_LINE`` bytes and decoded with ``errors="replace"``, so binary input and endless lines cost
bounded memory.
"""

from __future__ import annotations

import codecs
import gzip
import re
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from ckptguard.diagnose.normalize import looks_utf16, utf16_codec
from ckptguard.diagnose.shapes import Shapes

MAX_LINE = 64 * 1024
CHUNK = 4 * 1024 * 1024
# A line longer than this that holds carriage returns is read as a terminal shows it (`shown`)
OVERWRITE_MIN = 4096
# the hits engine is closed where one line in DENSE of a block (and at least DENSE_MIN) holds an anchor
DENSE = 8
DENSE_MIN = 4096
SKIP_SUFFIXES = {
    ".pt",
    ".pth",
    ".bin",
    ".safetensors",
    ".ckpt",
    ".pkl",
    ".npy",
    ".npz",
    ".distcp",
    ".png",
    ".jpg",
    ".zip",
    ".tar",
    ".so",
    ".whl",
    ".pyc",
}


class UsageError(ValueError):
    """The command line names something that cannot be read (exit code 2)."""


@dataclass(frozen=True)
class Source:
    """One input stream: a file, or stdin. ``rank`` comes from the file's name when it has one."""

    name: str
    path: Path | None
    rank: int | None = None
    rank_is_local: bool = False

    def open(self) -> BinaryIO:
        """Open for binary reading (gzip is decompressed on the fly)."""
        if self.path is None:
            return sys.stdin.buffer
        if self.path.suffix == ".gz":
            return gzip.open(self.path, "rb")  # type: ignore[return-value]
        return self.path.open("rb")


# A path component that is a per-rank log's name ("rank3", "rank_3.log", "train-rank3.out",
# "stdout_rank_3"): at most one word before and after the rank, so that a descriptive name
# ("oom-on-gpu1-then-rank3-watchdog.log") is not read as rank 3's own log.
_RANK_IN_NAME = re.compile(
    r"(?i)(?:^|/)(?:[a-z0-9]{1,16}[_.\-])?rank[_\-]?(\d{1,6})(?:[_.\-][a-z0-9]{1,16})?(?:\.(?:log|txt|out|err|gz))*(?=$|/)"
)
_TORCHRUN_DIR = re.compile(r"(?:^|/)(\d{1,6})/(?:stdout|stderr|error)\.(?:log|txt|json)$")
_DIGIT_NAME = re.compile(r"(?:^|/)(\d{1,6})\.(?:log|txt|out|err)(?:\.gz)?$")


def rank_from_path(rel: str) -> tuple[int | None, bool]:
    """Rank (and whether it is only a local rank) encoded in a log file's relative path."""
    m = _RANK_IN_NAME.search(rel)
    if m:
        return int(m.group(1)), False
    m = _TORCHRUN_DIR.search(rel)
    if m:
        return int(m.group(1)), True
    m = _DIGIT_NAME.search(rel)
    if m:
        return int(m.group(1)), False
    return None, False


def discover(paths: Iterable[str]) -> list[Source]:
    """Turn command-line paths (files, directories, ``-``) into sources, in a stable order."""
    sources: list[Source] = []
    for p in paths:
        if p == "-":
            sources.append(Source("<stdin>", None))
            continue
        path = Path(p)
        if path.is_dir():
            for f in sorted(x for x in path.rglob("*") if x.is_file()):
                if f.suffix.lower() in SKIP_SUFFIXES or f.name.startswith("."):
                    continue
                rel = f.relative_to(path).as_posix()
                rank, local = rank_from_path(rel)
                sources.append(Source(f"{path.name}/{rel}", f, rank, local))
        elif path.is_file():
            rank, local = rank_from_path(path.name)
            sources.append(Source(str(p), path, rank, local))
        else:
            raise UsageError(f"no such file or directory: {p}")
    if not sources:
        raise UsageError("no log files found in the given paths")
    return sources


class Prefilter:
    """Find the lines of a block that contain any anchor, at close to memory speed.

    The cost is one pass over the block per distinct first character of the anchors (measured:
    about 1 ms per 4 MiB, whatever the character), plus the handling of every line that holds an
    anchor. So the ``extra`` anchors (the knowledge base's) are re-keyed first: each is replaced
    by its longest suffix (at least ``min_len`` bytes) that starts with a character that the
    ``core`` anchors already need a pass for. Any line that holds an anchor holds its suffix
    too, so no line is lost. Only an anchor with no such suffix adds a pass.
    """

    def __init__(
        self, core: Iterable[str], extra: Iterable[str] = (), min_len: int = 4, embeddable: Iterable[str] = ()
    ) -> None:
        core = list(core)
        extra = list(extra)
        core_b = {a.encode() for a in core if a}
        # The anchors themselves, for the exact test of each candidate line (``wants``) and for
        # grep, which finds any number of them in one pass: the re-keyed suffixes are only the
        # Python passes' way to find candidates, and they match far more lines ("ting").
        exact: list[bytes] = []
        for a in sorted(core_b | {x.encode() for x in extra if x}, key=len):
            if not any(k in a for k in exact):
                exact.append(a)
        self.exact = exact
        self._exact_re = re.compile(b"|".join(re.escape(a) for a in sorted(exact, key=len, reverse=True)))
        self._embeddable = frozenset(a.encode() for a in embeddable)
        keys = {a[0] for a in core_b}
        rekeyed = set(core_b)
        for a in sorted({a.encode() for a in extra if a}, key=lambda x: (-len(x), x)):
            if any(c in a for c in core_b):
                continue
            need = min(min_len, len(a))
            pos = next((i for i in range(len(a) - need + 1) if a[i] in keys), 0)
            keys.add(a[pos])
            rekeyed.add(a[pos:])
        raw = sorted(rekeyed, key=len)
        kept: list[bytes] = []
        for a in raw:  # an anchor that contains a shorter one adds nothing
            if not any(k in a for k in kept):
                kept.append(a)
        groups: dict[int, list[bytes]] = {}
        for a in kept:
            groups.setdefault(a[0], []).append(a[1:])
        self.anchors = kept
        alts = b"|".join(re.escape(a) for a in sorted(kept, key=len, reverse=True))
        self._any_re = re.compile(alts if kept else b"(?!)")
        self._res = []
        for first, rests in sorted(groups.items()):
            alts = b"|".join(re.escape(r) for r in sorted(rests, key=len, reverse=True))
            head = re.escape(bytes([first]))
            self._res.append(re.compile(head + b"(?:" + alts + b")" if any(rests) else head))

    def wants(self, line: bytes) -> bool:
        """Whether a candidate line holds an anchor, not counting a word fragment inside a
        snake_case name (``top1_error``, ``error_rate``, ``num_exceptions``: metrics and config
        keys that a logger prints on every step, which would otherwise have every line parsed);
        a C++ type (``std::runtime_error``) is a failure's word, not a metric's."""
        for m in self._exact_re.finditer(line):
            if m.group() not in self._embeddable:
                return True
            i, j = m.start(), m.end()
            while i > 0 and (line[i - 1 : i].isalnum() or line[i - 1] == 95):
                i -= 1
            while j < len(line) and (line[j : j + 1].isalnum() or line[j] == 95):
                j += 1
            if b"_" not in line[i:j] or line[i - 2 : i] == b"::":  # C++ names: std::system_error
                return True
        return False

    def candidate(self, line: bytes) -> bool:
        """Whether `line_starts` would find this line (one search for all the passes' anchors)."""
        return self._any_re.search(line) is not None

    def line_starts(self, block: bytes) -> list[int]:
        """Sorted offsets of the starts of lines that contain an anchor."""
        starts: set[int] = set()
        rfind = block.rfind
        for rx in self._res:
            last_start, last_end = -1, -1
            for m in rx.finditer(block):
                pos = m.start()
                if pos < last_end:  # same line as the previous hit
                    continue
                s = rfind(b"\n", 0, pos) + 1
                if s != last_start:
                    starts.add(s)
                    last_start = s
                e = block.find(b"\n", pos)
                last_end = len(block) if e < 0 else e
        return sorted(starts)


LineHandler = Callable[[bytes, int], int]


class AnchorHits(Protocol):
    """Where the prefilter's anchors occur, found by a multi-pattern engine outside Python's loop
    (`hits`): the same lines `Prefilter.line_starts` finds, block by block."""

    def starts(self, block: bytes, base: int) -> list[int]:
        """Sorted offsets into ``block`` (which begins at offset ``base`` of the stream) of the
        starts of the lines that hold an anchor."""
        ...

    def close(self) -> None:
        """Release what the engine holds (a child process, a scratch space)."""
        ...


def scan(
    stream: BinaryIO,
    prefilter: Prefilter,
    on_line: LineHandler,
    hits: AnchorHits | None = None,
    shapes: Shapes | None = None,
) -> tuple[int, int]:
    """Feed the lines that matter (1-based line numbers) to ``on_line``; return bytes and lines.

    ``on_line`` returns how many following lines it wants to see whatever they contain (inside
    a traceback or a launcher summary block). ``hits``: the anchors' lines found by a
    multi-pattern engine (`hits`), used instead of the Python prefilter while the lines that
    hold an anchor are few (every match costs a call; where nearly every line has one, the
    engine is closed and the shape-block test below takes over). ``shapes``: line shapes
    read often enough already are skipped, a whole block at once where none of its lines
    would be read (see `shapes`).
    """
    wants = prefilter.wants
    if shapes is not None:
        repeated = shapes.repeated

        def wants(line: bytes) -> bool:
            return not repeated(line) and prefilter.wants(line)

    def candidate_wants(line: bytes) -> bool:  # a line that the Python prefilter did not find
        return prefilter.candidate(line) and wants(line)

    nbytes = 0
    lineno = 0  # lines fully consumed before the current block
    carry = b""
    skipping = False  # inside an over-long line whose head was already handled
    force = 0
    for raw_len, data in _chunks(stream):
        data_at = nbytes  # file offset of data[0] (hits are only given for untranscoded files)
        nbytes += raw_len
        if skipping:
            nl = data.find(b"\n")
            if nl < 0:
                continue
            data = data[nl + 1 :]
            data_at += nl + 1
            skipping = False
            lineno += 1
        buf_at = data_at - len(carry)
        buf = carry + data if carry else data
        cut = buf.rfind(b"\n")
        if cut < 0:
            if len(buf) > MAX_LINE:
                head = shown(buf[:MAX_LINE])
                force = on_line(head, lineno + 1) if force or _any_hit(prefilter, head) else force
                carry, skipping = b"", True
            else:
                carry = buf
            continue
        block, carry = buf[: cut + 1], buf[cut + 1 :]
        unread = shapes.unread(block) if hits is None and shapes is not None else None
        if unread is not None:
            lineno, force = _scan_block(block, lineno, unread, on_line, force, candidate_wants)
        else:
            if hits is not None:
                starts = hits.starts(block, buf_at)
                if len(starts) >= DENSE_MIN and len(starts) * DENSE > block.count(b"\n"):
                    hits.close()  # nearly every line holds an anchor: a call per match costs more
                    hits = None
            else:
                starts = prefilter.line_starts(block)
            lineno, force = _scan_block(block, lineno, starts, on_line, force, wants)
        if len(carry) > MAX_LINE:
            head = shown(carry[:MAX_LINE])
            if force or _any_hit(prefilter, head):
                force = on_line(head, lineno + 1)
            carry, skipping = b"", True
    if carry and not skipping:
        last = shown(carry[:MAX_LINE])
        if force or _any_hit(prefilter, last):
            on_line(last, lineno + 1)
        lineno += 1
    elif skipping:
        lineno += 1
    return nbytes, lineno


def shown(line: bytes) -> bytes:
    """A long line as a terminal shows it: a progress bar redraws itself after each carriage
    return, so of a line of thousands of updates (``\\rEpoch 1: 45%|...| 3.2it/s``) only its
    first piece (the launcher's prefix) and its last (the final update, and whatever was printed
    after it, such as a traceback's first line) are read. A line of ``OVERWRITE_MIN`` bytes or
    fewer is read whole: the cost of reading a line grows with its length, and pieces overwritten
    on the terminal hold only the bar's earlier states. (Given a line cut at ``MAX_LINE``.)"""
    return line if len(line) <= OVERWRITE_MIN else _shown_at(line, 0, len(line))


def _shown_at(block: bytes, start: int, end: int) -> bytes:
    """`shown` of the line ``block[start:end]``, cut at ``MAX_LINE`` after the redraws are
    dropped (so that what follows a long bar's last update is read), without copying it."""
    stop = end
    while stop > start and block[stop - 1] == 13:  # CRLF line ends are not redraws
        stop -= 1
    first = block.find(b"\r", start, stop)
    last = block.rfind(b"\r", start, stop) if first >= 0 else -1
    if last <= first:
        return block[start : min(end, start + MAX_LINE)]
    return (block[start:first] + block[last:end])[:MAX_LINE]


def _chunks(stream: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """Blocks of the stream as UTF-8-compatible bytes, with the raw size of each.

    A log saved as UTF-16 (PowerShell's ``>`` redirect, some Windows editors) is recognised by
    its byte-order mark or byte pattern (`normalize.utf16_codec`) and transcoded block by block;
    anything else passes through untouched (undecodable bytes are replaced later, per line)."""
    first = stream.read(CHUNK)
    if not first:
        return
    codec = utf16_codec(first)
    if codec is not None:
        dec = codecs.getincrementaldecoder(codec)(errors="replace")
        data = first
        while data:
            yield len(data), dec.decode(data).encode("utf-8", "replace")
            data = stream.read(CHUNK)
        tail = dec.decode(b"", final=True)
        if tail:
            yield 0, tail.encode("utf-8", "replace")
        return
    data = first
    while data:
        yield len(data), data
        data = stream.read(CHUNK)


_looks_utf16 = looks_utf16


SNIFF = 8192
_TEXT_RUN = re.compile(rb"[\t\n\r\x20-\x7e]{16,}")


def looks_binary(head: bytes) -> bool:
    """An executable, archive, checkpoint or image rather than a text log: more than a few NUL and
    other control bytes in the first block (a UTF-16 log has NULs too, after its byte-order
    mark)."""
    if not head or _looks_utf16(head):
        return False
    control = sum(head.count(bytes([c])) for c in range(32) if c not in (9, 10, 12, 13, 27))
    if control <= len(head) * 0.05:  # a text log has next to none (a few NULs after a crash)
        return False
    # more: still a log if most of it is runs of printable text (a crash's garbage, a redirected
    # binary's bytes in front of the job's output), which no executable or checkpoint has
    text = sum(len(m) for m in _TEXT_RUN.findall(head))
    return text < len(head) * 0.5


def sniff_binary(source: Source) -> bool:
    """Whether a file source holds binary data (stdin is judged from what it has buffered)."""
    try:
        if source.path is None:
            peek = getattr(sys.stdin.buffer, "peek", None)
            return looks_binary(peek(SNIFF)[:SNIFF]) if peek is not None else False
        with source.open() as f:
            return looks_binary(f.read(SNIFF))
    except (OSError, EOFError, ValueError, zlib.error):
        return False  # unreadable: the scan reports it


def _any_hit(prefilter: Prefilter, text: bytes) -> bool:
    return bool(prefilter.line_starts(text)) and prefilter.wants(text)


def _scan_block(
    block: bytes, lineno: int, starts: list[int], on_line: LineHandler, force: int, wants: Callable[[bytes], bool]
) -> tuple[int, int]:
    """Process one block of whole lines (``starts``: the lines the prefilter let through);
    returns the new line count and pending force."""
    n = len(block)
    count = block.count
    find = block.find
    counted_to, base = 0, lineno
    i, cur = 0, 0
    while cur < n:
        if force > 0:
            ls = cur
        else:
            while i < len(starts) and starts[i] < cur:
                i += 1
            if i >= len(starts):
                break
            ls = starts[i]
        le = find(b"\n", ls)
        if le < 0:
            le = n
        base += count(b"\n", counted_to, ls)
        counted_to = ls
        line = block[ls : min(le, ls + MAX_LINE)] if le - ls <= OVERWRITE_MIN else _shown_at(block, ls, le)
        if force > 0 or wants(line):
            force = max(force - 1, on_line(line, base + 1))
        cur = le + 1
    base += count(b"\n", counted_to, n)
    return base, force


def iter_lines_for_test(text: bytes) -> Iterator[bytes]:
    """Split like `scan` does (used by tests to compare)."""
    yield from (ln[:MAX_LINE] for ln in text.split(b"\n"))
