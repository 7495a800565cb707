"""Misuse is refused at the door with a message naming the argument; configuration set after construction
takes effect (or is refused); a template that does not fit the checkpoint is named key by key."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptguard import Checkpointer, CheckpointError, TemplateMismatchError


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"keep_last": "3"}, TypeError, "keep_last must be an int >= 1 or None, got '3'"),
        ({"keep_last": 1.5}, TypeError, "keep_last must be an int >= 1 or None, got 1.5"),
        ({"keep_last": True}, TypeError, "keep_last"),
        ({"keep_last": 0}, ValueError, "keep_last must be >= 1"),
        ({"keep_every": -2}, ValueError, "keep_every must be >= 1"),
        ({"io_threads": 0}, ValueError, "io_threads must be >= 1"),
        ({"io_threads": None}, TypeError, "io_threads must be an int >= 1, got None"),
        ({"checksum": "md5"}, ValueError, "checksum must be one of"),
        ({"visibility_timeout_s": 0}, ValueError, "visibility_timeout_s must be a finite number of seconds > 0"),
        ({"lease_ttl_s": "30"}, TypeError, "lease_ttl_s must be a number of seconds"),
        ({"collective_timeout_s": float("inf")}, ValueError, "collective_timeout_s"),
        ({"async_budget_bytes": -1}, ValueError, "async_budget_bytes must be >= 0"),
        ({"read_only": "yes"}, TypeError, "read_only must be True or False"),
        (
            {"process_group": "locl"},
            TypeError,
            'process_group must be None (all ranks), "local" (this rank alone) '
            "or a torch.distributed ProcessGroup, got 'locl' (str)",
        ),
        ({"process_group": 3}, TypeError, "process_group must be None"),
        ({"process_group": [0, 1]}, TypeError, "got [0, 1] (list) (a list of ranks? pass torch.distributed.new_group"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument_and_nothing_is_created(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=re.escape(words)):
        Checkpointer(tmp_path / "ck", **kwargs)
    assert not (tmp_path / "ck").exists()


def test_configuration_set_after_construction_takes_effect_or_is_refused(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck", keep_last=np.int64(5)) as ck:  # numpy ints are ints
        for step in range(4):
            ck.save(step, {"w": torch.full((2,), float(step))})
        ck.keep_last = 2  # retention reads it at the next save
        ck.save(4, {"w": torch.zeros(2)})
        assert ck.steps() == [3, 4] and ck.keep_last == 2
        ck.checksum = "crc32c"
        ck.io_threads = 1
        ck.save(5, {"w": torch.ones(2)})
        manifest = (Path(ck.path(5)) / "MANIFEST.json").read_bytes()
        assert b'"crc32c"' in manifest
        with pytest.raises(TypeError, match="keep_last must be an int"):
            ck.keep_last = "3"  # type: ignore[assignment]
        with pytest.raises(ValueError, match="checksum must be one of"):
            ck.checksum = "sha1"
        with pytest.raises(AttributeError, match=r"open a new Checkpointer\(.*read_only=True\)"):
            ck.read_only = True
        assert ck.keep_last == 2 and ck.checksum == "crc32c" and not ck.read_only


def test_read_only_on_a_path_that_does_not_exist_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ckptguard"), Checkpointer(tmp_path / "typo", read_only=True) as ck:
        assert ck.load({"w": torch.zeros(2)}) is None
    assert any("does not exist" in r.getMessage() and "typo" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "typo").exists()


def test_a_template_that_does_not_fit_is_named_key_by_key_before_anything_is_read(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": {"w": torch.ones(4, 3), "b": torch.zeros(3)}, "n": 1})
        ck.save(2, {"model": {"w": torch.ones(4, 3) * 2, "b": torch.zeros(3)}, "n": 2})
        template = {"model": {"w": torch.zeros(4, 2), "b": torch.zeros(3), "extra": torch.zeros(1)}, "n": 0}
        with pytest.raises(TemplateMismatchError) as err:
            ck.load(template)  # step=None: not mistaken for a corrupt checkpoint (no fall-back to step 1)
        text = str(err.value)
        assert "model.w: checkpoint: shape [4, 3] torch.float32, template: shape [4, 2] torch.float32" in text
        assert "model.extra: not in the checkpoint" in text and "model.b" not in text
        assert isinstance(err.value, ValueError) and template["n"] == 0 and not template["model"]["w"].any()
        template["model"]["w"] = torch.zeros(4, 3)
        assert ck.load(template, strict=False) == 2 and template["n"] == 2


def test_a_template_of_another_dtype_is_refused_unless_the_cast_is_lossless(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"w": torch.tensor([1.7, -2.9, 100000.5], dtype=torch.float64)})
        for dtype in (torch.int8, torch.float16, torch.float32):
            template = {"w": torch.zeros(3, dtype=dtype)}
            with pytest.raises(
                TemplateMismatchError, match=rf"w: checkpoint: shape \[3\] torch.float64, template: shape \[3\] {dtype}"
            ):
                ck.load(template)
            assert not template["w"].any()
        same = {"w": torch.zeros(3, dtype=torch.float64)}
        assert ck.load(same) == 1 and same["w"][2] == 100000.5
        ck.save(
            2, {"h": torch.tensor([1.5, -65536.0], dtype=torch.bfloat16), "i": torch.tensor([-128], dtype=torch.int8)}
        )
        wider = {"h": torch.zeros(2), "i": torch.zeros(1, dtype=torch.int32)}  # lossless widenings are made
        assert ck.load(wider) == 2 and wider["h"].tolist() == [1.5, -65536.0] and wider["i"].tolist() == [-128]
        with pytest.raises(
            TemplateMismatchError,
            match=r"i: checkpoint: shape \[1\] torch.int8, template: shape "
            r"\[1\] torch.uint8",
        ):
            ck.load({"h": torch.zeros(2), "i": torch.zeros(1, dtype=torch.uint8)})


@pytest.mark.parametrize("value", [3, [0.0] * 6, None, "w"])
def test_a_plain_value_where_a_tensor_was_saved_is_a_template_mismatch(tmp_path: Path, value: object) -> None:
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"w": torch.ones(2, 3), "n": 5})
        with pytest.raises(
            TemplateMismatchError,
            match=r"w: checkpoint: a tensor of shape \[2, 3\] torch.float32, "
            rf"template: a non-tensor value \({type(value).__name__}\)",
        ):
            ck.load({"w": value, "n": 0})
        with pytest.raises(TemplateMismatchError, match=r"n: checkpoint: a non-tensor value, template: shape \[2\]"):
            ck.load({"w": torch.zeros(2, 3), "n": torch.zeros(2)})


def test_only_the_documented_settings_may_be_assigned_and_each_is_validated(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck") as ck:
        for name in ("collective_timeout_s", "async_budget_bytes", "lease_ttl_s"):
            with pytest.raises(
                AttributeError,
                match=rf"{name} is fixed when a Checkpointer is opened: open a new "
                rf"Checkpointer\(.*{name}=\.\.\.\); the settings that may be "
                r"assigned are keep_last, keep_every, .*progress",
            ):
                setattr(ck, name, -1)
        with pytest.raises(
            AttributeError,
            match=r"no setting 'keep_lst'; the settings that may be assigned are "
            r"keep_last",
        ):
            ck.keep_lst = 1  # type: ignore[attr-defined]
        with pytest.raises(TypeError, match="progress must be True or False, got 'yes'"):
            ck.progress = "yes"  # type: ignore[assignment]
        with pytest.raises(AttributeError):
            ck.last_save_stats = None  # type: ignore[misc]
        ck.progress = True
        ck.save(1, {"w": torch.ones(2)})
        assert ck.progress and not hasattr(ck, "keep_lst") and ck.last_save_stats is not None


def test_save_arguments_of_the_wrong_type_are_named(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(TypeError, match=r"metadata must be a mapping of str to JSON values .*got 'loss=1' \(str\)"):
            ck.save(1, {"w": torch.ones(1)}, metadata="loss=1")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"files must be a mapping of a key to a local path .*got '/tmp' \(str\)"):
            ck.save(1, {"w": torch.ones(1)}, files="/tmp")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"rank 0: files\['x'\] must be a local path .*got 3 \(int\)"):
            ck.save(1, {"w": torch.ones(1)}, files={"x": 3})  # type: ignore[dict-item]
        assert ck.steps() == []


@pytest.mark.parametrize("read_only", [True, False])
def test_a_root_that_is_a_regular_file_is_refused_saying_so(
    tmp_path: Path, read_only: bool, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"not a directory")
    with (
        caplog.at_level(logging.WARNING, logger="ckptguard"),
        pytest.raises(CheckpointError, match=rf"the root {path} is a file, not a directory"),
    ):
        Checkpointer(path, read_only=read_only)
    assert not any("does not exist" in r.getMessage() for r in caplog.records)
    assert path.read_bytes() == b"not a directory"


def test_read_refuses_a_string_for_keys(tmp_path: Path) -> None:
    """``keys="meta"`` read the keys "m", "e", "t", "a" and returned {} without a word."""
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"meta": {"epoch": 3}, "w": torch.ones(2)})
        with pytest.raises(TypeError, match=r"keys=\['meta'\]"):
            ck.read(keys="meta")
        assert ck.read(keys=["meta"]) == {"meta": {"epoch": 3}}


@pytest.mark.parametrize(
    ("stored", "template", "values"),
    [
        # float8 formats differ in precision, range, infinities and signed zeros: none of these is a
        # lossless widening, though a finfo comparison calls all four one
        ("float8_e4m3fn", "float8_e5m2fnuz", [1.125, 1.375, 448.0, -0.0]),
        ("float8_e4m3fnuz", "float8_e5m2fnuz", [1.125, 1.375, 240.0]),
        ("float8_e5m2", "float8_e5m2fnuz", [float("inf"), -0.0, 1.0]),
        ("bool", "float8_e8m0fnu", [0.0, 1.0]),  # e8m0 has no zero
        ("float16", "bfloat16", [1.0009765625, 65504.0]),
        ("bfloat16", "float16", [1e-30, 3e38]),
        ("int16", "float16", [2049, -32768]),
        ("uint8", "int8", [255, 0]),
    ],
)
def test_a_cast_that_changes_any_value_of_the_stored_dtype_is_refused(
    tmp_path: Path, stored: str, template: str, values: list[float]
) -> None:
    stored_dtype, template_dtype = getattr(torch, stored, None), getattr(torch, template, None)
    if stored_dtype is None or template_dtype is None:
        pytest.skip(f"this torch has no {stored} or {template}")
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"x": torch.tensor(values).to(stored_dtype)})
        into = {"x": torch.zeros(len(values)).to(template_dtype)}
        before = into["x"].view(torch.uint8).clone()
        with pytest.raises(TemplateMismatchError, match=rf"x: checkpoint: shape \[{len(values)}\] torch.{stored}"):
            ck.load(into)
        assert torch.equal(into["x"].view(torch.uint8), before)


@pytest.mark.parametrize(
    ("stored", "template"),
    [
        ("float8_e4m3fn", "bfloat16"),
        ("float8_e5m2", "float16"),
        ("float8_e8m0fnu", "float32"),
        ("bool", "float8_e4m3fn"),
        ("bfloat16", "float32"),
        ("float16", "float64"),
        ("int8", "float16"),
        ("uint8", "int16"),
        ("uint16", "int32"),
    ],
)
def test_every_value_of_a_lossless_cast_loads_exactly(tmp_path: Path, stored: str, template: str) -> None:
    stored_dtype, template_dtype = getattr(torch, stored, None), getattr(torch, template, None)
    if stored_dtype is None or template_dtype is None:
        pytest.skip(f"this torch has no {stored} or {template}")
    if stored_dtype == torch.bool:
        every = torch.tensor([False, True])
    else:  # every bit pattern of the stored dtype
        every = torch.arange(1 << (8 * stored_dtype.itemsize), dtype=torch.int32)
        every = (every.to(torch.uint8) if stored_dtype.itemsize == 1 else every.to(torch.int16)).view(stored_dtype)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"x": every})
        into = {"x": torch.zeros(every.shape, dtype=template_dtype)}
        ck.load(into)
    want, got = every.to(torch.float64), into["x"].to(torch.float64)
    assert torch.equal(want.isnan(), got.isnan())
    keep = ~want.isnan()
    assert torch.equal(want[keep], got[keep]) and torch.equal(want[keep].signbit(), got[keep].signbit())
