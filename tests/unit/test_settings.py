"""The settings object: every field checked in one place (at construction and at ``replace``), the same
settings by ``settings=`` or by keywords, and an assignment on an open Checkpointer a new validated object."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckptguard import Checkpointer, CheckpointerSettings
from ckptguard.settings import FIELDS, FIXED, SETTABLE

COUNTS = {"keep_last": 1, "keep_every": 1, "io_threads": 1, "load_memory_bytes": 0, "async_budget_bytes": 0}
SECONDS = {"visibility_timeout_s": False, "lease_ttl_s": False, "collective_timeout_s": False, "lease_wait_s": True}


def test_every_field_has_a_docstring_and_is_either_assignable_or_fixed() -> None:
    import ast
    import inspect

    import ckptguard.settings as module

    tree = ast.parse(inspect.getsource(module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CheckpointerSettings")
    documented = {
        a.target.id
        for a, doc in zip(cls.body, cls.body[1:], strict=False)
        if isinstance(a, ast.AnnAssign)
        and isinstance(a.target, ast.Name)
        and isinstance(doc, ast.Expr)
        and isinstance(doc.value, ast.Constant)
    }
    assert documented == set(FIELDS)
    assert set(SETTABLE) | set(FIXED) == set(FIELDS) and not set(SETTABLE) & set(FIXED)
    assert all(hasattr(Checkpointer, name) for name in FIELDS)


@given(name=st.sampled_from(sorted(COUNTS)), value=st.integers(-5, 10))
def test_counts_are_refused_below_their_minimum_naming_the_field(name: str, value: int) -> None:
    if value < COUNTS[name]:
        with pytest.raises(ValueError, match=rf"^{name} must be >= {COUNTS[name]}"):
            CheckpointerSettings(**{name: value})
    else:
        made = CheckpointerSettings(**{name: np.int64(value)})  # numpy ints are ints, stored as int
        assert getattr(made, name) == value and type(getattr(made, name)) is int


@given(
    name=st.sampled_from(sorted(COUNTS)),
    value=st.one_of(st.text(max_size=3), st.floats(allow_nan=False), st.booleans(), st.lists(st.integers())),
)
def test_counts_of_another_type_are_a_type_error_naming_the_field(name: str, value: Any) -> None:
    with pytest.raises(TypeError, match=rf"^{name} must be an int >= {COUNTS[name]}"):
        CheckpointerSettings(**{name: value})


@given(name=st.sampled_from(sorted(SECONDS)), value=st.floats(allow_nan=True, allow_infinity=True))
def test_seconds_must_be_finite_and_positive(name: str, value: float) -> None:
    ok = value == value and abs(value) != float("inf") and (value > 0 or (value == 0 and SECONDS[name]))
    if ok:
        assert getattr(CheckpointerSettings(**{name: value}), name) == value
    else:
        with pytest.raises(ValueError, match=rf"^{name} must be a finite number of seconds"):
            CheckpointerSettings(**{name: value})


@pytest.mark.parametrize("name", ["read_only", "progress"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_flags_are_true_or_false(name: str, value: Any) -> None:
    with pytest.raises(TypeError, match=re.escape(f"{name} must be True or False, got {value!r}")):
        CheckpointerSettings(**{name: value})


def test_replace_checks_again_and_the_object_is_frozen() -> None:
    base = CheckpointerSettings(keep_last=3)
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        dataclasses.replace(base, keep_last=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.keep_last = 4  # type: ignore[misc]
    with pytest.raises(ValueError, match="checksum must be one of"):
        CheckpointerSettings(checksum="md5")


def test_settings_and_keywords_are_the_same_and_keywords_win(tmp_path: Path) -> None:
    given_settings = CheckpointerSettings(keep_last=2, io_threads=3, process_group="local")
    with Checkpointer(tmp_path / "a", settings=given_settings, io_threads=1) as ck:
        assert ck.keep_last == 2 and ck.io_threads == 1 and ck.settings.io_threads == 1
        assert ck.checksum == "xxh3-64"  # None: the storage's default, resolved when opened
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_lst'"):
        Checkpointer(tmp_path / "b", keep_lst=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="settings must be a CheckpointerSettings"):
        Checkpointer(tmp_path / "b", settings={"keep_last": 1})  # type: ignore[arg-type]
    assert not (tmp_path / "b").exists()


def test_an_assignment_makes_a_new_validated_settings_object(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck", process_group="local") as ck:
        before = ck.settings
        ck.keep_last = 1
        assert ck.settings is not before and before.keep_last is None and ck.settings.keep_last == 1
        with pytest.raises(ValueError, match="io_threads must be >= 1"):
            ck.io_threads = 0
        assert ck.settings.io_threads == 4
        for step in range(3):
            ck.save(step, {"w": torch.full((2,), float(step))})
        assert ck.steps() == [2]
        with pytest.raises(AttributeError, match=r"lease_ttl_s is fixed when a Checkpointer is opened"):
            ck.lease_ttl_s = 5.0
        assert ck.lease_ttl_s == 30.0
