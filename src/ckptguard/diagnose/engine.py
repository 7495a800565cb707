"""`diagnose`: read a crashed run's logs and name the failure, the rank that failed first and the
ranks brought down with it.

The pipeline: ingest (prefilter, prefixes) -> events (extract) -> attribution (causes versus
consequences, first rank) -> scoring (class, cross-rank rules, confidence) -> advice (fix,
hypotheses, notes). Every string that leaves passes the masker.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable
from typing import BinaryIO

from ckptguard.diagnose import advice, scoring
from ckptguard.diagnose.arrival import Arrival
from ckptguard.diagnose.attribution import Attribution, choose, collateral_rank, collect
from ckptguard.diagnose.events import EMBEDDABLE_ANCHORS, STRUCTURAL_ANCHORS, Extractor
from ckptguard.diagnose.hits import open_hits
from ckptguard.diagnose.ingest import MAX_LINE, Prefilter, UsageError, discover, scan, sniff_binary
from ckptguard.diagnose.kb import FailureClass, KnowledgeBase, Unproven, load_kb
from ckptguard.diagnose.mask import Masker
from ckptguard.diagnose.model import (
    SCHEMA_VERSION,
    Diagnosis,
    Event,
    EvidenceLine,
    Hypothesis,
    OrderingBasis,
    RankSource,
    TimelineEvent,
    ranges,
)
from ckptguard.diagnose.normalize import read_normalized
from ckptguard.diagnose.shapes import Shapes

__all__ = ["SCHEMA_VERSION", "Diagnosis", "EvidenceLine", "Hypothesis", "TimelineEvent", "attribute", "diagnose"]
_ranges = ranges  # the name report.py and older callers import


def diagnose(
    paths: Iterable[str], *, mask_hosts: bool = False, kb: KnowledgeBase | None = None, stdin: BinaryIO | None = None
) -> Diagnosis:
    """Diagnose a crashed run from its logs (files, directories of per-rank logs, ``-``)."""
    kb = kb or load_kb()
    masker = Masker(mask_hosts=mask_hosts)
    sources = discover(paths)
    binary = [src.name for src in sources if (src.path is not None or stdin is None) and sniff_binary(src)]
    if binary and len(binary) == len(sources):
        raise UsageError(
            f"{binary[0]} is a binary file (an executable, archive, checkpoint or image), not a "
            "text log"
            + (f" (and {len(binary) - 1} more)" if len(binary) > 1 else "")
            + ": pass the job's console output or per-rank log files"
        )
    sources = [src for src in sources if src.name not in binary]
    prefilter = Prefilter(STRUCTURAL_ANCHORS, kb.anchors(), embeddable=EMBEDDABLE_ANCHORS)
    ex = Extractor(kb, masker)
    shapes = Shapes(prefilter.anchors, MAX_LINE)
    t0 = time.perf_counter()
    nbytes = nlines = 0
    unreadable: list[str] = []
    for src in sources:
        ex.begin_source(src)
        try:
            stream = stdin if (src.path is None and stdin is not None) else src.open()
            arrival = Arrival.for_log(src.path) if src.path is not None else None
            ex.arrival = arrival
            # a capture of `ckptguard run` was printed, not pasted: its line numbers must stay
            # those its arrival times were recorded for
            text, pasted = (stream, False) if arrival is not None else read_normalized(stream)
            hits = open_hits(src, prefilter, transformed=pasted or src.path is None)
            try:
                b, n = scan(text, prefilter, ex.feed, hits, shapes)
            finally:
                if hits is not None:
                    hits.close()
                if stream is not stdin and src.path is not None:
                    stream.close()
        except (OSError, EOFError, zlib.error) as exc:  # unreadable, or a damaged .gz
            unreadable.append(f"{src.name}: {exc}")
            b = n = 0
        ex.end_source()
        nbytes += b
        nlines += n
    if unreadable and len(unreadable) == len(sources):
        raise UsageError("cannot read " + "; ".join(unreadable))
    diag = attribute(ex, kb)
    diag.notes += [f"Could not read all of {u}" for u in unreadable]
    diag.notes += [f"Skipped {b}: a binary file, not a text log" for b in binary]
    elapsed = time.perf_counter() - t0
    diag.sources = [s.name for s in sources]
    diag.stats = {
        "bytes": nbytes,
        "lines": nlines,
        "lines_examined": ex.lines_processed,
        "events": len(ex.events),
        "seconds": round(elapsed, 3),
        "mb_per_s": round(nbytes / 1e6 / elapsed, 1) if elapsed > 0 else 0.0,
    }
    _finalize(diag, masker)
    return diag


def attribute(ex: Extractor, kb: KnowledgeBase) -> Diagnosis:
    """Decide class, initiating rank and collateral ranks from what the extractor kept."""
    names = [s.name for s in ex.sources]
    att = collect(ex, kb)
    diag = Diagnosis(found=bool(att.events or att.hints), world_size=att.world)
    if not diag.found:
        diag.notes.append("No failure signature, traceback or abnormal exit was found in the input.")
        return diag
    if not att.events and not any(h.exc_type for h in att.hints):
        # an exception that a warning names was raised, even if handled: with nothing else in the
        # log it is the answer, at a hint's confidence
        return _warnings_only(diag, att, kb, names)
    choose(att, kb)
    if att.init is None and att.hints and not any(v.collateral for v in att.views.values()):
        att.init = max(att.hints, key=lambda h: (h.weight, -h.seq))
        att.init_rank = att.init.rank
        att.basis = OrderingBasis.UNATTRIBUTED
    diag = _collateral_only(diag, att, ex, kb, names) if att.init is None else _answer(diag, att, ex, kb, names)
    _as_families(diag, kb)
    return diag


def _warnings_only(diag: Diagnosis, att: Attribution, kb: KnowledgeBase, names: list[str]) -> Diagnosis:
    """Warnings and retried errors are not failures on their own: a log with nothing else (a
    finished run with loud warnings, an NCCL transport it worked around) has no failure. What
    they name is listed, for a log that was cut before the failure they may have led to."""
    diag.found = False
    best: dict[str, Event] = {}
    for h in att.hints:
        fam = kb.family(h.class_id)
        if fam not in best or h.weight > best[fam].weight:
            best[fam] = h
    diag.alternatives = [
        Hypothesis(
            fam,
            kb[h.class_id].title,
            round(h.weight * kb.rules.confidence["hint_factor"], 2),
            [h.rank] if h.rank is not None else [],
            [advice.evline(ev, names, "context", h.rank) for ev in h.evidence[:2]],
            "only a warning or a retried error names it; nothing in the log failed",
            kind=h.class_id,
        )
        for fam, h in sorted(best.items(), key=lambda kv: -kv[1].weight)
    ]
    diag.notes.append(
        "The log holds only warnings or retried errors ("
        + ", ".join(sorted(best))
        + "), which the run went on after; if the log "
        "was cut before the job failed, they name what to check first."
    )
    return diag


def _as_families(diag: Diagnosis, kb: KnowledgeBase) -> None:
    """Answer in the users' taxonomy: each class is reported as its family (``family`` in its KB
    file), the finer class kept as ``kind`` with its own title, root cause and fix. A competing
    hypothesis that is the answer's family itself is the same answer, less specific: dropped;
    one per (family, kind) is kept."""
    if diag.failure_class is None:
        return
    diag.kind = diag.failure_class
    diag.failure_class = kb.family(diag.kind)
    best: dict[tuple[str, str], Hypothesis] = {}
    for a in diag.alternatives:
        fam = kb.family(a.failure_class) if a.failure_class in kb else a.failure_class
        if a.failure_class in (diag.failure_class, diag.kind):
            continue
        a.kind, a.failure_class = a.failure_class, fam
        key = (fam, a.kind)
        if key not in best or best[key].score < a.score:
            best[key] = a
    diag.alternatives = sorted(best.values(), key=lambda h: -h.score)
    for t in diag.timeline:
        t.kind, t.failure_class = t.failure_class, kb.family(t.failure_class)


def _answer(diag: Diagnosis, att: Attribution, ex: Extractor, kb: KnowledgeBase, names: list[str]) -> Diagnosis:
    init = att.init
    assert init is not None
    v = scoring.verdict(att, ex, kb)
    fc = kb[v.class_id]
    diag.failure_class, diag.title, diag.category = v.class_id, fc.title, fc.category
    diag.initiating_rank = att.init_rank
    diag.ordering_basis = att.basis.value
    diag.rank_attribution = _why_rank(att, init) if att.init_rank is not None else _no_rank(ex, init.host)
    diag.also_failed_ranks = sorted(att.also)
    primary = set(att.firsts)
    coll = {r for r, view in att.views.items() if r is not None and r not in primary and view.events}
    coll |= {r for r in att.sigterm_ranks if r not in primary}
    diag.collateral_ranks = sorted(coll - {att.init_rank})
    diag.initiating_host = _one_name(
        ex,
        init.host
        or (ex.rank_host.get(att.init_rank) if att.init_rank is not None else None)
        or _host_of(ex, att.init_rank),
    )
    diag.confidence = scoring.confidence(att, v, kb)
    unproven = _unproven(fc, att)

    for ev in init.evidence:
        diag.evidence.append(advice.evline(ev, names, "initiating", init.rank if ev.rank is None else ev.rank))
    for ev in v.context[:4]:
        diag.evidence.append(advice.evline(ev, names, "context", ev.rank))
    for lf in sorted(att.launcher, key=lambda x: not x.root_cause):
        if lf.rank == att.init_rank and (lf.rank is not None or init.kind.value == "exit"):
            if all(e.line != lf.evidence.line or e.file != names[lf.evidence.source] for e in diag.evidence):
                diag.evidence.append(advice.evline(lf.evidence, names, "launcher", lf.rank))
            break
    seen_cls: set[str] = set()
    for r in diag.collateral_ranks:
        for e in att.views[r].collateral if r in att.views else []:
            if e.class_id not in seen_cls:
                seen_cls.add(e.class_id)
                diag.evidence.append(advice.evline(e.evidence[0], names, "collateral", r))
    advice.advise(diag, fc, init, ex.announced_path)
    if unproven is not None:
        advice.unproven(diag, fc, unproven, init)
    advice.alternatives(diag, att, kb, ex, names, v.class_id)
    advice.notes(diag, att)
    diag.timeline = advice.timeline(att.events, kb, names)
    return diag


def _collateral_only(
    diag: Diagnosis, att: Attribution, ex: Extractor, kb: KnowledgeBase, names: list[str]
) -> Diagnosis:
    """Every failure is a consequence: name the class that explains them, and the rank that the
    others waited for when one stands out."""
    rules = kb.rules
    c = rules.confidence
    reporters: dict[str, set[int | None]] = {}
    for r, view in att.views.items():
        for e in view.collateral:
            reporters.setdefault(e.class_id, set()).add(r)
    seen = next((x for x in rules.collateral_priority if x in reporters), None) or (
        max(reporters, key=lambda x: len(reporters[x])) if reporters else "launcher_sigterm"
    )
    desync = scoring.desync(ex, kb)
    alone = rules.alone_means.get(seen, seen)
    # a consequence whose family is the class it alone means keeps its own kind: the answer's
    # class is the family all the same, and the kind says what the log shows (a peer's loss)
    cls = rules.desync_class if desync else seen if kb.family(seen) == alone else alone
    fc = kb[cls]
    diag.failure_class, diag.title, diag.category = cls, fc.title, fc.category
    rank, via, why = collateral_rank(att, kb, seen)
    odd = scoring.desync_odd_rank(ex) if desync else None
    if odd is not None:
        rank, via, why = odd[0], RankSource.INFERRED, odd[1]
    elif rank is None:
        earliest = _first_by_time(att, seen)
        if earliest is not None:
            rank, via, why = (
                earliest,
                RankSource.INFERRED,
                (f"the first rank to report {seen} by the lines' own timestamps (the others reported it later)"),
            )
    diag.initiating_rank = rank
    diag.rank_attribution = f"{via.text}: {why}" if rank is not None else why
    if desync:
        diag.confidence = round(min(rules.desync_weight * rules.rank_factor.get("none", 0.9), c["upgrade_cap"]), 2)
    elif via == RankSource.INFERRED and "only rank" in why:
        diag.confidence = c["single_reporter"]
    elif via == RankSource.INFERRED and why.startswith("every other rank") and len(reporters.get(seen, ())) >= 3:
        diag.confidence = c.get("absent_rank", c["collateral_inferred"])
    elif rank is not None:
        diag.confidence = c["collateral_inferred"]
    else:
        diag.confidence = c["collateral_unknown"]
    diag.ordering_basis = OrderingBasis.NO_PRIMARY.value
    diag.collateral_ranks = sorted(r for r in att.views if r is not None and r != rank)
    diag.initiating_host = _one_name(ex, _host_of(ex, rank) or (ex.rank_host.get(rank) if rank is not None else None))
    for ev in desync:
        diag.evidence.append(advice.evline(ev, names, "initiating", ev.rank))
    for _, ev in att.reported[:2]:
        diag.evidence.append(advice.evline(ev, names, "context", ev.rank))
    for r in sorted(att.views, key=lambda x: (x is None, x or 0))[:6]:
        for e in att.views[r].collateral[:1]:
            diag.evidence.append(advice.evline(e.evidence[0], names, "collateral", r))
    first = next((e for view in att.views.values() for e in view.collateral if e.class_id == seen), None)
    advice.advise(diag, fc, first, ex.announced_path)
    if cls != seen:
        diag.alternatives.append(
            Hypothesis(
                seen,
                kb[seen].title,
                round(diag.confidence * 0.8, 2),
                [],
                [advice.evline(first.evidence[0], names, "collateral", first.rank)] if first else [],
                "what the log shows; it is a consequence, so the answer names what most often causes it",
            )
        )
    diag.notes.append(
        "Only collateral failures are in the log; the first failure itself was not logged "
        "(a hang, or a process killed without output)."
    )
    diag.timeline = advice.timeline([e for view in att.views.values() for e in view.events], kb, names)
    return diag


def _unproven(fc: FailureClass, att: Attribution) -> Unproven | None:
    """The class's [unproven] report when no line of the log proves it (only implies it)."""
    u = fc.unproven
    if u is None:
        return None
    every = [*att.events, *att.hints]
    proved = any(m.class_id == fc.id and m.weight >= u.proof_weight for e in every for m in e.matches)
    return None if proved else u


def _why_rank(att: Attribution, init: Event) -> str:
    """Which hints decided the first rank: whose line it is, and why it came before the others."""
    parts = [init.rank_via.text]
    if att.also and att.basis not in (OrderingBasis.ONLY_ONE, OrderingBasis.UNATTRIBUTED):
        parts.append(f"first of the failing ranks by {att.basis.value}")
    blamed = [ev for r, ev in att.reported if r == att.init_rank]
    if blamed:
        parts.append(f"another rank's own error names it as the first to fail (line {blamed[0].line})")
    return "; ".join(parts)


def _first_by_time(att: Attribution, cls: str) -> int | None:
    """The rank whose report of ``cls`` is dated strictly before every other rank's, where every
    reporting rank's line carries its own timestamp."""
    firsts: dict[int, float] = {}
    for r, view in att.views.items():
        times = [e.ts for e in view.collateral if e.class_id == cls and e.ts_own and e.ts is not None]
        if r is not None and times:
            firsts[r] = min(times)
        elif r is not None and any(e.class_id == cls for e in view.collateral):
            return None  # a reporter without a date: the order is not known
    if len(firsts) < 2:
        return None
    order = sorted(firsts.items(), key=lambda kv: kv[1])
    return order[0][0] if order[0][1] < order[1][1] else None


def _no_rank(ex: Extractor, host: str | None) -> str:
    """Why the first rank is not named, and what the log does narrow it to."""
    ranks = ex.host_ranks.get(host or "", [])
    if ranks:
        return (
            f"not shown in the log: the launcher names the node ({host}), not the process; the first "
            f"failure is one of that node's ranks {ranges(ranks)}"
        )
    return "not shown in the log: the failing line carries no rank prefix, and no launcher summary or pid map names it"


def _one_name(ex: Extractor, host: str | None) -> str | None:
    """One name for a host in one report: NCCL's lines name it by its short name, torchrun's
    summary often by its full one (``node3`` and ``node3.cluster.local``); the full one wins."""
    if not host:
        return host
    known = {*ex.rank_host.values(), *ex.pid_host.values(), *(lf.host for lf in ex.launcher if lf.host)}
    longer = [h for h in known if h.startswith(host + ".")]
    return max(longer, key=lambda h: (len(h), h)) if longer else host


def _host_of(ex: Extractor, rank: int | None) -> str | None:
    if rank is None:
        return None
    for pid, (r, _) in ex.pid_rank.items():
        if r == rank and pid in ex.pid_host:
            return ex.pid_host[pid]
    return None


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
