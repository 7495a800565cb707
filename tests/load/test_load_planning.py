"""A load plans the tensors a checkpoint holds whole from the manifest's item table, and everything
else through DCP's metadata and planner: whatever the template's tensors are (views, slices of a
shared buffer, casts, empty, 0-dim, parameters), each loads as it did through DCP alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptguard import Checkpointer, CorruptCheckpointError, TemplateMismatchError


def saved_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "plain": torch.randn(64, 8, generator=g),
            "view": torch.randn(16, 4, generator=g),
            "slice": torch.randn(32, generator=g),
            "widened": torch.randn(12, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0, 5),
            "scalar": torch.tensor(7.5),
            "param": torch.randn(6, generator=g),
            "ints": torch.arange(10, dtype=torch.int64),
        },
        "meta": {"epoch": 3, "name": "run"},
    }


def template() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A template of the saved names, its tensors of every kind a load may be given; and the buffers
    some of them are views of (whose other bytes a load must leave alone)."""
    wide = torch.full((16, 8), -1.0)  # "view" is every other column of it
    shared = torch.full((80,), -2.0)  # "slice" is elements 20..51 of it
    state = {
        "model": {
            "plain": torch.zeros(64, 8),
            "view": wide[:, ::2],
            "slice": shared[20:52],
            "widened": torch.zeros(12, dtype=torch.float32),
            "empty": torch.empty(0, 5),
            "scalar": torch.tensor(0.0),
            "param": torch.nn.Parameter(torch.zeros(6), requires_grad=False),
            "ints": torch.zeros(10, dtype=torch.int64),
        },
        "meta": {"epoch": 0, "name": ""},
    }
    return state, {"wide": wide, "shared": shared}


def test_every_kind_of_template_tensor_loads_bitwise_and_nothing_beside_it_changes(tmp_path: Path) -> None:
    saved = saved_state()
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, saved)
    into, buffers = template()
    with Checkpointer(tmp_path / "ck", read_only=True) as ck:
        ck.load(into, step=1)
    for name, value in saved["model"].items():
        got = into["model"][name]
        expected = value.to(got.dtype)
        assert got.shape == expected.shape and torch.equal(got, expected), name
    assert into["meta"] == saved["meta"]
    assert torch.equal(buffers["wide"][:, 1::2], torch.full((16, 4), -1.0))  # the columns between the view's
    assert torch.equal(buffers["shared"][:20], torch.full((20,), -2.0))
    assert torch.equal(buffers["shared"][52:], torch.full((28,), -2.0))


def test_whole_tensors_are_planned_without_dcp_metadata_and_the_rest_with_it(
    tmp_path: Path, metadata_requests: list[set[str]]
) -> None:
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, saved_state())
    asked = metadata_requests
    into, _ = template()
    with Checkpointer(tmp_path / "ck", read_only=True) as ck:
        ck.load(into, step=1)
    # Read from the item table: the tensors stored whole that the template takes as they are.
    assert asked == [{"model.widened", "model.scalar", "model.param", "meta.epoch", "meta.name"}]


def test_a_corrupt_whole_tensor_is_refused_and_the_state_is_unchanged(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": {f"w{i}": torch.full((256,), float(i)) for i in range(8)}})
    data = sorted((tmp_path / "ck").glob("step-*/data/*"))
    assert data
    raw = bytearray(data[0].read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data[0].write_bytes(bytes(raw))
    into = {"model": {f"w{i}": torch.full((256,), -1.0) for i in range(8)}}
    with Checkpointer(tmp_path / "ck", read_only=True) as ck, pytest.raises(CorruptCheckpointError):
        ck.load(into, step=1)
    assert all(torch.equal(t, torch.full((256,), -1.0)) for t in into["model"].values())


def test_a_template_of_another_shape_or_dtype_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": {"a": torch.ones(4), "b": torch.ones(4, dtype=torch.float64)}})
    for wrong in (
        {"a": torch.zeros(5), "b": torch.zeros(4, dtype=torch.float64)},
        {"a": torch.zeros(4), "b": torch.zeros(4, dtype=torch.float16)},
    ):
        with Checkpointer(tmp_path / "ck", read_only=True) as ck, pytest.raises(TemplateMismatchError):
            ck.load({"model": wrong}, step=1)
        assert all(not t.any() for t in wrong.values())


@pytest.mark.parametrize(
    "make",
    [
        lambda base: base.as_strided((3, 4), (1, 1)),  # rows overlap (placed row by row: half-wrong values)
        lambda base: base.unfold(0, 3, 1),  # windows of one buffer
        lambda base: base[:1].expand(12),  # stride 0
        lambda base: base.as_strided((2, 3, 2), (3, 2, 1)),  # the last dimension steps into the next
    ],
    ids=["as_strided", "unfold", "expand", "three-dims"],
)
def test_a_template_tensor_whose_elements_share_memory_is_refused_and_nothing_changes(
    tmp_path: Path, make: Any
) -> None:
    base = torch.full((16,), -3.0)
    target = make(base)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"x": torch.randn(target.shape), "y": torch.ones(4)})
    into = {"x": target, "y": torch.zeros(4)}
    for memory in (None, 0, 1 << 30):  # the default, verify-first and in-memory loads
        with (
            Checkpointer(tmp_path / "ck", read_only=True, load_memory_bytes=memory) as ck,
            pytest.raises(TemplateMismatchError, match="share memory"),
        ):
            ck.load(into, step=1)
        assert torch.equal(base, torch.full((16,), -3.0)) and not into["y"].any()


@pytest.mark.parametrize(
    ("shape", "strides"), [((4, 3), (2, 9)), ((2, 3), (3, 2))], ids=["interleaved", "counted"]
)  # (the second: no stride steps over the other's span)
def test_a_template_of_strided_views_that_do_not_overlap_loads(
    tmp_path: Path, shape: tuple[int, int], strides: tuple[int, int]
) -> None:
    saved = torch.randn(shape)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"x": saved})
    base = torch.full((40,), -3.0)
    into = {"x": base.as_strided(shape, strides)}
    with Checkpointer(tmp_path / "ck", read_only=True) as ck:
        ck.load(into, step=1)
    assert torch.equal(into["x"], saved)
    written = torch.zeros(40, dtype=torch.bool)
    written[[strides[0] * i + strides[1] * j for i in range(shape[0]) for j in range(shape[1])]] = True
    assert torch.equal(base[~written], torch.full((int((~written).sum()),), -3.0))
