"""Attribution: which events are causes and which consequences, and which rank failed first.

The initiating rank is the rank whose first *primary* failure came first: by the failure lines'
own timestamps when every candidate has one, else by position in one merged log, else by the
launcher's "first observed failure". Consequences are the classes marked `collateral` (launcher
SIGTERM, connection closed by peer, collective timeouts) and the classes that a cause present
in the same log explains (``[[cause]]`` in ``_rules.toml``). When the log does not show the
rank, the diagnosis says so instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptguard.diagnose.events import Extractor
from ckptguard.diagnose.kb import KnowledgeBase, Match
from ckptguard.diagnose.model import (
    Event,
    EventKind,
    Evidence,
    LauncherFailure,
    OrderingBasis,
    RankSource,
)

GENERIC = frozenset({"python_exception", "unclassified_error"})
EXIT_SEQ = 10**9  # exits and SIGTERMs come from summaries: after every line of the log


@dataclass
class RankView:
    """One rank's events (rank None: the events that no line or map attributes)."""

    events: list[Event] = field(default_factory=list)
    primary: list[Event] = field(default_factory=list)
    collateral: list[Event] = field(default_factory=list)


@dataclass
class Attribution:
    """What attribution decided; scoring and advice work from it."""

    events: list[Event]
    views: dict[int | None, RankView]
    launcher: list[LauncherFailure]
    sigterm_ranks: set[int]
    known: set[int]
    world: int | None
    init: Event | None = None
    init_rank: int | None = None
    basis: OrderingBasis = OrderingBasis.NO_PRIMARY
    firsts: dict[int, Event] = field(default_factory=dict)
    also: list[int] = field(default_factory=list)
    hints: list[Event] = field(default_factory=list)
    reported: list[tuple[int, Evidence]] = field(default_factory=list)
    sigterm_lines: int = 0
    shown: set[int] = field(default_factory=set)  # ranks that any line names (not the world's range)


def tier(kb: KnowledgeBase, e: Event) -> int:
    """3 a specific class, 2 a generic exception, 1 weak (an exit, a cut traceback, a weak
    class), 0 a hint: a higher tier is a better account of what failed."""
    if e.kind == EventKind.HINT:
        return 0
    if e.kind in (EventKind.EXIT, EventKind.CUT) or kb[e.class_id].weak:
        return 1
    return 2 if e.class_id in GENERIC else 3


def when(e: Event) -> tuple[float, int]:
    """Sort key: own timestamp first (lines without one sort last), then log order."""
    return (e.ts if e.ts_own and e.ts is not None else float("inf"), e.seq)


def best_of(kb: KnowledgeBase, events: list[Event]) -> Event:
    """The event that best names a rank's failure: highest tier, a named class over the generic
    ones, weight, exception over line."""
    return max(
        events, key=lambda e: (tier(kb, e), e.class_id not in GENERIC, e.weight, e.kind == EventKind.EXCEPTION, -e.seq)
    )


def _stop_without_ranks(sigterm: list[tuple[int, Evidence]]) -> Event:
    """The launcher's stop when its "Sending process N closing signal" lines are all the log
    shows and no pid maps to a rank: the stop itself is the finding, its rank unknown. SIGINT is
    a Ctrl-C passed on to the workers; any other signal is the launcher shutting them down."""
    ev = sigterm[0][1]
    cls = "interrupted" if "closing signal SIGINT" in ev.text else "launcher_sigterm"
    return Event(EXIT_SEQ + ev.line, EventKind.EXIT, cls, 0.8, [Match(cls, 0.8)], [ev], None, RankSource.NONE)


def collect(ex: Extractor, kb: KnowledgeBase) -> Attribution:
    """Events with ranks resolved, launcher exits added, and causes told from consequences."""
    rules = kb.rules
    events = [e for e in ex.events]
    for e in events:
        if e.rank is None and e.pid is not None and e.pid in ex.pid_rank:
            e.rank, e.rank_via = ex.pid_rank[e.pid][0], RankSource.PID
    launcher = _resolve_launcher(ex)
    sigterm_ranks: dict[int, Event] = {}
    for pid, ev in ex.sigterm:
        if pid in ex.pid_rank:
            r = ex.pid_rank[pid][0]
            sigterm_ranks.setdefault(
                r,
                Event(
                    EXIT_SEQ + ev.line,
                    EventKind.EXIT,
                    "launcher_sigterm",
                    0.9,
                    [Match("launcher_sigterm", 0.9)],
                    [ev],
                    r,
                    RankSource.PID,
                ),
            )
    _bind(events, launcher, kb)
    for lf in launcher:
        exit_ev = exit_event(lf, kb)
        if exit_ev is not None:
            events.append(exit_ev)
    events.extend(sigterm_ranks.values())

    hints = [e for e in events if e.kind == EventKind.HINT]
    events = [e for e in events if e.kind != EventKind.HINT]
    if not events and ex.sigterm:
        events.append(_stop_without_ranks(ex.sigterm))
    present = {e.class_id for e in events if not kb[e.class_id].collateral}
    views: dict[int | None, RankView] = {}
    for e in events:
        views.setdefault(e.rank, RankView()).events.append(e)
    for view in views.values():
        strong: list[Event] = []
        weak: list[Event] = []
        for e in view.events:
            if (
                kb[e.class_id].collateral
                or rules.explained(e.class_id, present)
                or (e.blames is not None and e.rank is not None and e.blames != e.rank)
            ):
                view.collateral.append(e)
            elif tier(kb, e) >= 2:
                strong.append(e)
            else:
                weak.append(e)
        view.primary = strong or ([] if view.collateral else weak)
        if not view.primary and weak and view.collateral:
            # an exit (a SIGKILL) whose known consequence this rank also shows is its cause
            view.primary = [e for e in weak if any(rules.explained(c.class_id, {e.class_id}) for c in view.collateral)]
        if not view.primary and weak and view.collateral:
            # unattributed exits on one host, consequences on others (a multi-node launcher that
            # names hosts, not ranks): the exit is a cause of its own
            seen = {e.host for e in view.collateral}
            view.primary = [
                e
                for e in weak
                if e.kind == EventKind.EXIT and e.host is not None and None not in seen and e.host not in seen
            ]
    world = ex.world_size or None
    known = set(ex.ranks_seen) | {r for r in views if r is not None}
    if world:
        known |= set(range(world))
    shown = set(ex.ranks_seen) | ex.named_ranks | {r for r in views if r is not None}
    return Attribution(
        events,
        views,
        launcher,
        set(sigterm_ranks),
        known,
        world or (max(known) + 1 if known else None),
        hints=hints,
        reported=list(ex.reported_ranks),
        sigterm_lines=len(ex.sigterm),
        shown=shown,
    )


def choose(att: Attribution, kb: KnowledgeBase) -> None:
    """Pick the initiating event and rank (or leave ``init`` None: only consequences)."""
    _choose(att, kb)
    init = att.init
    if init is not None and att.init_rank is None and len(att.shown) == 1 and (att.world or 1) <= 1:
        (only,) = att.shown  # one process, or a log that names one rank only...
        if only not in att.views or not att.views[only].collateral:  # ...and not as a waiter
            att.init_rank = only
            init.rank, init.rank_via = only, RankSource.ONLY_RANK


def _choose(att: Attribution, kb: KnowledgeBase) -> None:
    views = att.views
    firsts = {
        r: min(v.primary, key=lambda e: (-min(tier(kb, e), 2), e.class_id in GENERIC, *when(e)))
        for r, v in views.items()
        if v.primary and r is not None
    }
    unattr = views.get(None)
    first_unattr = None
    consequences = any(v.collateral for v in views.values())
    # A cut traceback that shows nothing (no exception line, no known operation), on no rank,
    # does not outweigh the consequences that the log does show: they say more.
    candidates = (
        [e for e in unattr.primary if not (consequences and e.kind == EventKind.CUT and e.class_id in GENERIC)]
        if unattr
        else []
    )
    if candidates:
        top = max(tier(kb, e) for e in candidates)
        first_unattr = min(
            (e for e in candidates if tier(kb, e) == top), key=lambda e: (e.class_id in GENERIC, *when(e))
        )
    ranked_top = max((tier(kb, best_of(kb, views[r].primary)) for r in firsts), default=-1)
    att.firsts = firsts
    if firsts and (first_unattr is None or ranked_top >= tier(kb, first_unattr)):
        order, basis = _order(firsts, att.launcher)
        att.init_rank = order[0]
        att.init = best_of(kb, views[order[0]].primary)
        att.basis = basis
        att.also = order[1:]
    elif first_unattr is not None:
        att.init = best_of(kb, [e for e in candidates if tier(kb, e) == tier(kb, first_unattr)])
        att.basis = OrderingBasis.UNATTRIBUTED
        att.also = sorted(firsts, key=lambda r: firsts[r].seq)


def _order(firsts: dict[int, Event], launcher: list[LauncherFailure]) -> tuple[list[int], OrderingBasis]:
    """Order candidate ranks by when they failed, saying what the order rests on."""
    evs = list(firsts.items())
    if len(evs) == 1:
        return [evs[0][0]], OrderingBasis.ONLY_ONE
    if all(e.ts_own and e.ts is not None for _, e in evs):
        evs.sort(key=lambda kv: (kv[1].ts, kv[1].seq))
        return [r for r, _ in evs], OrderingBasis.TIMESTAMPS
    rc = sorted((lf for lf in launcher if lf.root_cause and lf.rank in firsts), key=lambda x: x.time or 0.0)
    if rc and rc[0].rank is not None and all(e.kind == EventKind.EXIT for _, e in evs):
        # only exits that torchrun's summary reports: it lists the other failures before its
        # Root Cause, so their position says nothing; its first observed failure does
        first = rc[0].rank
        rest = sorted((r for r in firsts if r != first), key=lambda r: (firsts[r].ts or 0.0, firsts[r].seq))
        return [first, *rest], OrderingBasis.ROOT_CAUSE
    if len({e.source for _, e in evs}) == 1:
        evs.sort(key=lambda kv: kv[1].seq)
        return [r for r, _ in evs], OrderingBasis.LOG_ORDER
    rc = sorted((lf for lf in launcher if lf.root_cause and lf.rank in firsts), key=lambda x: x.time or 0.0)
    if rc and rc[0].rank is not None:
        first = rc[0].rank
        rest = sorted((r for r in firsts if r != first), key=lambda r: firsts[r].seq)
        return [first, *rest], OrderingBasis.ROOT_CAUSE
    evs.sort(key=lambda kv: kv[1].seq)
    return [r for r, _ in evs], OrderingBasis.FILE_ORDER


def _resolve_launcher(ex: Extractor) -> list[LauncherFailure]:
    out = []
    single_node = len({lf.host for lf in ex.launcher if lf.host}) <= 1
    for lf in ex.launcher:
        if lf.rank is None and lf.pid is not None and lf.pid in ex.pid_rank:
            lf.rank = ex.pid_rank[lf.pid][0]
        if lf.rank is None and lf.local_rank is not None and single_node and (not ex.world_size or ex.nnodes == 1):
            lf.rank = lf.local_rank
        out.append(lf)
    # the same failure is often reported twice (the 'failed' line and the summary block)
    seen: set[tuple[int | None, int | None]] = set()
    uniq = []
    for lf in sorted(out, key=lambda x: (not x.root_cause, x.evidence.line)):
        k = (lf.rank, lf.exitcode)
        if k in seen and (lf.rank is not None or not lf.rank_reliable):
            continue
        seen.add(k)
        uniq.append(lf)
    return uniq


def _bind(events: list[Event], launcher: list[LauncherFailure], kb: KnowledgeBase) -> None:
    """Give unattributed failures the rank that the launcher says failed with a message."""
    attributed = {
        e.rank for e in events if e.rank is not None and not kb[e.class_id].collateral and e.kind != EventKind.HINT
    }
    unbound = sorted(
        (
            e
            for e in events
            if e.rank is None and e.kind in (EventKind.EXCEPTION, EventKind.CUT) and not kb[e.class_id].collateral
        ),
        key=lambda e: e.seq,
    )
    for lf in sorted((x for x in launcher if x.root_cause and x.rank is not None), key=lambda x: x.time or 0.0):
        if lf.exitcode is not None and lf.exitcode > 0 and lf.rank not in attributed:
            same_src = [e for e in unbound if e.source == lf.evidence.source] or unbound
            if same_src:
                e = same_src[0]
                e.rank, e.rank_via = lf.rank, RankSource.LAUNCHER_ROOT_CAUSE
                e.host = e.host or lf.host
                unbound.remove(e)
                if lf.rank is not None:
                    attributed.add(lf.rank)
    failed = {
        lf.rank for lf in launcher if lf.rank is not None and lf.exitcode not in (None, 0) and lf.exitcode != -15
    } | attributed
    loose = [
        e
        for e in events
        if e.rank is None and e.kind != EventKind.HINT and e.kind != EventKind.EXIT and not kb[e.class_id].collateral
    ]
    if len(failed) == 1 and loose:
        (rank,) = failed
        for e in loose:
            e.rank, e.rank_via = rank, RankSource.ONLY_FAILING_RANK


def exit_event(lf: LauncherFailure, kb: KnowledgeBase) -> Event | None:
    """A process exit as an event: signals map to classes (KB data), plain codes are weak."""
    rules = kb.rules
    if lf.exitcode == 0 or (lf.exitcode is None and lf.class_id is None) or (lf.rank is None and lf.rank_reliable):
        return None
    code = lf.exitcode
    if code is None:  # the report is cut before the code; the launcher's words decided the class
        cls, w = lf.class_id or rules.nonzero_exit[0], lf.weight or 0.5
        what = "exit code cut from the launcher's report"
    else:
        sig = -code if code < 0 else (code - 128 if 128 < code < 160 else None)
        if lf.class_id is not None:
            cls, w = lf.class_id, lf.weight or 0.5
        elif sig is not None:
            s = rules.signals.get(sig)
            cls, w = (s.class_id, s.weight) if s else rules.unknown_signal
        else:
            cls, w = rules.nonzero_exit
        name = rules.signals[sig].name if sig in rules.signals else f"signal {sig}"
        what = f"exit code {code}" + (f" ({name})" if sig else "")
    return Event(
        EXIT_SEQ + lf.evidence.line,
        EventKind.EXIT,
        cls,
        w,
        [Match(cls, w)],
        [lf.evidence],
        lf.rank,
        RankSource.LAUNCHER if lf.rank is not None else RankSource.NONE,
        pid=lf.pid,
        host=lf.host,
        ts=lf.time,
        ts_own=False,
        exc_type=what,
        message=lf.signal_note,
    )


def collateral_rank(att: Attribution, kb: KnowledgeBase, cls: str) -> tuple[int | None, RankSource, str]:
    """Only consequences: the rank the others waited for, when one stands out, and why."""
    rules = kb.rules
    reporters: set[int] = set()
    for r, v in att.views.items():
        if r is not None and any(e.class_id == cls for e in v.collateral):
            reporters.add(r)
    reported = sorted({r for r, _ in att.reported})
    if len(reported) == 1:
        return reported[0], RankSource.REPORT, "the log's own report names it"
    known = set(att.known)
    if len(reporters) >= 2:
        known |= set(range(max(known) + 1))  # ranks are numbered from 0: the gaps are ranks too
    suspects = sorted(known - reporters)
    if len(suspects) == 1 and len(reporters) >= 2:
        return (
            suspects[0],
            RankSource.INFERRED,
            (f"every other rank reported {cls}, rank {suspects[0]} did not; it is the one they were waiting for"),
        )
    if len(suspects) == 1 and len(reporters) == 1 and att.world == len(known):
        # the whole world is known and the one other rank never reported: the one that was waited for
        return (
            suspects[0],
            RankSource.INFERRED,
            (
                f"rank {min(reporters)} reported {cls} and the only other rank of the job did not; "
                f"rank {suspects[0]} is the one it was waiting for"
            ),
        )
    if len(reporters) == 1 and att.shown <= reporters:
        (r,) = reporters
        return (
            r,
            RankSource.ONLY_RANK,
            (
                f"the only rank that the log shows, and the first whose {cls} fired; "
                "the rank it waited for is not in the log"
            ),
        )
    if len(reporters) == 1 and cls in rules.single_reporter and att.sigterm_lines:
        (r,) = reporters
        return (
            r,
            RankSource.INFERRED,
            (f"the only rank that reported {cls}; the launcher then stopped the others, so it died first"),
        )
    why = "not shown in the log: only consequences are visible"
    if suspects and len(reporters) >= 2:
        why += f"; ranks that did not report them: {', '.join(map(str, suspects[:16]))}"
    return None, RankSource.NONE, why
