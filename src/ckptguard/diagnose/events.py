"""Event extraction: turn the lines that pass the prefilter into failure events and facts.

One `Extractor` reads all sources of a run. It keeps only what attribution needs: the first few
events per (rank, class), launcher summaries, pid -> rank and rank -> host maps, and save-path
announcements. Everything is bounded, whatever the size of the log.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field

from ckptguard.diagnose.ingest import Source, parse_timestamp, strip_prefixes
from ckptguard.diagnose.kb import KnowledgeBase, Match
from ckptguard.diagnose.mask import Masker

# Literal anchors for the structural parts of a log (tracebacks, launcher lines, NCCL rank
# maps); the KB adds the anchors of its own signatures.
STRUCTURAL_ANCHORS = (
    "rror", "xception", "xit", "Traceback", "SIG", "Segmentation", "atchdog", "aving", "NCCL WARN",
    "NaN", "Killed", "nan", "nranks", "oss is", "[send]", "[receive]",
)
EVIDENCE_CHARS = 400
KEEP_PER_RANK_CLASS = 3
KEEP_UNATTRIBUTED_PER_CLASS = 20
MAX_FRAMES = 12
TRACEBACK_FORCE = 60  # lines read unconditionally after a traceback line

_NCCL_RE = re.compile(r"^(?P<host>[\w.\-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] NCCL (?P<lvl>[A-Z]+) ?(?P<msg>.*)$")
_COMM_RE = re.compile(r"\brank (\d+) nranks (\d+)\b")
_CHANNEL_RE = re.compile(r"Channel \d+/\d+ : (\d+)\[(\d+)\] -> (\d+)\[(\d+)\](?: \[(send|receive)\])?")
_TREES_RE = re.compile(r"Trees \[\d+\] [-\d/]+->(\d+)->")
_FRAME_RE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')
_EXC_RE = re.compile(
    r"^ ?(?P<type>(?:[A-Za-z_][\w]*\.)*(?:[A-Z]\w*(?:Error|Exception|Interrupt|Exit|Failure)|Exception|StopIteration|KeyboardInterrupt|SystemExit))"
    r"(?::[ ]?(?P<msg>.*))?$"
)
_EMBEDDED_EXC_RE = re.compile(r"\b(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)): (?P<msg>\S.*)$")
_SIGTERM_RE = re.compile(r"Sending process (\d+) closing signal (SIG[A-Z]+)")
_FAILED_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_BLOCK_FIELD_RE = re.compile(r"^\s*(time|host|rank|exitcode|error_file|traceback)\s*:\s*(.*)$")
_BLOCK_RANK_RE = re.compile(r"(-?\d+) \(local_rank: (\d+)\)")
_BLOCK_EXIT_RE = re.compile(r"(-?\d+) \(pid: (\d+)\)")
_SRUN_RE = re.compile(r"srun: error: (?P<host>[\w.\-]+): tasks? (?P<tasks>[\d,\-]+): (?P<what>.*)$")
_SAVE_RE = re.compile(r"(?i)\bsav(?:e|ing)\b.{0,40}?\b(?:to|at|into)\s+['\"]?(?P<path>[\w.\-/~]*[\w/][\w.\-]*)")
_CALLED_RE = re.compile(r"CalledProcessError: Command .*--local[_-]rank[= ](\d+).* returned non-zero exit status (-?\d+)")
_WORLD_RE = re.compile(r"\b(?:world[_ ]size|WORLD_SIZE)\s*[=:]\s*(\d{1,7})\b")
_CHAIN_MARKERS = ("During handling of the above exception", "The above exception was the direct cause")

SIGNALS = {1: "SIGHUP", 2: "SIGINT", 4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE",
           9: "SIGKILL", 11: "SIGSEGV", 13: "SIGPIPE", 15: "SIGTERM"}


@dataclass
class Evidence:
    """A line of the log that supports a finding."""

    source: int
    line: int
    text: str
    rank: int | None = None


@dataclass
class Event:
    """One failure observation: an exception, a matching log line, or a process exit."""

    seq: int
    kind: str  # "exception" | "line" | "exit"
    class_id: str
    weight: float
    matches: list[Match]
    evidence: list[Evidence]
    rank: int | None
    rank_via: str
    pid: int | None = None
    host: str | None = None
    ts: float | None = None
    ts_own: bool = False
    exc_type: str | None = None
    message: str | None = None
    frames: list[str] = field(default_factory=list)

    @property
    def source(self) -> int:
        return self.evidence[0].source

    @property
    def line(self) -> int:
        return self.evidence[0].line


@dataclass
class LauncherFailure:
    """A worker exit as the launcher reported it (torchrun summary, srun, DeepSpeed)."""

    rank: int | None
    local_rank: int | None
    pid: int | None
    exitcode: int | None
    host: str | None
    time: float | None
    root_cause: bool
    evidence: Evidence
    signal_note: str = ""


@dataclass
class _Traceback:
    start: Evidence
    frames: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_FRAMES))
    chain: list[tuple[str, str]] = field(default_factory=list)
    last_line: int = 0


@dataclass
class _Block:
    section: str = ""
    entry: dict[str, str] = field(default_factory=dict)
    entry_ev: Evidence | None = None
    equals_seen: int = 0


def _clip(text: str) -> str:
    text = text.strip()
    return text if len(text) <= EVIDENCE_CHARS else text[: EVIDENCE_CHARS - 1] + "…"


class Extractor:
    """Stateful reader of processed lines; one per diagnosis."""

    def __init__(self, kb: KnowledgeBase, masker: Masker) -> None:
        self.kb = kb
        self.masker = masker
        self.sources: list[Source] = []
        self.events: list[Event] = []
        self._kept: dict[tuple[int | None, str], int] = {}
        self.counts: dict[tuple[int | None, str], int] = {}
        self.pid_rank: dict[int, tuple[int, int]] = {}  # pid -> (rank, priority)
        self.pid_host: dict[int, str] = {}
        self.rank_host: dict[int, str] = {}
        self.ranks_seen: set[int] = set()
        self.world_size = 0
        self.launcher: list[LauncherFailure] = []
        self.sigterm: list[tuple[int, Evidence]] = []
        self.saves: dict[str, dict[int, Evidence]] = {}
        self.lines_processed = 0
        self._seq = 0
        self._src = 0
        self._source: Source | None = None
        self._year = 2000
        self._tb: dict[tuple[int | None, int | None], _Traceback] = {}
        self._chain_next: dict[tuple[int | None, int | None], list[tuple[str, str]]] = {}
        self._last_ts: dict[tuple[int | None, int | None], float] = {}
        self._recent: deque[tuple[tuple[object, ...], Event]] = deque(maxlen=64)
        self._block: _Block | None = None
        self._block_left = 0

    # ---- per source ---------------------------------------------------------------------
    def begin_source(self, source: Source) -> None:
        """Reset the per-stream state: tracebacks never continue across files."""
        self.sources.append(source)
        self._src = len(self.sources) - 1
        self._source = source
        self._tb.clear()
        self._chain_next.clear()
        self._last_ts.clear()
        self._block = None
        self._block_left = 0

    def end_source(self) -> None:
        """Flush tracebacks cut off by the end of the file (a log cut mid-traceback)."""
        for key, tb in list(self._tb.items()):
            if tb.chain:
                self._close_traceback(key, tb, None)
        self._tb.clear()
        self._flush_block_entry()
        self._block = None

    # ---- the line handler ---------------------------------------------------------------
    def feed(self, raw: bytes, lineno: int) -> int:
        """Handle one line; return how many following lines must be read unconditionally."""
        self.lines_processed += 1
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not text.strip():
            return self._pending_force()
        text = self.masker.mask(text)
        src = self._source
        assert src is not None
        prefix, rest = strip_prefixes(text)
        if prefix.host:
            self.masker.learn_host(prefix.host)
        rank = prefix.rank
        via = "prefix" if rank is not None else ""
        if rank is None and src.rank is not None:
            rank, via = src.rank, "file"
        if rank is None and prefix.local_rank is not None:
            rank, via = prefix.local_rank, "local-prefix"
        if rank is not None:
            self.ranks_seen.add(rank)
        key = (rank, prefix.local_rank)
        ts, self._year = parse_timestamp(rest, self._year)
        if ts is not None:
            self._last_ts[key] = ts
        ev = Evidence(self._src, lineno, _clip(text), rank)

        if self._block is not None and self._block_line(rest, ev):
            return self._pending_force()

        m = _NCCL_RE.match(rest)
        if m:
            return self._nccl_line(m, rank, ev, ts, via)

        stripped = rest.strip()
        if stripped.startswith("Traceback (most recent call last)") or stripped.startswith(
                "Original Traceback (most recent call last)"):
            if stripped.startswith("Traceback"):
                chain = self._chain_next.pop(key, [])
                old = self._tb.get(key)
                if old is not None and old.chain:
                    self._close_traceback(key, old, None)
                self._tb[key] = _Traceback(ev, chain=chain, last_line=lineno)
            return TRACEBACK_FORCE
        fm = _FRAME_RE.match(rest)
        if fm:
            tb = self._tb.get(key)
            if tb is not None:
                tb.frames.append(f"{fm.group('file')}:{fm.group('func')}")
                tb.last_line = lineno
            return TRACEBACK_FORCE if self._tb else self._pending_force()
        if any(marker in rest for marker in _CHAIN_MARKERS):
            tb = self._tb.pop(key, None)
            if tb is not None:
                self._chain_next[key] = tb.chain
            return TRACEBACK_FORCE

        em = _EXC_RE.match(rest)
        if em and not stripped.endswith("Warning") and "Warning:" not in (em.group("type") or ""):
            self._exception(key, em.group("type"), em.group("msg") or "", rank, via, ev, ts)
            return self._pending_force()

        if self._launcher_line(rest, ev, ts):
            return self._pending_force()

        if rank is not None:
            sm = _SAVE_RE.search(rest)
            if sm and len(self.saves) < 10_000:
                self.saves.setdefault(sm.group("path"), {}).setdefault(rank, ev)
        wm = _WORLD_RE.search(rest)
        if wm:
            self.world_size = max(self.world_size, int(wm.group(1)))

        em2 = _EMBEDDED_EXC_RE.search(rest)
        if em2 and not _FRAME_RE.match(rest):
            self._exception(key, em2.group("type"), em2.group("msg"), rank, via, ev, ts,
                            embedded=True)
            return self._pending_force()

        matches = self.kb.match(rest, exception=False)
        if matches:
            self._emit("line", matches, [ev], rank, via, ts=ts, ts_key=key)
        return self._pending_force()

    def _pending_force(self) -> int:
        if self._block is not None:
            self._block_left -= 1
            if self._block_left <= 0:
                self._flush_block_entry()
                self._block = None
                return 0
            return self._block_left
        return TRACEBACK_FORCE // 2 if self._tb else 0

    # ---- NCCL ---------------------------------------------------------------------------
    def _nccl_line(self, m: re.Match[str], rank: int | None, ev: Evidence, ts: float | None,
                   via: str) -> int:
        host = m.group("host")
        pid = int(m.group("pid"))
        dev = int(m.group("dev"))
        self.pid_host.setdefault(pid, host)
        self.masker.learn_host(host)
        msg = m.group("msg")
        if rank is not None and via == "prefix":
            self._map_pid(pid, rank, 10)
        cm = _COMM_RE.search(msg)
        if cm:
            nranks = int(cm.group(2))
            self.world_size = max(self.world_size, nranks)
            self._map_pid(pid, int(cm.group(1)), 2 + nranks)
        else:
            ch = _CHANNEL_RE.search(msg)
            if ch:
                src, sdev, dst, ddev = (int(ch.group(i)) for i in range(1, 5))
                direction = ch.group(5)
                if sdev == dev and ddev != dev:
                    me = src
                elif ddev == dev and sdev != dev:
                    me = dst
                else:
                    me = dst if direction == "receive" else src
                self._map_pid(pid, me, 1)
            else:
                tm = _TREES_RE.search(msg)
                if tm:
                    self._map_pid(pid, int(tm.group(1)), 1)
        if m.group("lvl") in ("WARN", "ERROR"):
            matches = self.kb.match(m.group(0), exception=False)
            if matches:
                self._emit("line", matches, [ev], rank, via, pid=pid, host=host, ts=ts)
        return self._pending_force()

    def _map_pid(self, pid: int, rank: int, priority: int) -> None:
        old = self.pid_rank.get(pid)
        if old is None or priority > old[1]:
            self.pid_rank[pid] = (rank, priority)
            self.ranks_seen.add(rank)

    # ---- exceptions ---------------------------------------------------------------------
    def _exception(self, key: tuple[int | None, int | None], etype: str, msg: str,
                   rank: int | None, via: str, ev: Evidence, ts: float | None,
                   embedded: bool = False) -> None:
        short = etype.rsplit(".", 1)[-1]
        if short == "ChildFailedError":
            self._tb.pop(key, None)  # the launcher's own traceback: a summary follows
            self._block = _Block()
            self._block_left = 400
            return
        if short == "CalledProcessError":
            cm = _CALLED_RE.search(ev.text)
            if cm:
                code = int(cm.group(2))
                self.launcher.append(LauncherFailure(None, int(cm.group(1)), None, code, None, ts,
                                                     False, ev))
            return
        tb = self._tb.get(key)
        if tb is not None and not embedded:
            tb.chain.append((etype, msg))
            tb.last_line = ev.line
            self._close_traceback(key, tb, ev, ts=ts, rank=rank, via=via)
            return
        chain = self._chain_next.pop(key, [])
        self._emit_exception(etype, msg, [*chain, (etype, msg)], [], ev, rank, via, ts, key)

    def _close_traceback(self, key: tuple[int | None, int | None], tb: _Traceback,
                         ev: Evidence | None, *, ts: float | None = None,
                         rank: int | None = None, via: str = "") -> None:
        self._tb.pop(key, None)
        if not tb.chain:
            return
        etype, msg = tb.chain[-1]
        evidence = ev if ev is not None else tb.start
        if ev is None:
            rank, via = key[0], "prefix" if key[0] is not None else ""
        self._emit_exception(etype, msg, tb.chain, list(tb.frames), evidence, rank, via, ts, key)

    def _emit_exception(self, etype: str, msg: str, chain: list[tuple[str, str]],
                        frames: list[str], ev: Evidence, rank: int | None, via: str,
                        ts: float | None, key: tuple[int | None, int | None]) -> None:
        ident = (key, self._src, etype, msg[:200])
        for old_ident, old in self._recent:
            if old_ident == ident and ev.line - old.evidence[-1].line < 400:
                if len(old.evidence) < 4:
                    old.evidence.append(ev)
                if frames and not old.frames:
                    old.frames = frames
                return
        context = "\n".join(frames)
        best: dict[str, float] = {}
        for t, m in chain:
            for match in self.kb.match(f"{t}: {m}" if m else t, exception=True, context=context):
                best[match.class_id] = max(best.get(match.class_id, 0.0), match.weight)
        matches = sorted((Match(c, w) for c, w in best.items()), key=lambda x: -x.weight)
        event = self._emit("exception", matches, [ev], rank, via, ts=ts, ts_key=key,
                           exc_type=etype, message=msg, frames=frames)
        if event is not None:
            self._recent.append((ident, event))

    # ---- launcher -----------------------------------------------------------------------
    def _launcher_line(self, rest: str, ev: Evidence, ts: float | None) -> bool:
        m = _SIGTERM_RE.search(rest)
        if m:
            self.sigterm.append((int(m.group(1)), ev))
            return True
        m = _FAILED_RE.search(rest)
        if m:
            code, local, pid = int(m.group(1)), int(m.group(2)), int(m.group(3))
            rank = self.pid_rank.get(pid, (None, 0))[0]
            self.launcher.append(LauncherFailure(rank, local, pid, code, None, ts, False, ev))
            return True
        m = _SRUN_RE.search(rest)
        if m:
            host = m.group("host")
            self.masker.learn_host(host)
            what = m.group("what")
            code = None
            cm = re.search(r"exit code (\d+)", what)
            if cm:
                code = int(cm.group(1))
            elif "Killed" in what:
                code = -9
            elif "Segmentation" in what:
                code = -11
            elif "Terminated" in what:
                code = -15
            for task in _expand(m.group("tasks")):
                self.launcher.append(LauncherFailure(task, None, None, code, host, ts, False, ev))
                self.rank_host.setdefault(task, host)
            return "rror" not in what or code is not None
        return False

    def _block_line(self, rest: str, ev: Evidence) -> bool:
        """Parse torchrun's ChildFailedError summary; True if the line belonged to it."""
        b = self._block
        assert b is not None
        s = rest.strip()
        if s.startswith("Root Cause"):
            self._flush_block_entry()
            b.section = "root"
            return True
        if s.startswith("Failures:"):
            self._flush_block_entry()
            b.section = "failures"
            return True
        if re.fullmatch(r"\[\d+\]:", s):
            self._flush_block_entry()
            return True
        if s.startswith("====="):
            b.equals_seen += 1
            if b.equals_seen >= 2:
                self._flush_block_entry()
                self._block = None
            return True
        fm = _BLOCK_FIELD_RE.match(rest)
        if fm and b.section:
            b.entry[fm.group(1)] = fm.group(2).strip()
            if fm.group(1) in ("rank", "exitcode") or b.entry_ev is None:
                b.entry_ev = ev
            return True
        return s.startswith("-----") or s == "<NO_OTHER_FAILURES>" or s.endswith("FAILED")

    def _flush_block_entry(self) -> None:
        b = self._block
        if b is None or not b.entry:
            return
        e, ev = b.entry, b.entry_ev
        b.entry, b.entry_ev = {}, None
        rank = local = pid = code = None
        rm = _BLOCK_RANK_RE.search(e.get("rank", ""))
        if rm:
            rank, local = int(rm.group(1)), int(rm.group(2))
        xm = _BLOCK_EXIT_RE.search(e.get("exitcode", ""))
        if xm:
            code, pid = int(xm.group(1)), int(xm.group(2))
        host = e.get("host") or None
        if host:
            self.masker.learn_host(host)
        t, _ = parse_timestamp(e.get("time", "").replace("_", " "), self._year)
        if ev is None:
            return
        if rank is not None:
            self.ranks_seen.add(rank)
            if host:
                self.rank_host.setdefault(rank, host)
            if pid is not None:
                self._map_pid(pid, rank, 50)
        self.launcher.append(LauncherFailure(rank, local, pid, code, host, t, b.section == "root",
                                             ev, e.get("traceback", "")))

    # ---- bookkeeping --------------------------------------------------------------------
    def _emit(self, kind: str, matches: list[Match], evidence: list[Evidence], rank: int | None,
              via: str, *, pid: int | None = None, host: str | None = None,
              ts: float | None = None, ts_key: tuple[int | None, int | None] | None = None,
              exc_type: str | None = None, message: str | None = None,
              frames: list[str] | None = None) -> Event | None:
        if not matches:
            return None
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
        event = Event(self._seq, kind, best.class_id, best.weight, matches, evidence, rank, via,
                      pid=pid, host=host, ts=ts, ts_own=own, exc_type=exc_type,
                      message=message, frames=frames or [])
        self.events.append(event)
        return event


def _expand(tasks: str) -> list[int]:
    """'0-3,7' -> [0, 1, 2, 3, 7] (bounded)."""
    out: list[int] = []
    for part in tasks.split(","):
        if "-" in part:
            a, _, b = part.partition("-")
            if a.isdigit() and b.isdigit():
                out.extend(range(int(a), min(int(b), int(a) + 4096) + 1))
        elif part.isdigit():
            out.append(int(part))
    return out
