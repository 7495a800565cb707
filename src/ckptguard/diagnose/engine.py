"""Classification and attribution: which failure, which rank first, which ranks are collateral.

The initiating rank is the rank whose first *primary* (non-collateral) failure came first: by
the failure lines' own timestamps when every candidate has one, else by position in one merged
log, else by the launcher's "first observed failure". Ranks whose only failures are consequences
(launcher SIGTERM, connection closed by peer, collective timeouts) are collateral. When the log
does not show the rank, the diagnosis says so instead of guessing.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import BinaryIO

from ckptguard.diagnose.events import (
    SIGNALS,
    STRUCTURAL_ANCHORS,
    Event,
    Evidence,
    Extractor,
    LauncherFailure,
)
from ckptguard.diagnose.ingest import Prefilter, discover, scan
from ckptguard.diagnose.kb import KnowledgeBase, Match, load_kb
from ckptguard.diagnose.mask import Masker

SCHEMA_VERSION = 1
CHECKPOINTER_SNIPPET = (
    "from ckptguard import Checkpointer\n"
    'ck = Checkpointer("/shared/ckpts", keep_last=3)   # then ck.save(step, {"model": model, "optim": optim})'
)
_SIGNAL_CLASS = {9: ("host_oom_sigkill", 0.6), 11: ("segfault", 0.85), 7: ("dataloader_worker_killed", 0.5),
                 6: ("native_abort", 0.5), 15: ("launcher_sigterm", 0.9), 2: ("launcher_sigterm", 0.6),
                 1: ("launcher_sigterm", 0.6)}
_QUOTED_PATH = re.compile(r"""['"](/?[^'"\s]+/[^'"\s]*)['"]|(/[\w.\-]+(?:/[\w.\-]+)+)""")


@dataclass
class EvidenceLine:
    """An evidence line as reported: where it is and what it says."""

    file: str
    line: int
    text: str
    rank: int | None
    role: str  # "initiating" | "collateral" | "launcher" | "context"

    def as_dict(self) -> dict[str, object]:
        return {"file": self.file, "line": self.line, "rank": self.rank, "role": self.role,
                "text": self.text}


@dataclass
class Hypothesis:
    """A competing explanation, with the evidence for it and why it ranks lower."""

    failure_class: str
    title: str
    score: float
    ranks: list[int]
    evidence: list[EvidenceLine]
    why_not: str

    def as_dict(self) -> dict[str, object]:
        return {"failure_class": self.failure_class, "title": self.title, "score": self.score,
                "ranks": self.ranks, "evidence": [e.as_dict() for e in self.evidence],
                "why_not": self.why_not}


@dataclass
class TimelineEvent:
    """One failure event placed on the per-rank timeline of the HTML report."""

    rank: int | None
    t: float | None
    order: int
    failure_class: str
    collateral: bool
    file: str
    line: int
    text: str


@dataclass
class Diagnosis:
    """The result of `diagnose`: everything the text, JSON and HTML reports show."""

    found: bool
    failure_class: str | None = None
    title: str = ""
    category: str = ""
    confidence: float = 0.0
    initiating_rank: int | None = None
    initiating_host: str | None = None
    rank_attribution: str = ""
    ordering_basis: str = ""
    collateral_ranks: list[int] = field(default_factory=list)
    also_failed_ranks: list[int] = field(default_factory=list)
    world_size: int | None = None
    evidence: list[EvidenceLine] = field(default_factory=list)
    root_cause: str = ""
    mechanism: str = ""
    fix: str = ""
    prevention: list[str] = field(default_factory=list)
    confirm: list[str] = field(default_factory=list)
    verify_command: str = ""
    checkpointer_switch: str | None = None
    alternatives: list[Hypothesis] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timeline: list[TimelineEvent] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def confidence_label(self) -> str:
        return "high" if self.confidence >= 0.8 else "medium" if self.confidence >= 0.5 else "low"

    def to_dict(self) -> dict[str, object]:
        """The stable JSON object (schema_version 1)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "found": self.found,
            "failure_class": self.failure_class,
            "title": self.title,
            "category": self.category,
            "confidence": self.confidence,
            "confidence_label": self.confidence_label,
            "initiating_rank": self.initiating_rank,
            "initiating_host": self.initiating_host,
            "rank_attribution": self.rank_attribution,
            "ordering_basis": self.ordering_basis,
            "collateral_ranks": self.collateral_ranks,
            "also_failed_ranks": self.also_failed_ranks,
            "world_size": self.world_size,
            "evidence": [e.as_dict() for e in self.evidence],
            "root_cause": self.root_cause,
            "mechanism": self.mechanism,
            "fix": self.fix,
            "checkpointer_switch": self.checkpointer_switch,
            "prevention": self.prevention,
            "confirm": self.confirm,
            "verify_command": self.verify_command,
            "alternatives": [a.as_dict() for a in self.alternatives],
            "notes": self.notes,
            "timeline": [
                {"rank": t.rank, "t": t.t, "order": t.order, "failure_class": t.failure_class,
                 "collateral": t.collateral, "file": t.file, "line": t.line, "text": t.text}
                for t in self.timeline
            ],
            "sources": self.sources,
            "stats": self.stats,
        }


def diagnose(paths: Iterable[str], *, mask_hosts: bool = False, kb: KnowledgeBase | None = None,
             stdin: BinaryIO | None = None) -> Diagnosis:
    """Diagnose a crashed run from its logs (files, directories of per-rank logs, ``-``)."""
    kb = kb or load_kb()
    masker = Masker(mask_hosts=mask_hosts)
    sources = discover(paths)
    prefilter = Prefilter([*STRUCTURAL_ANCHORS, *kb.anchors()])
    ex = Extractor(kb, masker)
    t0 = time.perf_counter()
    nbytes = nlines = 0
    for src in sources:
        ex.begin_source(src)
        stream = stdin if (src.path is None and stdin is not None) else src.open()
        try:
            b, n = scan(stream, prefilter, ex.feed)
        finally:
            if stream is not stdin and src.path is not None:
                stream.close()
        ex.end_source()
        nbytes += b
        nlines += n
    diag = attribute(ex, kb)
    elapsed = time.perf_counter() - t0
    diag.sources = [s.name for s in sources]
    diag.stats = {"bytes": nbytes, "lines": nlines, "lines_examined": ex.lines_processed,
                  "events": len(ex.events), "seconds": round(elapsed, 3),
                  "mb_per_s": round(nbytes / 1e6 / elapsed, 1) if elapsed > 0 else 0.0}
    _finalize(diag, masker)
    return diag


# ---- attribution ------------------------------------------------------------------------------

@dataclass
class _RankView:
    events: list[Event] = field(default_factory=list)
    primary: list[Event] = field(default_factory=list)
    collateral: list[Event] = field(default_factory=list)


def attribute(ex: Extractor, kb: KnowledgeBase) -> Diagnosis:
    """Decide class, initiating rank and collateral ranks from what the extractor kept."""
    names = [s.name for s in ex.sources]
    events = list(ex.events)
    for e in events:
        if e.rank is None and e.pid is not None and e.pid in ex.pid_rank:
            e.rank, e.rank_via = ex.pid_rank[e.pid][0], "pid"
    launcher = _resolve_launcher(ex)
    sigterm_ranks: dict[int, Evidence] = {}
    for pid, ev in ex.sigterm:
        if pid in ex.pid_rank:
            sigterm_ranks.setdefault(ex.pid_rank[pid][0], ev)
    root_causes = [lf for lf in launcher if lf.root_cause and lf.rank is not None]

    # Unattributed tracebacks: the launcher's first observed failure names the rank.
    attributed_primary = {e.rank for e in events if e.rank is not None and not _collateral(kb, e)}
    unbound = sorted((e for e in events if e.rank is None and e.kind == "exception"
                      and not _collateral(kb, e)), key=lambda e: e.seq)
    for lf in sorted(root_causes, key=lambda x: (x.time or 0.0)):
        if lf.exitcode is not None and lf.exitcode > 0 and lf.rank not in attributed_primary:
            same_src = [e for e in unbound if e.source == lf.evidence.source] or unbound
            if same_src:
                e = same_src[0]
                e.rank, e.rank_via = lf.rank, "launcher-root-cause"
                e.host = e.host or lf.host
                unbound.remove(e)
                attributed_primary.add(lf.rank)

    for lf in launcher:
        e = _exit_event(lf, kb)
        if e is not None:
            events.append(e)
    for rank, ev in sigterm_ranks.items():
        events.append(Event(10**9 + ev.line, "exit", "launcher_sigterm", 0.9,
                            [Match("launcher_sigterm", 0.9)], [ev], rank, "pid"))

    views: dict[int | None, _RankView] = {}
    for e in events:
        views.setdefault(e.rank, _RankView()).events.append(e)
    for view in views.values():
        strong, weak = [], []
        for e in view.events:
            if _collateral(kb, e):
                view.collateral.append(e)
            elif kb[e.class_id].weak or (e.kind == "exit" and e.class_id == "python_exception"):
                weak.append(e)
            else:
                strong.append(e)
        view.primary = strong or ([] if view.collateral else weak)

    world = ex.world_size or None
    known = set(ex.ranks_seen) | {r for r in views if r is not None}
    if world:
        known |= set(range(world))
    diag = Diagnosis(found=bool(events), world_size=world or (max(known) + 1 if known else None))
    if not events:
        diag.notes.append("No failure signature, traceback or abnormal exit was found in the input.")
        return diag

    firsts = {r: min(v.primary, key=_when) for r, v in views.items() if v.primary and r is not None}
    unattributed = views.get(None)
    first_unattr = min(unattributed.primary, key=lambda e: e.seq) if unattributed and unattributed.primary else None

    if firsts:
        order, basis = _order(firsts, root_causes)
        init_rank = order[0]
        # The rank's most specific primary event names the failure (a generic wrapper
        # exception is often followed by the specific one on the same rank).
        init = max(views[init_rank].primary, key=lambda e: (e.weight, -e.seq))
        diag.initiating_rank = init_rank
        diag.ordering_basis = basis
        diag.rank_attribution = _via_text(init)
        also = order[1:]
    elif first_unattr is not None:
        init, init_rank, also = first_unattr, None, []
        diag.rank_attribution = "not shown in the log: the failing line carries no rank prefix, and no launcher summary or pid map names it"
        diag.ordering_basis = "order in the log"
    else:
        return _collateral_only(diag, views, known, kb, names, ex)

    cls = init.class_id
    weight = init.weight
    upgraded = _same_path_race(ex, init, cls)
    if upgraded:
        cls, weight = "checkpoint_write_race", max(weight, 0.85)
    fc = kb[cls]
    diag.failure_class, diag.title, diag.category = cls, fc.title, fc.category
    diag.also_failed_ranks = sorted(also)
    primary_ranks = set(firsts)
    coll = {r for r, v in views.items() if r is not None and r not in primary_ranks and v.events}
    coll |= {r for r in sigterm_ranks if r not in primary_ranks}
    diag.collateral_ranks = sorted(coll - {init_rank})
    diag.initiating_host = (init.host or (ex.rank_host.get(init_rank) if init_rank is not None else None)
                            or _host_of(ex, init_rank))

    # confidence
    conf = weight
    if init_rank is None:
        conf *= 0.85
    elif init.rank_via in ("launcher-root-cause", "local-prefix"):
        conf *= 0.9
    elif init.rank_via in ("pid", "launcher"):
        conf *= 0.95
    other_classes = {firsts[r].class_id for r in also} - {init.class_id}
    if other_classes:
        conf *= {"timestamps": 0.95, "order in the log": 0.9}.get(basis_key(diag.ordering_basis), 0.8)
    if kb[init.class_id].weak or init.kind == "exit":
        conf = min(conf, 0.6)
    if upgraded:
        conf = min(conf, 0.85)
    diag.confidence = round(conf, 2)

    # evidence
    role = "initiating"
    for ev in init.evidence:
        diag.evidence.append(_evline(ev, names, role, init.rank if ev.rank is None else ev.rank))
    if upgraded:
        for ev in upgraded[:4]:
            diag.evidence.append(_evline(ev, names, "context", ev.rank))
    for lf in root_causes:
        if lf.rank == init_rank:
            diag.evidence.append(_evline(lf.evidence, names, "launcher", lf.rank))
            break
    seen_cls: set[str] = set()
    for r in diag.collateral_ranks:
        for e in views[r].collateral if r in views else []:
            if e.class_id not in seen_cls:
                seen_cls.add(e.class_id)
                diag.evidence.append(_evline(e.evidence[0], names, "collateral", r))

    _advice(diag, fc, init, kb)
    _alternatives(diag, init, firsts, also, kb, names, ex, cls)
    _notes(diag, init, firsts, also, views, known)
    diag.timeline = _timeline(events, kb, names)
    return diag


def basis_key(basis: str) -> str:
    return basis.split(":")[0]


def _collateral(kb: KnowledgeBase, e: Event) -> bool:
    return kb[e.class_id].collateral


def _when(e: Event) -> tuple[float, int]:
    return (e.ts if e.ts_own and e.ts is not None else float("inf"), e.seq)


def _order(firsts: dict[int, Event], root_causes: list[LauncherFailure]) -> tuple[list[int], str]:
    """Order candidate ranks by when they failed, saying what the order rests on."""
    evs = list(firsts.items())
    if len(evs) == 1:
        return [evs[0][0]], "only one rank failed on its own"
    if all(e.ts_own and e.ts is not None for _, e in evs):
        evs.sort(key=lambda kv: (kv[1].ts, kv[1].seq))
        return [r for r, _ in evs], "timestamps of the failure lines"
    if len({e.source for _, e in evs}) == 1:
        evs.sort(key=lambda kv: kv[1].seq)
        return [r for r, _ in evs], "order in the log (the failure lines carry no timestamps)"
    rc = sorted((lf for lf in root_causes if lf.rank in firsts), key=lambda x: x.time or 0.0)
    if rc:
        first = rc[0].rank
        assert first is not None
        rest = sorted((r for r in firsts if r != first), key=lambda r: firsts[r].seq)
        return [first, *rest], "the launcher's first observed failure (torchrun Root Cause)"
    evs.sort(key=lambda kv: kv[1].seq)
    return [r for r, _ in evs], "order of the input files (weak: no timestamps)"


def _via_text(e: Event) -> str:
    return {
        "prefix": "from the rank prefix of the failing line",
        "file": "from the name of the per-rank log file",
        "pid": "from the pid of the failing process, mapped to its rank by NCCL/launcher lines",
        "launcher": "from the launcher's failure summary",
        "launcher-root-cause": "the traceback has no rank prefix; torchrun's Root Cause block names this rank as the first failure with a non-signal exit code",
        "local-prefix": "from a local-rank prefix ([defaultN]:), taken as the global rank",
    }.get(e.rank_via, e.rank_via or "unknown")


def _resolve_launcher(ex: Extractor) -> list[LauncherFailure]:
    out = []
    single_node = len({lf.host for lf in ex.launcher if lf.host}) <= 1
    for lf in ex.launcher:
        if lf.rank is None and lf.pid is not None and lf.pid in ex.pid_rank:
            lf.rank = ex.pid_rank[lf.pid][0]
        if lf.rank is None and lf.local_rank is not None and single_node and not ex.world_size:
            lf.rank = lf.local_rank
        out.append(lf)
    # the same failure is often reported twice (the 'failed' line and the summary block)
    seen: set[tuple[int | None, int | None]] = set()
    uniq = []
    for lf in sorted(out, key=lambda x: (not x.root_cause, x.evidence.line)):
        k = (lf.rank, lf.exitcode)
        if lf.rank is not None and k in seen:
            continue
        seen.add(k)
        uniq.append(lf)
    return uniq


def _exit_event(lf: LauncherFailure, kb: KnowledgeBase) -> Event | None:
    """A process exit as an event: signals map to classes, plain non-zero codes are weak."""
    if lf.rank is None or lf.exitcode is None or lf.exitcode == 0:
        return None
    code = lf.exitcode
    sig = -code if code < 0 else (code - 128 if 128 < code < 160 else None)
    if sig is not None:
        cls, w = _SIGNAL_CLASS.get(sig, ("native_abort", 0.4))
    else:
        cls, w = "python_exception", 0.3
    return Event(10**9 + lf.evidence.line, "exit", cls, w, [Match(cls, w)], [lf.evidence],
                 lf.rank, "launcher", pid=lf.pid, host=lf.host, ts=lf.time, ts_own=False,
                 exc_type=f"exit code {code}" + (f" ({SIGNALS.get(sig, 'signal ' + str(sig))})" if sig else ""),
                 message=lf.signal_note)


def _same_path_race(ex: Extractor, init: Event, cls: str) -> list[Evidence]:
    """Several ranks announced a save to one path, and the failure concerns that path."""
    if cls not in ("checkpoint_corrupt_load", "python_exception", "disk_full_enospc",
                   "checkpoint_write_race"):
        return []
    text = " ".join([init.message or "", *(ev.text for ev in init.evidence)])
    for path, ranks in ex.saves.items():
        if len(ranks) >= 2 and (path in text or os.path.basename(path) in text):
            return list(ranks.values())
    return []


def _host_of(ex: Extractor, rank: int | None) -> str | None:
    if rank is None:
        return None
    for pid, (r, _) in ex.pid_rank.items():
        if r == rank and pid in ex.pid_host:
            return ex.pid_host[pid]
    return None


def _evline(ev: Evidence, names: list[str], role: str, rank: int | None) -> EvidenceLine:
    return EvidenceLine(names[ev.source], ev.line, ev.text, rank, role)


def _rank_text(rank: int | None) -> str:
    return f"Rank {rank}" if rank is not None else "A rank that the log does not identify"


def _advice(diag: Diagnosis, fc: object, init: Event, kb: KnowledgeBase) -> None:
    from ckptguard.diagnose.kb import FailureClass

    assert isinstance(fc, FailureClass)
    exc = f"{init.exc_type}: {init.message}" if init.exc_type and init.message else (
        init.exc_type or init.evidence[0].text)
    exc = exc if len(exc) <= 240 else exc[:239] + "…"
    values = {
        "rank_text": _rank_text(diag.initiating_rank),
        "host_text": diag.initiating_host or "the node",
        "exc": exc, "exc_type": init.exc_type or "exception", "message": init.message or exc,
    }
    diag.root_cause = _fmt(fc.root_cause, values)
    diag.mechanism = fc.mechanism.strip()
    diag.fix = " ".join(fc.fix.split())
    if fc.checkpointer_prevents:
        diag.checkpointer_switch = CHECKPOINTER_SNIPPET
        diag.fix += (" ckptguard's Checkpointer prevents this class: one discovered leader per "
                     "filesystem, fresh attempt directories and an atomic commit. Switch with two lines: "
                     + CHECKPOINTER_SNIPPET.replace("\n", " ; "))
    diag.prevention = list(fc.prevention)
    diag.confirm = list(fc.confirm)
    text = " ".join([init.message or "", *(e.text for e in init.evidence)])
    ckpt_dir = "<checkpoint dir>"
    pm = _QUOTED_PATH.search(text)
    if pm:
        p = pm.group(1) or pm.group(2)
        ckpt_dir = os.path.dirname(p.rstrip("/")) or p
    module = "<module>"
    mm = re.search(r"No module named '([\w.]+)'", text)
    if mm:
        module = mm.group(1)
    diag.verify_command = _fmt(fc.verify_command, {"ckpt_dir": ckpt_dir, "module": module})


def _fmt(template: str, values: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), template)


def _alternatives(diag: Diagnosis, init: Event, firsts: dict[int, Event], also: list[int],
                  kb: KnowledgeBase, names: list[str], ex: Extractor, cls: str) -> None:
    alts: dict[str, Hypothesis] = {}
    for m in init.matches[1:]:
        if m.class_id == cls or kb[m.class_id].collateral:
            continue
        alts[m.class_id] = Hypothesis(
            m.class_id, kb[m.class_id].title, round(m.weight * 0.9, 2),
            [init.rank] if init.rank is not None else [],
            [_evline(init.evidence[0], names, "initiating", init.rank)],
            "a plain exception in the code: the more specific signature above explains it better"
            if m.class_id == "python_exception" else
            "the same lines match this class, with a less specific signature")
    if cls != init.class_id:
        alts[init.class_id] = Hypothesis(
            init.class_id, kb[init.class_id].title, round(init.weight * 0.8, 2),
            [init.rank] if init.rank is not None else [],
            [_evline(init.evidence[0], names, "initiating", init.rank)],
            "the failing line alone reads as this, but several ranks wrote to the same path first")
    for r in also:
        e = firsts[r]
        if e.class_id in (cls, init.class_id):
            continue
        h = alts.get(e.class_id)
        if h is None:
            h = alts[e.class_id] = Hypothesis(
                e.class_id, kb[e.class_id].title, round(e.weight * 0.7, 2), [], [],
                f"these ranks failed later ({diag.ordering_basis}); a later failure is usually a consequence")
        h.ranks.append(r)
        if len(h.evidence) < 3:
            h.evidence.append(_evline(e.evidence[0], names, "context", r))
    if init.class_id == "host_oom_sigkill" and init.kind == "exit":
        alts.setdefault("sigkill_other_sender", Hypothesis(
            "launcher_sigterm", "SIGKILL from another sender (scheduler preemption, a watchdog, a user's kill -9)",
            0.3, [init.rank] if init.rank is not None else [],
            [_evline(init.evidence[0], names, "launcher", init.rank)],
            "no kernel or cgroup OOM message is in the log; check dmesg or the scheduler to tell them apart"))
    if cls != "checkpoint_write_race":
        for path, ranks in ex.saves.items():
            if len(ranks) >= 2:
                alts.setdefault("checkpoint_write_race", Hypothesis(
                    "checkpoint_write_race", kb["checkpoint_write_race"].title, 0.4, sorted(ranks),
                    [_evline(ev, names, "context", r) for r, ev in list(ranks.items())[:3]],
                    f"{len(ranks)} ranks announced a save to {path}, but the failure does not name that path"))
                break
    diag.alternatives = sorted(alts.values(), key=lambda h: -h.score)[:6]


def _notes(diag: Diagnosis, init: Event, firsts: dict[int, Event], also: list[int],
           views: dict[int | None, _RankView], known: set[int]) -> None:
    same = [r for r in also if firsts[r].class_id == init.class_id]
    if same:
        diag.notes.append(
            f"Ranks {_ranges(same)} failed the same way ({init.class_id}); the order between them rests on "
            f"{diag.ordering_basis}.")
    if init.kind == "exit":
        diag.notes.append("The log holds no message from the failing process itself, only its exit status.")
    unseen = sorted(known - {r for r, v in views.items() if r is not None and v.events}
                    - {diag.initiating_rank} - set(diag.collateral_ranks))
    if unseen and diag.world_size:
        diag.notes.append(f"No failure lines for ranks {_ranges(unseen)} (their logs may be elsewhere).")


def _collateral_only(diag: Diagnosis, views: dict[int | None, _RankView], known: set[int],
                     kb: KnowledgeBase, names: list[str], ex: Extractor) -> Diagnosis:
    """Every failure is a consequence: name the rank that the others waited for, if one stands out."""
    reporters: dict[str, set[int]] = {}
    for r, v in views.items():
        for e in v.collateral:
            if r is not None and e.class_id != "launcher_sigterm":
                reporters.setdefault(e.class_id, set()).add(r)
    cls = "nccl_watchdog_timeout" if "nccl_watchdog_timeout" in reporters else (
        max(reporters, key=lambda c: len(reporters[c])) if reporters else "launcher_sigterm")
    complaining = set().union(*reporters.values()) if reporters else set()
    suspects = sorted(known - complaining)
    fc = kb[cls]
    diag.failure_class, diag.title, diag.category = cls, fc.title, fc.category
    if len(suspects) == 1 and complaining:
        diag.initiating_rank = suspects[0]
        diag.rank_attribution = (f"inferred: every other rank reported {cls}, rank {suspects[0]} did not; "
                                 "it is the one they were waiting for")
        diag.confidence = 0.45
    else:
        diag.rank_attribution = ("not shown in the log: only consequences are visible"
                                 + (f"; ranks that did not report them: {_ranges(suspects)}" if suspects else ""))
        diag.confidence = 0.25
    diag.ordering_basis = "no rank failed on its own"
    diag.collateral_ranks = sorted(r for r in views if r is not None and r != diag.initiating_rank)
    diag.initiating_host = _host_of(ex, diag.initiating_rank) or (
        ex.rank_host.get(diag.initiating_rank) if diag.initiating_rank is not None else None)
    for r in sorted(r for r in views if r is not None)[:6]:
        for e in views[r].collateral[:1]:
            diag.evidence.append(_evline(e.evidence[0], names, "collateral", r))
    first = next((e for v in views.values() for e in v.collateral if e.class_id == cls), None)
    if first is not None:
        _advice(diag, fc, first, kb)
    diag.root_cause = _fmt(fc.root_cause, {"rank_text": _rank_text(diag.initiating_rank),
                                           "host_text": diag.initiating_host or "the node"})
    diag.notes.append("Only collateral failures are in the log; the first failure itself was not logged "
                      "(a hang, or a process killed without output).")
    diag.timeline = _timeline([e for v in views.values() for e in v.events], kb, names)
    return diag


def _timeline(events: list[Event], kb: KnowledgeBase, names: list[str]) -> list[TimelineEvent]:
    out = []
    for e in sorted(events, key=lambda e: e.seq)[:2000]:
        out.append(TimelineEvent(e.rank, e.ts, e.seq, e.class_id, kb[e.class_id].collateral,
                                 names[e.source], e.line, e.evidence[0].text[:160]))
    return out


def _ranges(ranks: Iterable[int]) -> str:
    """[0,1,2,5] -> '0-2, 5'."""
    rs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(f"{rs[i]}-{rs[j]}" if j > i else str(rs[i]))
        i = j + 1
    return ", ".join(parts)


def _finalize(diag: Diagnosis, masker: Masker) -> None:
    """Mask every string that leaves the engine with the hosts known at the end of the scan."""
    f = masker.finalize
    for e in diag.evidence:
        e.text, e.file = f(e.text), f(e.file)
    for a in diag.alternatives:
        a.why_not = f(a.why_not)
        for e in a.evidence:
            e.text, e.file = f(e.text), f(e.file)
    for t in diag.timeline:
        t.text, t.file = f(t.text), f(t.file)
    diag.root_cause = f(diag.root_cause)
    diag.verify_command = f(diag.verify_command)
    diag.rank_attribution = f(diag.rank_attribution)
    diag.notes = [f(n) for n in diag.notes]
    diag.sources = [f(s) for s in diag.sources]
    if diag.initiating_host:
        diag.initiating_host = f(diag.initiating_host)
