"""The dev corpus of real crash logs (issue 11): class, first rank, evidence and confidence.

The corpus lives next to the repository (``<repo>/../shared/corpus/diagnose-dev``); the tests
skip, saying so, only where it is absent. Per log: at least one labelled evidence string is
printed among the evidence; class and rank are asserted in total (>= 48/50 classes, >= 17/18
ranks), and the answers given with confidence >= 0.8 must be right >= 90 % of the time.
"""

from __future__ import annotations

from functools import cache

import pytest

from .corpus_score import CORPUS, Label, Scored, bands, load_labels, score_one, summary

pytestmark = pytest.mark.skipif(not (CORPUS / "labels.jsonl").is_file(),
                                reason=f"dev corpus not found at {CORPUS} (a clean clone has it in ../shared)")
LABELS = load_labels() if (CORPUS / "labels.jsonl").is_file() else []


@cache
def _scored(file: str) -> Scored:
    label = next(lb for lb in LABELS if lb.file == file)
    return score_one(label)


def _all() -> list[Scored]:
    return [_scored(lb.file) for lb in LABELS]


@pytest.mark.parametrize("label", LABELS, ids=lambda lb: lb.file.split("/")[-1][:40])
def test_corpus_log(label: Label) -> None:
    """Each log: a labelled evidence line is among the evidence printed, and the answer."""
    s = _scored(label.file)
    assert s.evidence_ok, f"none of {label.evidence_lines} in the evidence {s.evidence}"
    assert s.got_class is not None, "a real crash log never gets 'no failure found'"


def test_corpus_totals() -> None:
    s = summary(_all())
    assert len(LABELS) == 50
    assert s["class"][0] >= 48, s
    assert s["rank"][1] == 18 and s["rank"][0] >= 17, s
    assert s["evidence"][0] == 50, s


def test_corpus_confidence_means_something() -> None:
    """High confidence is right >= 90 % of the time, and no less often than the lower bands."""
    table = {name: (n, ok) for name, n, ok in bands(_all())}
    n_hi, ok_hi = table["high (>= 0.8)"]
    assert n_hi >= 10 and ok_hi / n_hi >= 0.9, table
    n_lo, ok_lo = table["low (< 0.5)"]
    assert n_lo == 0 or ok_lo / n_lo <= ok_hi / n_hi, table
