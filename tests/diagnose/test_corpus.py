"""The labelled corpora of real crash logs (diagnose-dev and diagnose-dev2): class, first rank,
evidence and calibrated confidence.

The corpora live outside the repository (``$CKPTGUARD_CORPUS``, by default
``<repo>/../shared/corpus/``); the tests skip, saying what they need, only where they are absent
(CI has them). Rows labelled ``score_class``/``score_rank`` false are answered but not scored.
Each log must get an answer (never "no failure found"); totals must not fall below the figures
the engine reached (docs/diagnose.md), and over both corpora together the answers given with
confidence >= 0.8 must be right >= 90 % of the time.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from .corpus_score import (
    CORPORA,
    CORPUS,
    CORPUS2,
    CORPUS_ROOT,
    Label,
    Scored,
    bands,
    load_labels,
    score_one,
    summary,
)

# corpus -> (logs, class right, ranks labelled, rank right, labelled evidence shown): the floor
FLOORS = {CORPUS.name: (50, 50, 18, 18, 50), CORPUS2.name: (50, 50, 16, 16, 44)}
PRESENT = [c for c in CORPORA if (c / "labels.jsonl").is_file()]
pytestmark = pytest.mark.skipif(
    len(PRESENT) < len(CORPORA),
    reason=f"needs the labelled corpora diagnose-dev and diagnose-dev2 (each a labels.jsonl and logs/) "
    f"under {CORPUS_ROOT}; set CKPTGUARD_CORPUS to the directory that holds them",
)
CASES = [(c, lb) for c in PRESENT for lb in load_labels(c)]


@cache
def _scored(corpus: Path, file: str) -> Scored:
    label = next(lb for lb in load_labels(corpus) if lb.file == file)
    return score_one(label, corpus)


def _all(corpus: Path) -> list[Scored]:
    return [_scored(corpus, lb.file) for lb in load_labels(corpus)]


@pytest.mark.parametrize(("corpus", "label"), CASES, ids=[f"{c.name}/{lb.file.split('/')[-1][:36]}" for c, lb in CASES])
def test_corpus_log(corpus: Path, label: Label) -> None:
    """Each real crash log gets an answer; on diagnose-dev a labelled evidence line is printed."""
    s = _scored(corpus, label.file)
    assert s.got_class is not None, "a real crash log never gets 'no failure found'"
    if corpus == CORPUS:
        assert s.evidence_ok, f"none of {label.evidence_lines} in the evidence {s.evidence}"


@pytest.mark.parametrize("corpus", PRESENT, ids=lambda c: c.name)
def test_corpus_totals(corpus: Path) -> None:
    logs, cls, ranked, rank, evidence = FLOORS[corpus.name]
    s = summary(_all(corpus))
    assert s["class"][1] == logs and s["class"][0] >= cls, s
    assert s["rank"][1] == ranked and s["rank"][0] >= rank, s
    assert s["evidence"][0] >= evidence, s


def test_corpus_confidence_is_calibrated() -> None:
    """Over both corpora: high confidence is right >= 90 % of the time, and no less often than low."""
    table = {name: (n, ok) for name, n, ok in bands([r for c in PRESENT for r in _all(c)])}
    n_hi, ok_hi = table["high (>= 0.8)"]
    assert n_hi >= 20 and ok_hi / n_hi >= 0.9, table
    n_lo, ok_lo = table["low (< 0.5)"]
    assert n_lo == 0 or ok_lo / n_lo <= ok_hi / n_hi, table
