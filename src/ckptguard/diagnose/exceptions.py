"""Python tracebacks and exceptions: frames, chains, a message wrapped onto the next line, a
traceback cut before its exception line, and the operation that the frames show.

A mixin of the extractor (`events.Extractor`), as `facts.FactLines` is.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptguard.diagnose.kb import KnowledgeBase, Match
from ckptguard.diagnose.launchers import Block
from ckptguard.diagnose.model import Event, EventKind, Evidence, RankSource
from ckptguard.diagnose.rules import Operation, Rules

GENERIC_CLASSES = frozenset({"python_exception", "unclassified_error"})
MAX_FRAMES = 12
ANNOUNCE_LINES = 60  # how far before a cut traceback a line announcing its operation counts
_RAISE_NEW = re.compile(r"raise\s+([\w.]+)\(")
_WINDOWS_PATH = re.compile(r"^[A-Za-z]:\\")
_FRAME_RE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)(?:,? in (?P<func>\S+))?')
_EXC_RE = re.compile(
    r"^ ?(?P<type>(?:[A-Za-z_][\w]*\.)*(?:[A-Z]\w*(?:Error|Exception|Interrupt|Exit|Failure)"
    r"|Exception|StopIteration|KeyboardInterrupt|SystemExit"
    # standard-library exceptions not named *Error: zipfile's, and modules' lower-case `error`
    r"|Bad(?:Zip|Gzip)File|(?:[a-z_]\w*\.)+(?:error|timeout|gaierror)))"
    r"(?::[ ]?(?P<msg>.*))?$"
)


@dataclass
class _Traceback:
    start: Evidence
    frames: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_FRAMES))
    code: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_FRAMES))
    chain: list[tuple[str, str]] = field(default_factory=list)
    last: Evidence | None = None
    after_frame: bool = False
    lines: deque[tuple[str, Evidence]] = field(default_factory=lambda: deque(maxlen=2 * MAX_FRAMES))
    ignored: bool = False  # Python printed it as "Exception ignored in: ..." and went on


@dataclass
class _Pending:
    """An exception whose message wraps onto the next line (an unclosed quote)."""

    key: tuple[int | None, int | None]
    etype: str
    msg: str
    rank: int | None
    via: RankSource
    ev: Evidence
    ts: float | None
    embedded: bool


def _op_lines(op: Operation, lines: list[tuple[str, Evidence]]) -> list[Evidence]:
    """The frame and source lines that show the operation (the innermost two), for evidence."""
    frames = op.frames
    hits = [ev for text, ev in lines if frames is not None and frames.search(text)]
    if not hits:  # a rule that needs several lines together: the innermost source line
        hits = [ev for text, ev in lines if ":" not in text or " " in text][-1:]
    return hits[-2:]


def _raised_by_code(etype: str, code: list[str]) -> bool:
    """The innermost source line builds and raises this very exception: the code's author chose
    the type and words, so no operation's errno family (a write, a load) explains it."""
    if not code:
        return False
    m = _RAISE_NEW.match(code[-1].strip())
    return m is not None and m.group(1).rsplit(".", 1)[-1] == etype.rsplit(".", 1)[-1]


class ExceptionLines:
    """Mixin of the extractor: exceptions and the tracebacks around them."""

    kb: KnowledgeBase
    rules: Rules
    events: list[Event]
    reported_ranks: list[tuple[int, Evidence]]
    latest_ts: float | None
    _src: int
    _lineno: int
    _tb: dict[tuple[int | None, int | None], _Traceback]
    _chain_next: dict[tuple[int | None, int | None], list[tuple[str, str]]]
    _ignored_tail: dict[tuple[int | None, int | None], int]
    _pending: _Pending | None
    _owner: dict[tuple[int | None, int | None], tuple[int, int]]
    _announced: tuple[Operation, int, int, Evidence] | None
    _recent: deque[tuple[tuple[object, ...], Event]]
    _block: Block | None
    _block_left: int
    _emit: Callable[..., Event | None]

    def _exception(
        self,
        key: tuple[int | None, int | None],
        etype: str,
        msg: str,
        rank: int | None,
        via: RankSource,
        ev: Evidence,
        ts: float | None,
        embedded: bool = False,
    ) -> None:
        short = etype.rsplit(".", 1)[-1]
        if short == "ChildFailedError":
            self._tb.pop(key, None)  # the launcher's own traceback: a summary follows
            self._block = Block()
            self._block_left = 400
            return
        if msg.count("'") % 2 == 1 and not embedded:  # a quoted path wrapped onto the next line
            self._pending = _Pending(key, etype, msg, rank, via, ev, ts, embedded)
            return
        self._exception_done(key, etype, msg, rank, via, ev, ts, embedded)

    def _flush_pending(self, nxt: str | None) -> bool:
        """Finish a wrapped exception; True if ``nxt`` was its continuation."""
        p, self._pending = self._pending, None
        if p is None:
            return False
        joined = nxt is not None and "'" in nxt and not _FRAME_RE.match(nxt) and not _EXC_RE.match(nxt)
        msg = p.msg + nxt.strip() if joined and nxt is not None else p.msg
        self._exception_done(p.key, p.etype, msg, p.rank, p.via, p.ev, p.ts, p.embedded)
        return joined

    def _exception_done(
        self,
        key: tuple[int | None, int | None],
        etype: str,
        msg: str,
        rank: int | None,
        via: RankSource,
        ev: Evidence,
        ts: float | None,
        embedded: bool,
    ) -> None:
        tb = self._tb.get(key)
        if tb is not None and not embedded:
            tb.chain.append((etype, msg))
            self._close_traceback(key, tb, ev, ts=ts, rank=rank, via=via)
            return
        chain = self._chain_next.pop(key, [])
        self._emit_exception(etype, msg, [*chain, (etype, msg)], [], [], ev, rank, via, ts, key)

    def _close_traceback(
        self,
        key: tuple[int | None, int | None],
        tb: _Traceback,
        ev: Evidence | None,
        *,
        ts: float | None = None,
        rank: int | None = None,
        via: RankSource = RankSource.NONE,
    ) -> None:
        self._tb.pop(key, None)
        if tb.ignored:
            if ev is not None:  # a chained exception may follow, ignored with it
                self._ignored_tail[key] = ev.line
            return  # caught and reported by the interpreter: the process did not fail of it
        if ev is None:
            rank, via = key[0], RankSource.PREFIX if key[0] is not None else RankSource.NONE
        if not tb.chain:
            self._cut_traceback(key, tb, rank, via)
            return
        etype, msg = tb.chain[-1]
        evidence = ev if ev is not None else tb.start
        self._emit_exception(
            etype, msg, tb.chain, list(tb.frames), list(tb.code), evidence, rank, via, ts, key, tb_lines=list(tb.lines)
        )

    def _cut_traceback(
        self, key: tuple[int | None, int | None], tb: _Traceback, rank: int | None, via: RankSource
    ) -> None:
        """A traceback without its exception line: still a failure, of an unknown kind."""
        frames = list(tb.frames)
        if not frames or any(self.rules.launcher_frames.search(f) for f in frames):
            return  # nothing to go on, or the launcher's own traceback
        evidence = [tb.start] + ([tb.last] if tb.last is not None and tb.last is not tb.start else [])
        code = list(tb.code)
        op = self._operation(frames, code)
        if op is not None:
            evidence += [e for e in _op_lines(op, list(tb.lines)) if e not in evidence]
        basis = []
        if op is None and self._announced is not None:
            # the frames show nothing known: the operation the log announced just before
            aop, asrc, aline, aev = self._announced
            if asrc == self._src and 0 <= tb.start.line - aline <= ANNOUNCE_LINES:
                op = aop
                evidence.append(aev)
                basis.append(f"line {aline} announced it")
        if rank is None:
            rank, via = self._spawn_rank(key, via)
        match = Match("python_exception", 0.3)
        if op is not None:
            cls, why = op.decide(rank, latest=self.latest_ts, windows=any(_WINDOWS_PATH.match(f) for f in frames))
            match = Match(cls, op.weight)
            basis += [why] if why else []
        event = self._emit(
            EventKind.CUT,
            [match],
            evidence,
            rank,
            via,
            ts_key=key,
            exc_type="traceback cut before its exception line",
            frames=frames,
            code=code,
            operation=op.name if op else None,
        )
        if event is not None:
            event.operation_basis = "; ".join(basis)

    def _spawn_rank(self, key: tuple[int | None, int | None], via: RankSource) -> tuple[int | None, RankSource]:
        """The process that a launcher named as the owner of the traceback that followed."""
        owner = self._owner.get(key)
        if owner is not None and self._lineno <= owner[1]:
            return owner[0], RankSource.SPAWN_INDEX
        return None, via

    def _operation(self, frames: list[str], code: list[str], exc: str | None = None) -> Operation | None:
        """The first operation (KB order: most specific first) that the frames show; for an
        exception, only one whose ``errors`` family the exception belongs to."""
        for op in self.rules.operations:
            if exc is not None and (op.errors is None or not op.errors.search(exc)):
                continue
            if op.matches(frames, code):
                return op
        return None

    def _blame(self, event: Event, exc: str, ev: Evidence) -> None:
        """An error whose own words say another rank failed first (a library's agreed failure):
        that rank is reported, and this one's error is its consequence."""
        for rep in self.rules.blame_reports:
            if rep.anchor in exc:
                bm = rep.pattern.search(exc)
                if bm:
                    event.blames = int(bm.group("ranks"))
                    if event.blames != event.rank and len(self.reported_ranks) < 64:
                        self.reported_ranks.append((event.blames, ev))
                    return

    def _emit_exception(
        self,
        etype: str,
        msg: str,
        chain: list[tuple[str, str]],
        frames: list[str],
        code: list[str],
        ev: Evidence,
        rank: int | None,
        via: RankSource,
        ts: float | None,
        key: tuple[int | None, int | None],
        tb_lines: list[tuple[str, Evidence]] | None = None,
        hint: bool = False,
    ) -> None:
        ident = (key, self._src, etype, msg[:200], hint)
        for old_ident, old in self._recent:
            if old_ident == ident and ev.line - old.evidence[-1].line < 400:
                if len(old.evidence) < 4:
                    old.evidence.append(ev)
                if frames and not old.frames:
                    old.frames, old.code = frames, code
                return
        context = "\n".join([*frames, *code])
        best: dict[str, float] = {}
        for t, m in chain:
            for match in self.kb.match(f"{t}: {m}" if m else t, exception=True, context=context):
                best[match.class_id] = max(best.get(match.class_id, 0.0), match.weight)
        if rank is None:
            rank, via = self._spawn_rank(key, via)
        op_name = None
        extra: list[Evidence] = []
        if set(best) <= GENERIC_CLASSES and not _raised_by_code(etype, code):
            # nothing specific: what was being done decides
            op = self._operation(frames, code, exc=f"{etype}: {msg}")
            if op is not None:
                cls = op.class_for(rank, windows=any(_WINDOWS_PATH.match(f) for f in frames))
                best = {c: min(w, op.weight * 0.9) for c, w in best.items()}  # kept as alternatives
                best[cls] = op.weight
                op_name = op.name
                extra = _op_lines(op, tb_lines or [])
        matches = sorted((Match(c, w) for c, w in best.items()), key=lambda x: -x.weight)
        event = self._emit(
            EventKind.HINT if hint else EventKind.EXCEPTION,
            matches,
            [ev, *extra],
            rank,
            via,
            ts=ts,
            ts_key=key,
            exc_type=etype,
            message=msg,
            frames=frames,
            code=code,
            operation=op_name,
        )
        if event is not None:
            self._recent.append((ident, event))
            self._blame(event, f"{etype}: {msg}", ev)
