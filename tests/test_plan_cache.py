"""What a save or a load reuses from the last one (DCP's cached save plan and global metadata, the
metadata's JSON form, the load plan's direct read items) is never served for a state of another
structure: a change of shape, dtype, key set, world size or sharding between saves of one
Checkpointer gives every step back bitwise as it was saved."""

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

from ckptguard import Checkpointer, TemplateMismatchError


def _states() -> dict[int, dict[str, Any]]:
    """One state per step; each differs from the one before in one part of its structure, and the
    last repeats the structure of the one before with other values (a cache hit)."""
    w = torch.arange(12.0).reshape(3, 4)
    return {
        1: {"model": {"w": w, "b": torch.ones(4)}, "epoch": 1},
        2: {"model": {"w": w.T.contiguous() + 100, "b": torch.ones(4) * 2}, "epoch": 2},  # shape
        3: {"model": {"w": (w.T.contiguous() + 200).double(), "b": torch.ones(4) * 3}, "epoch": 3},  # dtype
        4: {"model": {"w": (w.T.contiguous() + 300).double(), "extra": torch.full((5,), 4.0)}, "epoch": 4},  # keys
        5: {"model": {"w": (w.T.contiguous() + 400).double(), "extra": torch.full((5,), 5.0)}, "epoch": 5},  # same
    }


def _template(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(t) for k, t in state["model"].items()}, "epoch": 0}


def _same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return got["epoch"] == want["epoch"] and got["model"].keys() == want["model"].keys() and all(
        t.dtype == want["model"][k].dtype and torch.equal(t, want["model"][k]) for k, t in got["model"].items())


def test_shape_dtype_and_key_changes_between_saves_and_loads(tmp_path: Path) -> None:
    states = _states()
    with Checkpointer(tmp_path / "ckpt") as ck:
        for step, state in states.items():
            ck.save(step, state)
        # Loads by the saving Checkpointer, in an order where each load's structure differs from the last.
        for step in (5, 1, 4, 2, 3, 5):
            out = _template(states[step])
            assert ck.load(out, step=step) == step
            assert _same(out, states[step]), f"step {step} came back with another step's data"
    with Checkpointer(tmp_path / "ckpt", read_only=True) as reader:
        for step in (3, 1, 5, 2, 4):
            out = _template(states[step])
            assert reader.load(out, step=step) == step
            assert _same(out, states[step]), f"step {step} came back with another step's data"
        with pytest.raises(TemplateMismatchError):  # step 2's shapes, step 1's template
            reader.load(_template(states[1]), step=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _full(step: int) -> torch.Tensor:
    return torch.arange(32.0).reshape(4, 8) + 1000 * step


def _sharded_saves(rank: int, root: str, port: int) -> None:
    """Two ranks: saves of one tensor as a DTensor sharded by rows, replicated, sharded by columns;
    then loads of each into another placement than it was saved with (resharding)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    try:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

        mesh = init_device_mesh("cpu", (2,))
        placements = {1: [Shard(0)], 2: [Replicate()], 3: [Shard(1)]}
        with Checkpointer(root) as ck:
            for step, p in placements.items():
                ck.save(step, {"w": distribute_tensor(_full(step), mesh, p)})
            for step, p in ((1, [Shard(1)]), (2, [Shard(0)]), (3, [Replicate()])):
                out = {"w": distribute_tensor(torch.zeros(4, 8), mesh, p)}
                assert ck.load(out, step=step) == step
                assert torch.equal(out["w"].full_tensor(), _full(step)), f"rank {rank}: step {step} differs"
    finally:
        dist.destroy_process_group()


def test_world_size_and_sharding_changes(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    mp.spawn(_sharded_saves, args=(str(root), _free_port()), nprocs=2, join=True)
    # One rank now (another world size), the same key and shape, as a plain tensor: saved and loaded.
    with Checkpointer(root) as ck:
        ck.save(4, {"w": _full(4)})
        for step in (4, 1, 2, 3, 4):
            out = {"w": torch.zeros(4, 8)}
            assert ck.load(out, step=step) == step
            assert torch.equal(out["w"], _full(step)), f"step {step} differs at world size 1"
