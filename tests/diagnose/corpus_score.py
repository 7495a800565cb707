"""Score `ckptguard diagnose` on the labelled dev corpus of real crash logs.

Used by the parametrised corpus test and runnable on its own, to print the tables that
docs/diagnose.md shows:

    PYTHONPATH=src python tests/diagnose/corpus_score.py [CORPUS_DIR ...]

(several directories: each one's table, then the reliability table of all of them together).
The corpora live outside the repository (``diagnose-dev`` and ``diagnose-dev2`` under
``$CKPTGUARD_CORPUS``, by default ``<repo>/../shared/corpus``); they are never copied in,
because the same engine is also scored on logs that are in neither.

A corpus directory with a ``split.json`` (the project's own collection, ``tests/diagnose/corpus``)
is scored per split (``dev``, ``sealed``, ``all``), and its rows' ``score_class`` / ``score_rank``
flags are honoured: a row whose decisive line is not in the log counts for neither total. Only the
dev split's misses are listed; the sealed split is reported as figures only.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ckptguard.diagnose.engine import Diagnosis, diagnose

REPO = Path(__file__).resolve().parents[2]
REAL = REPO / "tests" / "diagnose" / "corpus"
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
    score_class: bool = True
    score_rank: bool = True


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


def load_labels(corpus: Path = CORPUS, honour_flags: bool = True) -> list[Label]:
    """Parse labels.jsonl (the file is data: never edited here).

    Args:
        corpus: the corpus directory.
        honour_flags: read the rows' ``score_class`` / ``score_rank`` flags (the project's own
            corpora say a row is scored); False: every row is scored.

    Returns:
        One Label per row, in file order.
    """
    out = []
    for raw in (corpus / "labels.jsonl").read_text(encoding="utf-8").splitlines():
        if raw.strip():
            d = json.loads(raw)
            flags = (True, True)
            if honour_flags:
                flags = (bool(d.get("score_class", True)), bool(d.get("score_rank", True)))
            out.append(
                Label(d["file"], d["failure_class"], d["initiating_rank"], tuple(d.get("evidence_lines", ())), *flags)
            )
    return out


def load_split(corpus: Path = REAL) -> dict[str, str]:
    """The split of a corpus with a split.json: log file -> "dev" or "sealed"."""
    return dict(json.loads((corpus / "split.json").read_text(encoding="utf-8"))["files"])


def split_labels(corpus: Path, part: str) -> list[Label]:
    """The flag-honouring labels of one split ("dev", "sealed" or "all") of a split corpus."""
    split = load_split(corpus)
    return [lb for lb in load_labels(corpus, honour_flags=True) if part == "all" or split[lb.file] == part]


def score_one(label: Label, corpus: Path = CORPUS) -> Scored:
    """Diagnose one log and compare the answer with its label."""
    d: Diagnosis = diagnose([str(corpus / label.file)])
    texts = tuple(e.text for e in d.evidence)
    return Scored(
        label=label,
        got_class=d.failure_class,
        got_rank=d.initiating_rank,
        confidence=d.confidence,
        # the engine answers in the users' taxonomy (a KB class's family) and names the finer KB
        # class as its kind: a label with a finer class is right when the kind names it
        class_ok=label.failure_class in (d.failure_class, getattr(d, "kind", None)),
        rank_ok=(
            None
            if label.initiating_rank is None or not label.score_rank
            else d.initiating_rank == label.initiating_rank
        ),
        evidence_ok=any(ev in t for ev in label.evidence_lines for t in texts),
        evidence=texts,
    )


def score_all(corpus: Path = CORPUS) -> list[Scored]:
    """Score every labelled log."""
    return [score_one(lb, corpus) for lb in load_labels(corpus)]


def summary(results: list[Scored]) -> dict[str, tuple[int, int]]:
    """(right, out of) for class (rows scored for class), rank (where labelled and scored) and evidence."""
    ranked = [r for r in results if r.rank_ok is not None]
    classed = [r for r in results if r.label.score_class]
    return {
        "class": (sum(r.class_ok for r in classed), len(classed)),
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
        if not r.label.score_class:
            continue
        # a negative log (no failure in it) is labelled with no class
        row = rows.setdefault(r.label.failure_class or "(no failure)", [0, 0, 0, 0])
        row[0] += 1
        row[1] += r.class_ok
        if r.rank_ok is not None:
            row[2] += 1
            row[3] += r.rank_ok
    return [(c, *v) for c, v in sorted(rows.items())]  # type: ignore[misc]


def report(results: list[Scored], misses_listed: bool = True) -> str:
    """Markdown tables: totals, per class, reliability bands, and (unless told not to) the misses."""
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
    misses = [r for r in results if not (r.right and r.evidence_ok)]
    if misses and misses_listed:
        lines += ["", "misses:"]
        for r in misses:
            lines.append(
                f"- {Path(r.label.file).name}: got {r.got_class} rank {r.got_rank} "
                f"conf {r.confidence:.2f}; want {r.label.failure_class} rank "
                f"{r.label.initiating_rank}; evidence {'ok' if r.evidence_ok else 'MISSING'}"
            )
    return "\n".join(lines)


def score_split(corpus: Path, part: str) -> list[Scored]:
    """Score one split ("dev", "sealed" or "all") of a corpus with a split.json."""
    return [score_one(lb, corpus) for lb in split_labels(corpus, part)]


if __name__ == "__main__":
    dirs = [Path(a) for a in sys.argv[1:]] or [CORPUS]
    every: list[Scored] = []
    for d in dirs:
        if (d / "split.json").is_file():
            for part in ("dev", "sealed", "all"):
                res = score_split(d, part)
                print(f"## {d.name} ({part})\n\n{report(res, misses_listed=part == 'dev')}\n")
            every += score_split(d, "all")
            continue
        res = score_all(d)
        every += res
        print(f"## {d.name}\n\n{report(res)}\n")
    if len(dirs) > 1:
        print("## all together\n\n| confidence | answers | right |\n| --- | --- | --- |")
        print("\n".join(f"| {name} | {n} | {ok} |" for name, n, ok in bands(every)))
