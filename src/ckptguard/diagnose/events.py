"""Event extraction: turn the lines that pass the prefilter into failure events and facts.

One `Extractor` reads all sources of a run. It keeps only what attribution needs: the first few
events per (rank, class), launcher summaries, pid -> rank and rank -> host maps, checkpoint-path
announcements and collective fingerprints. Everything is bounded, whatever the size of the log.
Logs are read as users paste them: cut mid-traceback, excerpts joined by ``[...]``, several
processes interleaved, messages wrapped over two lines.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ckptguard.diagnose.arrival import Arrival
from ckptguard.diagnose.exceptions import (
    _EXC_RE,
    _FRAME_RE,
    GENERIC_CLASSES,
    ExceptionLines,
    _Pending,
    _Traceback,
)
from ckptguard.diagnose.facts import FactLines
from ckptguard.diagnose.ingest import Source
from ckptguard.diagnose.kb import KnowledgeBase, Match
from ckptguard.diagnose.launchers import Block, LauncherLines
from ckptguard.diagnose.mask import Masker
from ckptguard.diagnose.model import Event, EventKind, Evidence, LauncherFailure, RankSource
from ckptguard.diagnose.normalize import clean_line
from ckptguard.diagnose.prefixes import parse_timestamp, strip_prefixes
from ckptguard.diagnose.rules import Operation

# Literal anchors for the structural parts of a log (tracebacks, launcher lines, NCCL rank
# maps, generic failure words); the KB adds the anchors of its signatures and rules.
STRUCTURAL_ANCHORS = (
    "rror",
    "xception",
    "xit",
    "Traceback",
    "SIG",
    "Segmentation",
    "atchdog",
    "aving",
    "NCCL WARN",
    "NaN",
    "Killed",
    "nan",
    "nranks",
    "oss is",
    "[send]",
    "[receive]",
    "Errno",
    "[...]",
    'File "',
    "world_size",
    "num_local_procs=",
    "global_rank_mapping",
)
# Anchors that are fragments of common words: inside a snake_case name (`top1_error`,
# `num_exceptions`, `early_exit`, `saving_steps`, `loss_nan`) they say nothing about a failure.
EMBEDDABLE_ANCHORS = ("rror", "xception", "xit", "atchdog", "aving", "nan")
EVIDENCE_CHARS = 400
KEEP_PER_RANK_CLASS = 3
KEEP_UNATTRIBUTED_PER_CLASS = 20
TRACEBACK_FORCE = 60  # lines read unconditionally after a traceback line
OWNER_LINES = 400  # how far a launcher's "process N terminated with the following error" reaches

_NCCL_RE = re.compile(
    r"^(?P<host>[\w.\-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] "
    r"(?:[\w/.\-]+:\d+ )?NCCL (?P<lvl>[A-Z]+) ?(?P<msg>.*)$"
)
_EMBEDDED_EXC_RE = re.compile(r"\b(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)): (?P<msg>\S.*)$")
_IGNORED_MARKER = "Exception ignored "
_CHAIN_MARKERS = ("During handling of the above exception", "The above exception was the direct cause")
_EXCERPT_RE = re.compile(
    r"^\s*(?:\[\s*(?:\.\.\.|…)\s*\]|\.\.\.\.+|<\s*truncated lines? [\d\-– ]+>"
    r"|\[\s*truncated.*\])\s*$"
)


@dataclass(slots=True)
class _Line:
    """One line as the handlers see it: its text after the prefixes, and who wrote it."""

    rest: str
    stripped: str
    rank: int | None
    via: RankSource
    key: tuple[int | None, int | None]
    ev: Evidence
    ts: float | None
    hint: bool = False  # a warning or a retried error (set before the exception handlers)
    warning: bool = False  # a record logged at warning level


def _clip(text: str) -> str:
    text = text.strip()
    return text if len(text) <= EVIDENCE_CHARS else text[: EVIDENCE_CHARS - 1] + "…"


class Extractor(FactLines, ExceptionLines, LauncherLines):
    """Stateful reader of processed lines; one per diagnosis."""

    def __init__(self, kb: KnowledgeBase, masker: Masker) -> None:
        self.kb = kb
        self.rules = kb.rules
        self.masker = masker
        self.sources: list[Source] = []
        self.events: list[Event] = []
        self._kept: dict[tuple[int | None, str], int] = {}
        self.counts: dict[tuple[int | None, str], int] = {}
        self.pid_rank: dict[int, tuple[int, int]] = {}  # pid -> (rank, priority)
        self.pid_host: dict[int, str] = {}
        # NCCL WARN lines of a process whose communicator is not (yet) initialised, by (host, pid)
        self._nccl_init_warns: dict[tuple[str, int], list[Event]] = {}
        self._nccl_up: set[tuple[str, int]] = set()  # processes that logged Init COMPLETE
        self.rank_host: dict[int, str] = {}
        self.ranks_seen: set[int] = set()
        self.world_size = 0
        self.launcher: list[LauncherFailure] = []
        self.sigterm: list[tuple[int, Evidence]] = []
        self.saves: dict[str, dict[int, Evidence]] = {}
        self.announced_path: str | None = None  # the last checkpoint path a line announced work on
        # an announcement printed again at once with no rank prefix: one per process of the job
        self.repeated_saves: dict[str, list[Evidence]] = {}
        self._last_save: tuple[tuple[int, str], int, Evidence] | None = None
        self.fingerprints: list[tuple[dict[str, str], Evidence]] = []
        self.reported_ranks: list[tuple[int, Evidence]] = []
        self.progress: dict[int, dict[int, Evidence]] = {}  # step reached -> total -> first line
        self.named_ranks: set[int] = set()  # ranks that lines name without being failures
        self.lines_processed = 0
        self._seq = 0
        self._src = 0
        self._source: Source | None = None
        self._year = 2000
        self._tb: dict[tuple[int | None, int | None], _Traceback] = {}
        self._chain_next: dict[tuple[int | None, int | None], list[tuple[str, str]]] = {}
        # streams whose next line starts the exception that Python reports as ignored (raised
        # in __del__, a callback), with the line of that report
        self._ignored_next: dict[tuple[int | None, int | None], int] = {}
        self._ignored_tail: dict[tuple[int | None, int | None], int] = {}  # its exception's line
        self._last_ts: dict[tuple[int | None, int | None], float] = {}
        self._recent: deque[tuple[tuple[object, ...], Event]] = deque(maxlen=64)
        self._block: Block | None = None
        self._block_left = 0
        self._pending: _Pending | None = None
        self._lineno = 0
        self._owner: dict[tuple[int | None, int | None], tuple[int, int]] = {}  # key -> (rank, until line)
        self.latest_ts: float | None = None  # the log's latest own date
        self._announced: tuple[Operation, int, int, Evidence] | None = None  # op, source, line, evidence
        self.memory_line: tuple[int, int] | None = None  # (source, line) of the last memory figures
        self.deliberate = False  # the log shows a deliberate stop (Ctrl-C, SIGTERM first, a timeout)
        self._line_host: str | None = None  # the host label (pdsh, DeepSpeed) of the current line
        self.node_of: dict[str, tuple[int, int]] = {}  # host -> (node rank, local world size)
        self.nnodes = 0  # nodes of the job, where its launcher says (0: not said)
        self.arrival: Arrival | None = None  # the current source's recorded arrival times
        # the registry of line handlers: the first that recognises a line handles it
        self._handlers: tuple[Callable[[_Line], int | None], ...] = (
            self._on_excerpt,
            self._on_block,
            self._on_nccl,
            self._on_ignored_marker,
            self._on_after_ignored_marker,
            self._on_traceback_start,
            self._on_frame,
            self._on_source_line,
            self._on_chain_marker,
            self._on_launcher,
            self._on_owner,
            self._on_facts,
            self._on_exception,
            self._on_embedded_exception,
            self._on_signature,
        )
        self.host_ranks: dict[str, list[int]] = {}  # host -> its global ranks (DeepSpeed's map)

    # ---- per source ---------------------------------------------------------------------
    def begin_source(self, source: Source) -> None:
        """Reset the per-stream state: tracebacks never continue across files."""
        self.sources.append(source)
        self._src = len(self.sources) - 1
        self._source = source
        self._tb.clear()
        self._chain_next.clear()
        self._ignored_next.clear()
        self._ignored_tail.clear()
        self._last_ts.clear()
        self._block = None
        self._block_left = 0
        self._pending = None
        self._owner.clear()

    def end_source(self) -> None:
        """Flush what the end of the file cut off (a log cut mid-traceback)."""
        self._flush_pending(None)
        self._close_all()
        self.flush_block_entry()
        self._block = None

    def _close_all(self) -> None:
        for key, tb in list(self._tb.items()):
            self._close_traceback(key, tb, None)
        self._tb.clear()
        self._chain_next.clear()

    # ---- the line handler ---------------------------------------------------------------
    def feed(self, raw: bytes, lineno: int) -> int:
        """Handle one line; return how many following lines must be read unconditionally."""
        self.lines_processed += 1
        self._lineno = lineno
        text = clean_line(raw.decode("utf-8", "replace").rstrip("\r\n"))
        if not text.strip():
            return self._pending_force()
        text = self.masker.mask(text)
        src = self._source
        assert src is not None
        prefix, rest = strip_prefixes(text)
        if prefix.host:
            self.masker.learn_host(prefix.host)
        self._line_host = prefix.host
        rank = prefix.rank
        via = RankSource.PREFIX if rank is not None else RankSource.NONE
        if rank is None and src.rank is not None:
            rank, via = src.rank, RankSource.FILE
        if rank is None and prefix.local_rank is not None:
            rank, via = prefix.local_rank, RankSource.LOCAL_PREFIX
        if rank is not None:
            self.ranks_seen.add(rank)
            if prefix.host and prefix.rank is not None and len(self.rank_host) < 65536:
                self.rank_host.setdefault(rank, prefix.host)
        key = (rank, prefix.local_rank)
        ts, self._year = parse_timestamp(prefix.lead + rest, self._year)
        if ts is None and self.arrival is not None:
            ts = self.arrival.at(lineno)  # when `ckptguard run` received the line
        if ts is not None:
            self._last_ts[key] = ts
            if self.latest_ts is None or ts > self.latest_ts:
                self.latest_ts = ts
        ev = Evidence(self._src, lineno, _clip(text), rank)
        if self._pending is not None and self._flush_pending(rest):
            return self._pending_force()
        line = _Line(rest, rest.strip(), rank, via, key, ev, ts)
        for handler in self._handlers:
            wanted = handler(line)
            if wanted is not None:
                return wanted
        return self._pending_force()

    # ---- the handlers, one per kind of line, in the order they are tried ------------------
    # Each returns how many following lines it wants (the line was its kind), or None.
    def _on_excerpt(self, ln: _Line) -> int | None:
        if _EXCERPT_RE.match(ln.rest):  # `[...]` between excerpts: nothing continues across it
            self._close_all()
            return 0
        return None

    def _on_block(self, ln: _Line) -> int | None:
        if self._block is not None and self.block_line(ln.rest, ln.ev):
            return self._pending_force()
        return None

    def _on_nccl(self, ln: _Line) -> int | None:
        m = _NCCL_RE.match(ln.rest)
        return self._nccl_line(m, ln.rank, ln.ev, ln.ts, ln.via) if m else None

    def _on_ignored_marker(self, ln: _Line) -> int | None:
        # "Exception ignored in: <function X.__del__ ...>": Python caught the traceback that
        # follows and the process went on, so it is not the failure (a dataloader's __del__ at
        # shutdown, an atexit callback after the real error).
        if ln.stripped.startswith(_IGNORED_MARKER):
            self._ignored_next[ln.key] = ln.ev.line
            return TRACEBACK_FORCE
        return None

    def _on_after_ignored_marker(self, ln: _Line) -> int | None:
        # Python prints the ignored exception right after its report: a traceback, or its
        # exception line alone. Only that one is ignored; any other line of the stream ends the
        # report, and a traceback after it is one that the process did not survive.
        if ln.key in self._ignored_tail and ln.stripped and not any(m in ln.rest for m in _CHAIN_MARKERS):
            del self._ignored_tail[ln.key]  # the ignored exception's chain ends before this line
        at = self._ignored_next.get(ln.key)
        if at is None or not ln.stripped:  # a blank line (a prefix alone) stands between chained parts
            return None
        if ln.stripped.startswith("Traceback (most recent call") and ln.ev.line - at <= TRACEBACK_FORCE:
            return None  # `_on_traceback_start` marks it ignored
        del self._ignored_next[ln.key]
        if ln.ev.line - at <= TRACEBACK_FORCE and ln.key not in self._tb and _EXC_RE.match(ln.rest):
            self._ignored_tail[ln.key] = ln.ev.line
            return self._pending_force()  # the ignored exception itself, without a traceback
        return None

    def _on_traceback_start(self, ln: _Line) -> int | None:
        if ln.stripped.startswith("Traceback (most recent call"):
            chain = self._chain_next.pop(ln.key, [])
            old = self._tb.get(ln.key)
            if old is not None and old.chain:
                self._close_traceback(ln.key, old, None)
            tb = self._tb[ln.key] = _Traceback(ln.ev, chain=chain, last=ln.ev)
            if self._ignored_next.pop(ln.key, None) is not None:
                tb.ignored = True
            return TRACEBACK_FORCE
        return TRACEBACK_FORCE if ln.stripped.startswith("Original Traceback (most recent call") else None

    def _on_frame(self, ln: _Line) -> int | None:
        fm = _FRAME_RE.match(ln.rest)
        if fm is None:
            return None
        tb = self._tb.get(ln.key)
        if tb is None:  # the log starts (or an excerpt resumes) mid-traceback
            tb = self._tb[ln.key] = _Traceback(ln.ev, chain=self._chain_next.pop(ln.key, []))
        tb.frames.append(f"{fm.group('file')}:{fm.group('func') or '?'}")
        tb.lines.append((tb.frames[-1], ln.ev))
        tb.last, tb.after_frame = ln.ev, True
        return TRACEBACK_FORCE

    def _on_source_line(self, ln: _Line) -> int | None:
        tb = self._tb.get(ln.key)
        if tb is not None and tb.after_frame and ln.rest[:1].isspace():
            tb.code.append(ln.stripped)  # the source line that a frame shows
            tb.lines.append((ln.stripped, ln.ev))
            tb.last, tb.after_frame = ln.ev, False
            return TRACEBACK_FORCE
        return None

    def _on_chain_marker(self, ln: _Line) -> int | None:
        if not any(marker in ln.rest for marker in _CHAIN_MARKERS):
            return None
        tb = self._tb.pop(ln.key, None)
        if tb is not None:
            self._chain_next[ln.key] = tb.chain
        tail = self._ignored_tail.pop(ln.key, None)
        if (tb is not None and tb.ignored) or (tail is not None and ln.ev.line - tail <= TRACEBACK_FORCE):
            # the chain of an ignored exception: its next traceback is ignored as well
            self._ignored_next[ln.key] = ln.ev.line
        return TRACEBACK_FORCE

    def _on_launcher(self, ln: _Line) -> int | None:
        return self._pending_force() if self.launcher_line(ln.rest, ln.ev, ln.ts) else None

    def _on_owner(self, ln: _Line) -> int | None:
        """mp.spawn's "process N terminated with the following error": N owns what follows."""
        if "terminated with" not in ln.rest:
            return None
        for pat in self.rules.traceback_owners:
            om = pat.search(ln.rest)
            if om:
                owner = int(om.group("local"))
                self._owner[ln.key] = (owner, ln.ev.line + OWNER_LINES)
                last = self.events[-1] if self.events else None
                if (
                    last is not None
                    and last.rank is None
                    and last.source == self._src
                    and ln.ev.line - last.evidence[-1].line <= 3
                ):
                    # the launcher's exception reporting that process's failure: an exit
                    # report, weaker than the process's own traceback that follows
                    last.rank, last.rank_via = owner, RankSource.SPAWN_INDEX
                    if last.class_id in GENERIC_CLASSES:
                        last.kind = EventKind.EXIT
                return TRACEBACK_FORCE
        return None

    def _on_facts(self, ln: _Line) -> int | None:
        self._facts(ln.rest, ln.rank, ln.ev)
        if (
            ln.rank is not None
            and ln.stripped.startswith("(")
            and "failed first" in ln.rest
            and self._blame_note(ln.rest, ln.rank, ln.ev)
        ):
            return self._pending_force()  # the other rank's error, quoted: not this rank's own
        ln.warning = "WARN" in ln.rest and any(w.search(ln.rest) for w in self.rules.warning_levels)
        ln.hint = any(h.search(ln.rest) for h in self.rules.hints)
        return None

    def _on_exception(self, ln: _Line) -> int | None:
        em = _EXC_RE.match(ln.rest)
        if em and not ln.hint and not ln.stripped.endswith("Warning"):
            self._exception(ln.key, em.group("type"), em.group("msg") or "", ln.rank, ln.via, ln.ev, ln.ts)
            return self._pending_force() or 1
        return None

    def _on_embedded_exception(self, ln: _Line) -> int | None:
        em = None if ln.hint else _EMBEDDED_EXC_RE.search(ln.rest)
        if em and ln.warning:  # an exception the process handled and logged: a hint, not a failure
            msg = em.group("msg")
            chain = [(em.group("type"), msg)]
            self._emit_exception(em.group("type"), msg, chain, [], [], ln.ev, ln.rank, ln.via, ln.ts, ln.key, hint=True)
            return self._pending_force() or 1
        if em:
            self._exception(ln.key, em.group("type"), em.group("msg"), ln.rank, ln.via, ln.ev, ln.ts, embedded=True)
            return self._pending_force() or 1
        return None

    def _on_signature(self, ln: _Line) -> int | None:
        matches = self.kb.match(ln.rest, exception=False)
        if matches:
            self._emit(
                EventKind.HINT if ln.hint else EventKind.LINE,
                matches,
                [ln.ev],
                ln.rank,
                ln.via,
                ts=ln.ts,
                ts_key=ln.key,
                message=ln.stripped,
            )
        return self._pending_force()

    def _pending_force(self) -> int:
        if self._block is not None:
            self._block_left -= 1
            if self._block_left <= 0:
                self.flush_block_entry()
                self._block = None
                return 0
            return self._block_left
        return TRACEBACK_FORCE // 2 if self._tb else 0

    # ---- bookkeeping --------------------------------------------------------------------
    def _emit(
        self,
        kind: EventKind,
        matches: list[Match],
        evidence: list[Evidence],
        rank: int | None,
        via: RankSource,
        *,
        pid: int | None = None,
        host: str | None = None,
        ts: float | None = None,
        ts_key: tuple[int | None, int | None] | None = None,
        exc_type: str | None = None,
        message: str | None = None,
        frames: list[str] | None = None,
        code: list[str] | None = None,
        operation: str | None = None,
    ) -> Event | None:
        if not matches:
            return None
        if rank is None:
            rank, via = self._rank_hint(message or evidence[0].text, via)
        if rank is None and message:  # the record around an embedded exception names its writer
            rank, via = self._rank_hint(evidence[0].text, via)
        best = matches[0]
        ck = (rank, best.class_id)
        self.counts[ck] = self.counts.get(ck, 0) + 1
        limit = KEEP_PER_RANK_CLASS if rank is not None else KEEP_UNATTRIBUTED_PER_CLASS
        if self._kept.get(ck, 0) >= limit:
            return None
        self._kept[ck] = self._kept.get(ck, 0) + 1
        own = ts is not None
        if ts is None and ts_key is not None:
            ts = self._last_ts.get(ts_key)
        self._seq += 1
        event = Event(
            self._seq,
            kind,
            best.class_id,
            best.weight,
            matches,
            evidence,
            rank,
            via,
            pid=pid,
            host=host,
            ts=ts,
            ts_own=own,
            exc_type=exc_type,
            message=message,
            frames=frames or [],
            code=code or [],
            operation=operation,
        )
        self.events.append(event)
        return event

    def _rank_hint(self, text: str, via: RankSource) -> tuple[int | None, RankSource]:
        """A rank that the message itself names ([Rank N], 'GPU N has a total capacity')."""
        for h in self.rules.rank_hints:
            if h.anchor in text:
                m = h.pattern.search(text)
                if m:
                    return int(m.group("rank")), RankSource(h.source)
        return None, via
