"""Hand-written variants (tests/diagnose/variants/, expectations in expected.toml): one or more
per engine rule or signature, in other shapes than the corpus log that showed the need, plus
negative cases (healthy runs, benign NCCL WARN lines, warnings and retried errors)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from ckptguard.diagnose.engine import diagnose

VARIANTS = Path(__file__).parent / "variants"
EXPECTED: dict[str, dict[str, object]] = tomllib.loads((VARIANTS / "expected.toml").read_text())


def test_every_variant_has_an_expectation() -> None:
    assert {p.stem for p in VARIANTS.glob("*.log")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_variant(name: str) -> None:
    want = EXPECTED[name]
    d = diagnose([str(VARIANTS / f"{name}.log")])
    if "class" in want:
        rank = want["rank"]
        assert (d.failure_class, d.initiating_rank) == (want["class"], None if rank == -1 else rank), (
            d.failure_class,
            d.initiating_rank,
            d.rank_attribution,
        )
        assert d.evidence and d.root_cause and d.fix
    if "kind" in want:
        assert d.kind == want["kind"], (d.failure_class, d.kind)
    if "evidence" in want:
        assert any(str(want["evidence"]) in e.text for e in d.evidence), [e.text for e in d.evidence]
    if "operation" in want:
        assert any(f"was being done: {want['operation']}." in n for n in d.notes), d.notes
    if "min_confidence" in want:
        assert d.confidence >= float(want["min_confidence"]), (d.failure_class, d.confidence)  # type: ignore[arg-type]
    if "max_confidence" in want:
        assert not d.found or d.confidence <= float(want["max_confidence"]), (d.failure_class, d.confidence)  # type: ignore[arg-type]


def test_negatives_are_never_confident_alarms() -> None:
    for name, want in EXPECTED.items():
        if name.startswith("clean_"):
            d = diagnose([str(VARIANTS / f"{name}.log")])
            assert not d.found or d.confidence < 0.5, (name, d.failure_class, d.confidence)
            assert "max_confidence" in want


def test_every_operation_has_a_reworded_variant() -> None:
    """Each [[operation]] of the rules decides at least one hand-written variant."""
    from ckptguard.diagnose.kb import load_kb

    covered = {str(w["operation"]) for w in EXPECTED.values() if "operation" in w}
    assert {op.name for op in load_kb().rules.operations} <= covered
