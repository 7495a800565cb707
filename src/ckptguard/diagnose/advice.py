"""Advice: what the report says about the answer (root cause, fix, verification, competing
hypotheses, notes, timeline), from the knowledge base and the attribution."""

from __future__ import annotations

import os
import re

from ckptguard.diagnose.attribution import Attribution, tier
from ckptguard.diagnose.events import Extractor
from ckptguard.diagnose.exceptions import GENERIC_CLASSES
from ckptguard.diagnose.kb import FailureClass, KnowledgeBase, Unproven
from ckptguard.diagnose.model import (
    Diagnosis,
    Event,
    EventKind,
    Evidence,
    EvidenceLine,
    Hypothesis,
    TimelineEvent,
    ranges,
)

CHECKPOINTER_SNIPPET = (
    "from ckptguard import Checkpointer\n"
    'ck = Checkpointer("/shared/ckpts", keep_last=3)   # then ck.save(step, {"model": model, "optim": optim})'
)
_FILE_SUFFIX = re.compile(r"\.(?:pt|pth|bin|ckpt|safetensors|pkl|tar|npz|h5|json)$")
_QUOTED_PATH = re.compile(r"""['"](/?[^'"\s]+/[^'"\s]*)['"]|(/[\w.\-]+(?:/[\w.\-]+)+)""")


def evline(ev: Evidence, names: list[str], role: str, rank: int | None) -> EvidenceLine:
    """An extracted evidence line as the report shows it."""
    return EvidenceLine(names[ev.source], ev.line, ev.text, rank, role)


def rank_text(rank: int | None) -> str:
    return f"Rank {rank}" if rank is not None else "A rank that the log does not identify"


def fmt(template: str, values: dict[str, str]) -> str:
    """Fill ``{name}`` placeholders; unknown ones stay as they are."""
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), template)


def advise(diag: Diagnosis, fc: FailureClass, init: Event | None, announced: str | None = None) -> None:
    """Root cause, mechanism, fix, prevention, confirmation and the verification command."""
    if init is not None:
        exc = (
            f"{init.exc_type}: {init.message}"
            if init.exc_type and init.message
            else (init.exc_type or init.evidence[0].text)
        )
    else:
        exc = "only consequences of the failure are in the log"
    exc = exc if len(exc) <= 240 else exc[:239] + "…"
    values = {
        "rank_text": rank_text(diag.initiating_rank),
        "host_text": diag.initiating_host or "the node",
        "exc": exc,
        "exc_type": (init.exc_type if init else None) or "exception",
        "message": (init.message if init else None) or exc,
    }
    diag.root_cause = fmt(fc.root_cause, values)
    if init is not None and init.kind == EventKind.EXIT and fc.id in GENERIC_CLASSES:
        # only the launcher's report of the exit: no exception of the process's own to quote
        how = (
            init.exc_type if (init.exc_type or "").startswith("exit code") else ("an error that its launcher reported")
        )
        diag.root_cause = (
            f"{values['rank_text']} ended with {how}; the log holds none of its own "
            "output that says why (its traceback is missing or cut before the "
            "exception line)."
        )
    diag.mechanism = fc.mechanism.strip()
    diag.fix = " ".join(fc.fix.split())
    if fc.checkpointer_prevents:
        diag.checkpointer_switch = CHECKPOINTER_SNIPPET
        diag.fix += (
            " ckptguard's Checkpointer prevents this class: one discovered leader per "
            "filesystem, fresh attempt directories and an atomic commit. Switch with two lines: "
            + CHECKPOINTER_SNIPPET.replace("\n", " ; ")
        )
    diag.prevention = list(fc.prevention)
    diag.confirm = list(fc.confirm)
    text = "" if init is None else " ".join([init.message or "", *(e.text for e in init.evidence)])
    ckpt_dir = "<checkpoint dir>"
    pm = _QUOTED_PATH.search(text)
    if pm:
        p = pm.group(1) or pm.group(2)
        ckpt_dir = os.path.dirname(p.rstrip("/")) or p
    elif announced and "/" in announced:
        # the failure names no path: the checkpoint that a line announced saving or removing
        ckpt_dir = os.path.dirname(announced) if _FILE_SUFFIX.search(announced) else announced.rstrip("/")
    module = "<module>"
    mm = re.search(r"No module named '([\w.]+)'", text)
    if mm:
        module = mm.group(1)
    diag.verify_command = fmt(fc.verify_command, {"ckpt_dir": ckpt_dir, "module": module})


def unproven(diag: Diagnosis, fc: FailureClass, u: Unproven, init: Event) -> None:
    """The class is only implied by the log: the headline, root cause, confirmation and
    confidence say what the log does not show."""
    exc = (
        f"{init.exc_type}: {init.message}"
        if init.exc_type and init.message
        else (init.exc_type or init.evidence[0].text)
    )
    diag.title = u.title
    diag.root_cause = fmt(
        u.root_cause,
        {"rank_text": rank_text(diag.initiating_rank), "host_text": diag.initiating_host or "the node", "exc": exc},
    )
    diag.confirm = list(u.confirm) or diag.confirm
    if u.fix:
        diag.fix = " ".join(u.fix.split()) + " " + diag.fix
    diag.confidence = round(min(diag.confidence, u.confidence_cap), 2)
    diag.notes.append(
        "The log implies this class but does not prove it; the commands under "
        "'How to confirm' tell (" + "; ".join(c.split("`")[1] for c in u.confirm if "`" in c) + ")."
    )


def alternatives(
    diag: Diagnosis, att: Attribution, kb: KnowledgeBase, ex: Extractor, names: list[str], cls: str
) -> None:
    """Competing hypotheses: other signatures of the same lines, other ranks' failures, other
    unattributed failures, and what an exit without a message leaves open."""
    init = att.init
    alts: dict[str, Hypothesis] = {}

    def add(
        c: str,
        score: float,
        ranks: list[int],
        ev: list[EvidenceLine],
        why: str,
        title: str | None = None,
        label: str | None = None,
    ) -> None:
        key = label or c
        if key in alts or c == cls or (c in kb and kb[c].collateral and label is None):
            return
        alts[key] = Hypothesis(c, title or kb[c].title, round(score, 2), ranks, ev, why)

    if init is not None:
        ranks = [init.rank] if init.rank is not None else []
        first = [evline(init.evidence[0], names, "initiating", init.rank)]
        for m in init.matches[1:]:
            add(
                m.class_id,
                m.weight * 0.9,
                ranks,
                first,
                "a plain exception in the code: the more specific signature above explains it better"
                if m.class_id == "python_exception"
                else "the same lines match this class, with a less specific signature",
            )
        if cls != init.class_id:
            add(
                init.class_id,
                init.weight * 0.8,
                ranks,
                first,
                "the failing line alone reads as this, but a rule across lines or ranks explains it better",
            )
        for r in att.also:
            e = att.firsts[r]
            h = alts.get(e.class_id)
            if h is None:
                add(
                    e.class_id,
                    e.weight * 0.7,
                    [],
                    [],
                    f"these ranks failed later ({diag.ordering_basis}); a later failure is usually a consequence",
                )
                h = alts.get(e.class_id)
            if h is not None and r not in h.ranks:
                h.ranks.append(r)
                if len(h.evidence) < 3:
                    h.evidence.append(evline(e.evidence[0], names, "context", r))
        if init.kind == EventKind.EXIT:
            sig = _signal_of(init)
            rule = kb.rules.signals.get(sig) if sig is not None else None
            for a in rule.alternatives if rule else ():
                add(
                    a.class_id,
                    a.score,
                    ranks,
                    [evline(init.evidence[0], names, "launcher", init.rank)],
                    a.why_not,
                    title=a.title,
                    label=a.label,
                )
    unattr = att.views.get(None)
    for e in unattr.primary if unattr else []:
        if e is not init and tier(kb, e) == 3:
            add(
                e.class_id,
                e.weight * 0.7,
                [],
                [evline(e.evidence[0], names, "context", None)],
                "also in the log, on a rank that the log does not name; "
                "the answer's evidence came first or is more specific",
            )
    for hint in att.hints:
        add(
            hint.class_id,
            hint.weight * 0.5,
            [hint.rank] if hint.rank is not None else [],
            [evline(hint.evidence[0], names, "context", hint.rank)],
            "named only by a warning or a retried error, which did not stop the run by itself",
        )
    if cls != kb.rules.race.class_id:
        for path, rks in ex.saves.items():
            if len(rks) >= 2:
                add(
                    kb.rules.race.class_id,
                    0.4,
                    sorted(rks),
                    [evline(ev, names, "context", r) for r, ev in list(rks.items())[:3]],
                    f"{len(rks)} ranks announced work on {path}, but the failure does not name that path",
                )
                break
    diag.alternatives = sorted(alts.values(), key=lambda h: -h.score)[:6]


def _signal_of(e: Event) -> int | None:
    m = re.match(r"exit code (-?\d+)", e.exc_type or "")
    if not m:
        return None
    code = int(m.group(1))
    return -code if code < 0 else (code - 128 if 128 < code < 160 else None)


def notes(diag: Diagnosis, att: Attribution) -> None:
    """What the reader should know about the answer's limits."""
    init = att.init
    if init is None:
        return
    same = [r for r in att.also if att.firsts[r].class_id == init.class_id]
    if same:
        diag.notes.append(
            f"Ranks {ranges(same)} failed the same way ({init.class_id}); the order between them rests on "
            f"{diag.ordering_basis}."
        )
    if init.kind == EventKind.EXIT:
        diag.notes.append("The log holds no message from the failing process itself, only its exit status.")
    if init.kind == EventKind.CUT:
        diag.notes.append(
            "The log is cut before the exception line of this traceback."
            + (f" The class rests on what its frames show was being done: {init.operation}." if init.operation else "")
            + (
                f" ({init.operation_basis}.) It is the most likely failure of that operation, not one the log shows."
                if init.operation_basis
                else ""
            )
        )
    elif init.operation:
        diag.notes.append(
            f"The exception names no cause of its own; the class rests on what its frames "
            f"show was being done: {init.operation}."
        )
    if diag.failure_class == "python_exception":
        missing = [
            "an errno, fatal signal, collective, CUDA, checkpoint, DataLoader or launcher "
            "message that names a known cause"
        ]
        if init.kind == EventKind.CUT:
            missing.append("the exception line (the traceback is cut before it)")
        if not init.frames:
            missing.append("the traceback's frames")
        elif not init.operation:
            missing.append(
                "a frame doing a known operation (saving, loading, rotating a checkpoint, a collective, DataLoader I/O)"
            )
        if diag.initiating_rank is None:
            missing.append("which rank raised it")
        diag.notes.append(
            "Answered with the generic class, as a last resort: the log does not show " + "; ".join(missing) + "."
        )
    if init.kind == EventKind.HINT:
        diag.notes.append("Only a warning or a retried error names a failure; the run may not have failed from it.")
    unseen = sorted(
        att.known
        - {r for r, v in att.views.items() if r is not None and v.events}
        - {diag.initiating_rank}
        - set(diag.collateral_ranks)
    )
    if unseen and diag.world_size:
        diag.notes.append(f"No failure lines for ranks {ranges(unseen)} (their logs may be elsewhere).")


def timeline(events: list[Event], kb: KnowledgeBase, names: list[str]) -> list[TimelineEvent]:
    """The per-rank timeline of the HTML report (bounded)."""
    out = []
    for e in sorted(events, key=lambda e: e.seq)[:2000]:
        out.append(
            TimelineEvent(
                e.rank,
                e.ts,
                e.seq,
                e.class_id,
                kb[e.class_id].collateral,
                names[e.source],
                e.line,
                e.evidence[0].text[:160],
            )
        )
    return out
