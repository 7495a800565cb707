"""Tensors stored whole are read straight from the manifest's item table; a load at another world
size or sharding, or into a template that does not match, goes through DCP's planner and is refused
exactly as before: the same errors, and nothing of the caller's state changed."""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckptguard import Checkpointer, CorruptCheckpointError, TemplateMismatchError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _full() -> torch.Tensor:
    return torch.arange(32.0).reshape(4, 8)


def _save_sharded(rank: int, root: str, port: int) -> None:
    """Two ranks save one tensor sharded by rows and one plain tensor (stored once, whole)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    try:
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        mesh = init_device_mesh("cpu", (2,))
        with Checkpointer(root) as ck:
            ck.save(1, {"w": distribute_tensor(_full(), mesh, [Shard(0)]), "b": torch.arange(6.0) + 50})
    finally:
        dist.destroy_process_group()


def test_a_tensor_sharded_at_another_world_size_is_planned_by_dcp_and_checked_whole(
    tmp_path: Path, metadata_requests: list[set[str]]
) -> None:
    root = tmp_path / "ckpt"
    mp.spawn(_save_sharded, args=(str(root), _free_port()), nprocs=2, join=True)
    asked = metadata_requests
    out = {"w": torch.zeros(4, 8), "b": torch.zeros(6)}
    with Checkpointer(root, read_only=True) as ck:  # one rank: another world size
        assert ck.load(out, step=1) == 1
    assert torch.equal(out["w"], _full()) and torch.equal(out["b"], torch.arange(6.0) + 50)
    assert asked == [{"w"}]  # "b" is stored whole: read from the item table; "w" in two chunks: DCP's

    # A corrupt byte in a shard: refused, and neither tensor of the template changed.
    data = sorted((root / "step-00000001" / "data").glob("rank00001_*"))
    assert data
    raw = bytearray(data[0].read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data[0].write_bytes(bytes(raw))
    into = {"w": torch.full((4, 8), -1.0), "b": torch.full((6,), -1.0)}
    with Checkpointer(root, read_only=True) as ck, pytest.raises(CorruptCheckpointError):
        ck.load(into, step=1)
    assert torch.equal(into["w"], torch.full((4, 8), -1.0)) and torch.equal(into["b"], torch.full((6,), -1.0))


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ({"a": torch.zeros(5), "b": torch.zeros(2, 3)}, r"a: checkpoint: shape \[4\] torch.float32"),
        ({"a": torch.zeros(4), "b": torch.zeros(3, 2)}, r"b: checkpoint: shape \[2, 3\]"),
        ({"a": torch.zeros(4, dtype=torch.float16), "b": torch.zeros(2, 3)}, "template: shape \\[4\\] torch.float16"),
        ({"a": torch.zeros(4), "b": torch.zeros(2, 3), "c": torch.zeros(1)}, "c: not in the checkpoint"),
        ({"a": torch.zeros(4), "b": torch.zeros(2, 3), "n": torch.zeros(1)}, "n: checkpoint: a non-tensor value"),
        ({"a": torch.zeros(4), "b": 7, "n": 3}, "b: checkpoint: a tensor of shape"),
    ],
    ids=["shape", "transposed", "narrower-dtype", "missing-key", "tensor-for-object", "object-for-tensor"],
)
def test_a_template_the_items_do_not_match_is_refused_as_before_and_nothing_changes(
    tmp_path: Path, template: dict[str, Any], message: str
) -> None:
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"a": torch.ones(4), "b": torch.ones(2, 3), "n": 5})
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in template.items()}
    with Checkpointer(tmp_path / "ck", read_only=True) as ck, pytest.raises(TemplateMismatchError, match=message):
        ck.load(template, step=1)
    for k, v in before.items():
        assert torch.equal(template[k], v) if isinstance(v, torch.Tensor) else template[k] == v, k


def test_tensors_read_from_the_item_table_load_bitwise_in_every_load_mode(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    saved = {"model": {f"p{i}": torch.randn(int(n), generator=g) for i, n in enumerate(range(1, 200, 7))}}
    saved["model"]["ints"] = torch.arange(9, dtype=torch.int32).reshape(3, 3)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, saved)
    for memory in (None, 0, 1 << 30):  # the default, verify-first and in-memory loads
        into = {"model": {k: torch.full_like(v, -1) for k, v in saved["model"].items()}}
        with Checkpointer(tmp_path / "ck", read_only=True, load_memory_bytes=memory) as ck:
            assert ck.load(into, step=1) == 1
        for k, v in saved["model"].items():
            assert torch.equal(into["model"][k], v), (memory, k)
