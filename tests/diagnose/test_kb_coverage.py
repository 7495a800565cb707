"""A knowledge-base rule must be a failure's signature, not one file's.

A signature that matches exactly one log of the corpora (diagnose-dev, diagnose-dev2) and none of the project's
own fixtures (tests/diagnose/fixtures, tests/diagnose/variants) was most likely written for that one file:
the same diagnosis is scored on real logs that nobody here has, where such a rule gains nothing.
Every rule needs a second, independent example among the fixtures.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ckptguard.diagnose.kb import load_kb

from .corpus_score import CORPORA

HERE = Path(__file__).parent
OWN = [
    p
    for d in (HERE / "fixtures", HERE / "variants")
    for p in d.rglob("*")
    if p.is_file() and p.suffix in ("", ".log", ".txt")
]


def _lines(paths: list[Path]) -> dict[Path, list[str]]:
    return {p: p.read_text(encoding="utf-8", errors="replace").splitlines() for p in paths}


def _rules() -> list[tuple[str, re.Pattern[str]]]:
    """Every regex that can decide an answer: class signatures and the engine rules."""
    kb = load_kb()
    out = [(f"{fc.id}: {s.pattern.pattern}", s.pattern) for fc in kb.classes.values() for s in fc.signatures]
    r = kb.rules
    out += [(f"launcher {lf.name}", lf.pattern) for lf in r.launchers]
    out += [(f"rank report {x.pattern.pattern}", x.pattern) for x in r.rank_reports]
    out += [(f"rank hint {x.pattern.pattern}", x.pattern) for x in r.rank_hints]
    out += [(f"traceback owner {x.pattern}", x) for x in r.traceback_owners]
    return out


def _hits(pattern: re.Pattern[str], files: dict[Path, list[str]]) -> int:
    return sum(1 for lines in files.values() if any(pattern.search(ln) for ln in lines))


@pytest.mark.skipif(not all(c.is_dir() for c in CORPORA), reason=f"corpora not found at {CORPORA}")
def test_no_rule_written_for_one_file() -> None:
    corpus = _lines(sorted(p for c in CORPORA for p in (c / "logs").glob("*.log")))
    own = _lines(OWN)
    single = [name for name, pat in _rules() if pattern_matches_once(pat, corpus) and _hits(pat, own) == 0]
    assert not single, (
        "rules that match one corpus log and no fixture of ours (add an "
        f"independent fixture or generalise them): {single}"
    )


def pattern_matches_once(pattern: re.Pattern[str], corpus: dict[Path, list[str]]) -> bool:
    return _hits(pattern, corpus) == 1


def test_own_fixtures_exist() -> None:
    assert len(OWN) > 40
