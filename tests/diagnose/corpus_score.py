"""Score `ckptguard diagnose` on the labelled dev corpus of real crash logs.

Used by the parametrised corpus test and runnable on its own, to print the tables that
docs/diagnose.md shows:

    PYTHONPATH=src python tests/diagnose/corpus_score.py [CORPUS_DIR ...]

(several directories: each one's table, then the reliability table of all of them together).
The corpora live outside the repository (``diagnose-dev`` and ``diagnose-dev2`` under
``$CKPTGUARD_CORPUS``, by default ``<repo>/../shared/corpus``); they are never copied in,
because the same engine is also scored on logs that are in neither.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ckptguard.diagnose.engine import Diagnosis, diagnose

REPO = Path(__file__).resolve().parents[2]
# Where the corpora are: ``$CKPTGUARD_CORPUS`` when set, else ``<repo>/../shared/corpus``.
CORPUS_ROOT = Path(os.environ.get("CKPTGUARD_CORPUS") or REPO.parent / "shared" / "corpus")
CORPUS = CORPUS_ROOT / "diagnose-dev"
CORPUS2 = CORPUS_ROOT / "diagnose-dev2"
CORPORA = (CORPUS, CORPUS2)
# Bands of the reliability table: (label, lowest confidence, highest confidence exclusive).
BANDS = (("high (>= 0.8)", 0.8, 1.01), ("medium (0.5-0.8)", 0.5, 0.8), ("low (< 0.5)", 0.0, 0.5))


@dataclass(frozen=True)
class Label:
    """One line of labels.jsonl: what a reader of the thread decided."""

    file: str
    failure_class: str
    initiating_rank: int | None
    evidence_lines: tuple[str, ...]
    score_class: bool = True  # False: the class does not follow from the log itself
    score_rank: bool = True  # False: the first rank does not follow from the log itself


@dataclass(frozen=True)
class Scored:
    """The engine's answer for one labelled log, and which parts of it are right."""

    label: Label
    got_class: str | None
    got_rank: int | None
    confidence: float
    class_ok: bool | None  # None: the label's class is not scored
    rank_ok: bool | None  # None: the label names no rank, or it is not scored
    evidence_ok: bool
    evidence: tuple[str, ...]

    @property
    def right(self) -> bool:
        """Right class, and right rank where the label names one (used for the bands)."""
        return self.class_ok is not False and self.rank_ok is not False


def load_labels(corpus: Path = CORPUS) -> list[Label]:
    """Parse labels.jsonl (the file is data: never edited here)."""
    out = []
    for raw in (corpus / "labels.jsonl").read_text(encoding="utf-8").splitlines():
        if raw.strip():
            d = json.loads(raw)
            out.append(Label(d["file"], d["failure_class"], d["initiating_rank"],
                             tuple(d.get("evidence_lines", ())),
                             d.get("score_class", True) is not False, d.get("score_rank", True) is not False))
    return out


def score_one(label: Label, corpus: Path = CORPUS) -> Scored:
    """Diagnose one log and compare the answer with its label."""
    d: Diagnosis = diagnose([str(corpus / label.file)])
    texts = tuple(e.text for e in d.evidence)
    return Scored(
        label=label, got_class=d.failure_class, got_rank=d.initiating_rank,
        confidence=d.confidence,
        class_ok=d.failure_class == label.failure_class if label.score_class else None,
        rank_ok=None if label.initiating_rank is None or not label.score_rank
        else d.initiating_rank == label.initiating_rank,
        evidence_ok=any(ev in t for ev in label.evidence_lines for t in texts),
        evidence=texts,
    )


def score_all(corpus: Path = CORPUS) -> list[Scored]:
    """Score every labelled log."""
    return [score_one(lb, corpus) for lb in load_labels(corpus)]


def summary(results: list[Scored]) -> dict[str, tuple[int, int]]:
    """(right, out of) for class (where scored), rank (where labelled and scored) and evidence
    (where the class is scored)."""
    classed = [r for r in results if r.class_ok is not None]
    ranked = [r for r in results if r.rank_ok is not None]
    return {
        "class": (sum(bool(r.class_ok) for r in classed), len(classed)),
        "rank": (sum(bool(r.rank_ok) for r in ranked), len(ranked)),
        "evidence": (sum(r.evidence_ok for r in classed), len(classed)),
    }


def bands(results: list[Scored]) -> list[tuple[str, int, int]]:
    """Reliability per confidence band: (band, answers, right)."""
    out = []
    for name, lo, hi in BANDS:
        inside = [r for r in results if r.class_ok is not None and lo <= r.confidence < hi]
        out.append((name, len(inside), sum(r.right for r in inside)))
    return out


def per_class(results: list[Scored]) -> list[tuple[str, int, int, int, int]]:
    """Per labelled class: (class, logs, class right, rank labelled, rank right)."""
    rows: dict[str, list[int]] = {}
    for r in results:
        if r.class_ok is None:
            continue
        # a negative log (no failure in it) is labelled with no class
        row = rows.setdefault(r.label.failure_class or "(no failure)", [0, 0, 0, 0])
        row[0] += 1
        row[1] += r.class_ok
        if r.rank_ok is not None:
            row[2] += 1
            row[3] += r.rank_ok
    return [(c, *v) for c, v in sorted(rows.items())]  # type: ignore[misc]


def report(results: list[Scored]) -> str:
    """Markdown tables: totals, per class, reliability bands, and the misses."""
    s = summary(results)
    lines = [
        f"right class {s['class'][0]}/{s['class'][1]}, right initiating rank {s['rank'][0]}/{s['rank'][1]}, "
        f"labelled evidence shown {s['evidence'][0]}/{s['evidence'][1]}",
        "",
        "| class | logs | class right | rank labelled | rank right |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {c} | {n} | {ok} | {rl} | {rr} |" for c, n, ok, rl, rr in per_class(results)]
    lines += ["", "| confidence | answers | right |", "| --- | --- | --- |"]
    lines += [f"| {name} | {n} | {ok} |" for name, n, ok in bands(results)]
    misses = [r for r in results if r.class_ok is not None and not (r.right and r.evidence_ok)]
    if misses:
        lines += ["", "misses:"]
        for r in misses:
            lines.append(f"- {Path(r.label.file).name}: got {r.got_class} rank {r.got_rank} "
                         f"conf {r.confidence:.2f}; want {r.label.failure_class} rank "
                         f"{r.label.initiating_rank}; evidence {'ok' if r.evidence_ok else 'MISSING'}")
    return "\n".join(lines)


if __name__ == "__main__":
    dirs = [Path(a) for a in sys.argv[1:]] or [CORPUS]
    every: list[Scored] = []
    for d in dirs:
        res = score_all(d)
        every += res
        print(f"## {d.name}\n\n{report(res)}\n")
    if len(dirs) > 1:
        print("## all together\n\n| confidence | answers | right |\n| --- | --- | --- |")
        print("\n".join(f"| {name} | {n} | {ok} |" for name, n, ok in bands(every)))
