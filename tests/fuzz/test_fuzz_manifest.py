"""Fuzzing a real checkpoint's manifest: hostile values in any field, and chunk lists with item rows
rewritten together (checksums recomputed), then every command on the root (tests/fuzz/harness.py
states the properties). The CI slice runs a fixed, derandomized set of examples; the long run
(``-m long``) runs ``CKPTGUARD_FUZZ_EXAMPLES`` (default 100,000) from ``CKPTGUARD_FUZZ_SEED``."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.fuzz.harness import bounded, check_properties, fresh_copy, kept_until_exit, make_base, run_commands, scratch
from tests.fuzz.mutate import manifest_path, split
from tests.fuzz.strategies import Edit, chunk_layouts, edits, rewrite_chunks, rewrite_with_edits

REGRESSIONS = Path(__file__).parent / "regressions" / "manifest_edits.json"
CI_EXAMPLES = int(os.environ.get("CKPTGUARD_FUZZ_CI_EXAMPLES", "60"))
LONG_EXAMPLES = int(os.environ.get("CKPTGUARD_FUZZ_EXAMPLES", "100000"))
LONG_SEED = int(os.environ.get("CKPTGUARD_FUZZ_SEED", "0"))

_COMMON: dict[str, Any] = {
    "deadline": None,
    "database": None,
    "print_blob": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
CI = settings(max_examples=CI_EXAMPLES, derandomize=True, **_COMMON)
LONG = settings(max_examples=LONG_EXAMPLES, **_COMMON)


@functools.cache
def _base() -> Path:
    """A root saved once per process (every example works on a copy)."""
    return make_base(kept_until_exit("ckptguard-fuzz-") / "base")


@functools.cache
def _decoded() -> dict[str, Any]:
    body, tables = split(manifest_path(_base(), 2).read_bytes())
    return {"body": body, "tables": tables}


def check_edits(changes: list[Edit]) -> None:
    with scratch("ckptguard-fuzz-ex-") as where:
        root = fresh_copy(_base(), where / "root")
        rewrite_with_edits(root, 2, changes)
        with bounded():
            check_properties(run_commands(root, where))


def check_chunks(fqn: str, chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    with scratch("ckptguard-fuzz-ex-") as where:
        root = fresh_copy(_base(), where / "root")
        rewrite_chunks(root, 2, fqn, chunks)
        with bounded():
            check_properties(run_commands(root, where))


_SHAPES = {"w": (8,), "x": (4, 4)}
layouts = st.sampled_from(sorted(_SHAPES)).flatmap(lambda f: st.tuples(st.just(f), chunk_layouts(_SHAPES[f])))


def _manifest_edits() -> st.SearchStrategy[list[Edit]]:
    return st.deferred(lambda: edits(_decoded()))


@CI
@given(_manifest_edits())
def test_hostile_fields_of_a_manifest_ci(changes: list[Edit]) -> None:
    check_edits(changes)


@CI
@given(layouts)
def test_hostile_chunk_lists_with_matching_items_ci(layout: tuple[str, list[Any]]) -> None:
    check_chunks(*layout)


@pytest.mark.parametrize(
    "case", json.loads(REGRESSIONS.read_text()) if REGRESSIONS.exists() else [], ids=lambda c: c["name"]
)
def test_regressions_found_by_the_fuzzer(case: dict[str, Any]) -> None:
    """Shrunk counterexamples of earlier runs (each failed before its fix)."""
    if "chunks" in case:
        check_chunks(case["fqn"], [(tuple(o), tuple(s)) for o, s in case["chunks"]])
    else:
        check_edits([Edit.from_json(e) for e in case["edits"]])


@pytest.mark.long
@seed(LONG_SEED)
@LONG
@given(st.one_of(_manifest_edits().map(lambda e: ("edits", e)), layouts.map(lambda c: ("chunks", c))))
def test_hostile_manifests_long(case: tuple[str, Any]) -> None:
    kind, value = case
    if kind == "edits":
        check_edits(value)
    else:
        check_chunks(*value)


# -- planner paths: the parse accepts exactly the paths that form one tree -----------------------------

_PATH_PARTS = st.sampled_from(["a", "b", "model", 0, 1, 2, 7, -1])
planner_datas = st.dictionaries(
    st.sampled_from(["p", "q", "r", "s", "t", "u"]), st.lists(_PATH_PARTS, max_size=4), min_size=1, max_size=6
)


def _one_tree(planner: dict[str, list[Any]]) -> bool:
    """The rule as the format states it, written plainly: every path non-empty, starting with a key, each
    index below the number of paths, and what follows any prefix always of one kind (key, index, value)."""
    kinds: dict[tuple[Any, ...], str] = {}
    for path in planner.values():
        if not path or type(path[0]) is not str:
            return False
        if any(type(p) is int and not 0 <= p < len(planner) for p in path):
            return False
        for i in range(len(path) + 1):
            kind = "value" if i == len(path) else type(path[i]).__name__
            if kinds.setdefault(tuple(path[:i]), kind) != kind:
                return False
    return True


@functools.cache
def _sealed_manifest() -> Any:
    from ckptguard.protocol.manifest import Manifest

    path = manifest_path(_base(), 2)
    return Manifest.from_json(path.read_bytes(), str(path))


@CI
@given(planner_datas)
def test_planner_paths_are_accepted_exactly_when_they_form_one_tree_ci(planner: dict[str, list[Any]]) -> None:
    import dataclasses

    from ckptguard.errors import CorruptCheckpointError
    from ckptguard.protocol.manifest import Manifest

    m = _sealed_manifest()
    dcp = json.loads(json.dumps(m.dcp))
    dcp["planner_data"] = {**dcp["planner_data"], **planner}
    data = dataclasses.replace(m, dcp=dcp).to_json()
    try:
        Manifest.from_json(data, "MANIFEST.json")
        accepted = True
    except CorruptCheckpointError as e:
        assert "planner path" in str(e), e
        accepted = False
    assert accepted == _one_tree(dcp["planner_data"])
