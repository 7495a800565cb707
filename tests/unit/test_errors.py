"""Each refusal of the public API has its own exception type (tests match types, not text)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptguard
from ckptguard import Checkpointer


def test_saving_a_committed_step_again_is_step_exists(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"w": torch.ones(3)})
        with pytest.raises(ckptguard.StepExistsError):
            ck.save(1, {"w": torch.zeros(3)})
        ck.save(1, {"w": torch.zeros(3)}, overwrite=True)


def test_loading_a_step_that_is_not_committed_is_step_not_found(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"w": torch.ones(3)})
        with pytest.raises(ckptguard.StepNotFoundError):
            ck.load({"w": torch.ones(3)}, step=2)


def test_a_files_key_naming_a_nested_path_twice_is_a_path_collision(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(ckptguard.PathCollisionError):
        ck.save(1, {"w": torch.ones(3)}, files={"x": tmp_path / "a", "y": tmp_path / "a" / "b"})


def test_a_second_writer_on_a_live_root_is_lease_held(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck", lease_ttl_s=30), pytest.raises(ckptguard.LeaseHeldError):
        Checkpointer(tmp_path / "ck", lease_wait_s=0.2)


class Opaque:
    """A class torch.load(weights_only=True) does not admit."""


def test_an_object_load_could_not_give_back_is_refused_at_save(tmp_path: Path) -> None:
    # (A stored object that would need unpickling code is refused on load: UnsafeObjectError,
    # tests/api/test_checkpointer.py::test_pickle_payload_in_stored_object_never_runs.)
    with Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(ckptguard.UnsupportedValueError, match=r"\['obj'\]\['o'\]"):
            ck.save(1, {"obj": {"o": Opaque()}})
        assert ck.steps() == []


def test_every_error_is_a_checkpoint_error_and_a_runtime_error() -> None:
    for name in ckptguard.__all__:
        obj = getattr(ckptguard, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, ckptguard.CheckpointError) and issubclass(obj, RuntimeError), name
