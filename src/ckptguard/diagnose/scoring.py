"""Scoring: the class that explains the failure best, and how sure the diagnosis can be.

The failing line's best signature names a class; cross-rank rules (KB data in ``_rules.toml``)
can overrule it: several ranks racing on one checkpoint path, watchdog timeouts of one collective
with different op types or sizes (a desync), a warning earlier in the log that explains a
failure the log shows only in part. Confidence starts from the signature's specificity and is
lowered for everything the answer rests on indirectly (see the Diagnosis page).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ckptguard.diagnose.attribution import GENERIC, Attribution, tier
from ckptguard.diagnose.events import Extractor
from ckptguard.diagnose.kb import KnowledgeBase
from ckptguard.diagnose.model import Event, EventKind, Evidence, OrderingBasis, RankSource


@dataclass
class Verdict:
    """The class decided, its base weight, and what (if anything) overruled the failing line."""

    class_id: str
    weight: float
    rule: str = ""  # "race" | "desync" | "hint" | ""
    context: list[Evidence] = field(default_factory=list)
    cap: float = 1.0


def verdict(att: Attribution, ex: Extractor, kb: KnowledgeBase) -> Verdict:
    """Class for an answer with an initiating event."""
    init = att.init
    assert init is not None
    rules = kb.rules
    v = Verdict(init.class_id, init.weight)
    if init.kind == EventKind.HINT:
        v.cap = rules.confidence["hint_cap"]
        v.weight *= rules.confidence["hint_factor"]
        return v
    race = _race(att, ex, kb, init)
    if race:
        return Verdict(
            rules.race.class_id, max(init.weight, rules.race.weight), "race", race, rules.confidence["upgrade_cap"]
        )
    if tier(kb, init) <= 2:
        d = desync(ex, kb)
        if d and init.class_id in GENERIC | {"launcher_sigterm"}:
            return Verdict(rules.desync_class, rules.desync_weight, "desync", d, rules.confidence["upgrade_cap"])
        hint = _explaining_hint(att, kb, init)
        if hint is not None:
            return Verdict(hint.class_id, hint.weight, "hint", hint.evidence[:1], rules.confidence["hint_upgrade_cap"])
    return v


def _explaining_hint(att: Attribution, kb: KnowledgeBase, init: Event) -> Event | None:
    """A specific class named by a warning before a failure that names none itself."""
    before = [h for h in att.hints if h.seq < init.seq or init.kind == EventKind.EXIT]
    specific = [
        h for h in before if h.class_id not in GENERIC and not kb[h.class_id].weak and not kb[h.class_id].collateral
    ]
    return max(specific, key=lambda h: (h.weight, -h.seq)) if specific else None


def _race(att: Attribution, ex: Extractor, kb: KnowledgeBase, init: Event) -> list[Evidence]:
    """Several ranks announced work on the failing path, or failed on one path with a race
    errno: the evidence for it (empty if neither)."""
    rule = kb.rules.race
    if init.class_id not in rule.upgrade_from:
        return []
    text = init.text
    for path, ranks in ex.saves.items():
        if len(ranks) >= rule.min_ranks and path in text:
            return list(ranks.values())
    # the failure names the checkpoint by its last component only: every announcement of a path
    # with that name (the ranks' prefixes of one shared path are often printed differently)
    by_name: dict[str, dict[int, Evidence]] = {}
    for path, ranks in ex.saves.items():
        name = os.path.basename(path.rstrip("/"))
        if name and name in text:
            for r, ev in ranks.items():
                by_name.setdefault(name, {}).setdefault(r, ev)
    for ranks in by_name.values():
        if len(ranks) >= rule.min_ranks:
            return sorted(ranks.values(), key=lambda ev: (ev.source, ev.line))
    for path, copies in ex.repeated_saves.items():
        if len(copies) >= rule.min_ranks and (path in text or os.path.basename(path.rstrip("/")) in text):
            return copies[:8]
    by_path: dict[str, dict[int, Evidence]] = {}
    for e in att.events:
        if e.kind != EventKind.EXCEPTION or e.rank is None:
            continue
        m = rule.same_error.search(f"{e.exc_type}: {e.message}")
        if m:
            tail = "/".join(m.group("path").rstrip("/").split("/")[-2:])
            by_path.setdefault(tail, {}).setdefault(e.rank, e.evidence[0])
    for ranks in by_path.values():
        if len(ranks) >= rule.min_ranks and init.rank in ranks:
            return list(ranks.values())
    return []


def desync(ex: Extractor, kb: KnowledgeBase) -> list[Evidence]:
    """Timeouts of one collective (same SeqNum) with different op types or sizes, or progress
    bars stopped at one step with different totals in a log with a collective timeout."""
    by_seq: dict[str, dict[tuple[str, str], Evidence]] = {}
    for fp, ev in ex.fingerprints:
        shape = (fp.get("op", ""), fp.get("numel_in", ""))
        by_seq.setdefault(fp.get("seq", ""), {}).setdefault(shape, ev)
    for shapes in by_seq.values():
        ops = {op for op, _ in shapes}
        sizes = {n for _, n in shapes if n}
        if len(ops) > 1 or len(sizes) > 1:
            return list(shapes.values())[:4]
    rules = kb.rules
    if any(cls in rules.progress_requires for _, cls in ex.counts):
        for totals in ex.progress.values():
            # one loop whose length differs a little between ranks, not a training bar and a
            # validation bar that happen to stand at the same count
            if len(totals) > 1 and max(totals) <= min(totals) * 1.1:
                return list(totals.values())[:4]
    return []


def desync_odd_rank(ex: Extractor) -> tuple[int, str] | None:
    """The one rank that was in another collective at a sequence number where the others agree
    (``SeqNum=N, OpType=BROADCAST`` on one rank, ``ALLREDUCE`` on two or more), and why."""
    for seq in sorted({fp.get("seq", "") for fp, _ in ex.fingerprints}):
        ranks: dict[tuple[str, str], set[int]] = {}
        for fp, ev in ex.fingerprints:
            if fp.get("seq", "") == seq and ev.rank is not None:
                ranks.setdefault((fp.get("op", ""), fp.get("numel_in", "")), set()).add(ev.rank)
        if len(ranks) != 2:
            continue
        (a, ra), (b, rb) = sorted(ranks.items(), key=lambda kv: len(kv[1]))
        if len(ra) == 1 and len(rb) >= 2:
            (odd,) = ra
            return odd, (
                f"the one rank in another collective at the same sequence number (SeqNum={seq}: "
                f"{' '.join(x for x in a if x)} on rank {odd}, {' '.join(x for x in b if x)} "
                f"on the {len(rb)} others)"
            )
    return None


def confidence(att: Attribution, v: Verdict, kb: KnowledgeBase) -> float:
    """How sure the answer is, from the signature's weight and what the answer rests on."""
    init = att.init
    assert init is not None
    conf = v.weight
    via = init.rank_via.value or "none"
    conf *= kb.rules.rank_factor.get(via, 0.9)
    if att.init_rank is None and init.rank_via == RankSource.NONE:
        rivals = (
            {e.class_id for e in att.views[None].primary if tier(kb, e) == 3} - {init.class_id}
            if None in att.views
            else set()
        )
        if rivals:
            conf *= kb.rules.ordering_factor.get(OrderingBasis.UNATTRIBUTED.name, 0.85)
    other = {att.firsts[r].class_id for r in att.also if r in att.firsts} - {init.class_id}
    if other:
        conf *= kb.rules.ordering_factor.get(att.basis.name, 0.8)
    elif any(att.firsts[r].class_id == init.class_id for r in att.also if r in att.firsts):
        # several ranks raised the same error: which was first is only as sure as their order
        conf *= kb.rules.same_failure_factor.get(att.basis.name, 1.0)
    if init.kind == EventKind.EXIT and v.rule == "":
        conf = min(conf, init.weight)
    return round(min(conf, v.cap), 2)
