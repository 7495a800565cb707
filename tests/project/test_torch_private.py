"""Private torch APIs live in one module, which is checked against the torch versions tested."""

from __future__ import annotations

import ast

import torch

from ckptguard.dcp import _torch_private

from tests.support.jobs import REPO

SRC = REPO / "src" / "ckptguard"


def test_the_installed_torch_is_one_the_private_apis_were_tested_with() -> None:
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert version in _torch_private.TESTED_TORCH, (
        f"torch {torch.__version__} is not in TESTED_TORCH {_torch_private.TESTED_TORCH}: run this suite on it, "
        "then add it"
    )
    _torch_private.check_torch_version()


def _private_torch_uses(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            parts = (node.module or "").split(".")
            names = [a.name for a in node.names]
            if any(p.startswith("_") for p in parts) or any(n.startswith("_") for n in names):
                found.append(f"from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_cached"):
            found.append(f".{node.attr}")
    return found


def test_no_other_module_uses_a_private_torch_api() -> None:
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "_torch_private.py":
            continue
        uses = _private_torch_uses(ast.parse(path.read_text(), str(path)))
        offenders.extend(f"{path.relative_to(SRC)}: {u}" for u in uses)
    assert not offenders, offenders


def test_the_scan_sees_private_imports() -> None:
    code = "from torch.distributed.checkpoint._traverse import set_element\nfrom torch.x import _y\n"
    assert len(_private_torch_uses(ast.parse(code))) == 2


def test_the_manifests_dtype_table_covers_every_torch_dtype() -> None:
    """`ls`/`verify` check tensor rows against a torch-free table: a dtype it lacks would make a
    checkpoint that save wrote unreadable, so a new torch dtype must fail here first."""
    from ckptguard.dcp.records import ITEMSIZES

    dtypes = {str(v).removeprefix("torch."): v.itemsize for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert {k: ITEMSIZES.get(k) for k in dtypes} == dtypes


def test_the_fast_flattening_of_nested_mappings_is_dcps() -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as dcp_flatten

    t = torch.zeros(2)
    states = [
        {"model": {"a.b": t, "c": {"d": t, 3: 1.5}}, "step": 7, "opt": {"state": {0: {"m": t}}, "x": (1, t)}},
        {"m": {}, "e": {"f": {}}, "g": "text", "h": None},
        {1: t, (2, 3): t, "n": {"l": [t, {"k": t}], "o": t}},  # a list: DCP's own walk
        {"p": [1, 2], "q": [[t]], "r": [{"s": 1}]},
    ]
    for state in states:
        assert _torch_private.flatten_state_dict(state) == dcp_flatten(state)
    for dup in ({"a.b": t, "a": {"b": t}}, {"a": {"b": t}, "a.b": t}):
        try:
            dcp_flatten(dup)
        except ValueError as e:
            expected = str(e)
        try:
            _torch_private.flatten_state_dict(dup)
        except ValueError as e:
            assert str(e) == expected
        else:
            raise AssertionError("a duplicated flat key must be refused")
