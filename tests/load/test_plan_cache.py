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

from ckptguard import Checkpointer, TemplateMismatchError, export_checkpoint, load_file


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
    return (
        got["epoch"] == want["epoch"]
        and got["model"].keys() == want["model"].keys()
        and all(t.dtype == want["model"][k].dtype and torch.equal(t, want["model"][k]) for k, t in got["model"].items())
    )


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


def _per_rank_value(rank: int, step: int) -> torch.Tensor:
    """Rank 1's value changes shape at step 2 and rank 0's dtype at step 4; steps 3 and 5 repeat the
    structure of the step before (on every rank: the last local plan taken up again)."""
    n = 5 if rank == 1 and step >= 2 else rank + 1
    value = torch.arange(float(n)) + 100 * step + 10 * rank
    return value.double() if rank == 0 and step >= 4 else value


def _one_rank_changes(rank: int, root: str, port: int) -> None:
    """Two ranks whose structures change one at a time: the rank whose structure stayed the same sends
    no plan (its last one is reused) while the other's new plan must still reach the global plan."""
    from ckptguard import PerRank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    try:
        with Checkpointer(root) as ck:
            for step in range(1, 6):
                ck.save(step, {"w": _full(step), "mine": PerRank(_per_rank_value(rank, step)), "step": step})
            for step in (5, 1, 4, 2, 3):
                want = _per_rank_value(rank, step)
                out = {"w": torch.zeros(4, 8), "mine": PerRank(torch.zeros_like(want)), "step": 0}
                assert ck.load(out, step=step) == step
                got = out["mine"].value
                assert torch.equal(out["w"], _full(step)) and out["step"] == step, f"rank {rank}: step {step} differs"
                assert got.dtype == want.dtype and torch.equal(got, want), f"rank {rank}: step {step}: {got} != {want}"
    finally:
        dist.destroy_process_group()


def test_one_rank_changes_structure_while_the_other_reuses_its_plan(tmp_path: Path) -> None:
    mp.spawn(_one_rank_changes, args=(str(tmp_path / "ckpt"), _free_port()), nprocs=2, join=True)


def test_changes_that_keep_every_name_and_shape(tmp_path: Path) -> None:
    """Between saves of one Checkpointer: a tensor becomes an object and back, the nesting changes with
    the flattened names kept, the order of the keys changes, requires_grad changes: each step is read
    back as it was saved, nesting included."""
    t = torch.arange(6.0)
    states: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {
        1: ({"a": {"b": t + 1}, "c": torch.ones(2)}, {"a": {"b": torch.zeros(6)}, "c": torch.zeros(2)}),
        2: ({"a": {"b": t + 2}, "c": 7}, {"a": {"b": torch.zeros(6)}, "c": 0}),  # tensor -> object
        3: ({"a": {"b": t + 3}, "c": torch.ones(2) * 3}, {"a": {"b": torch.zeros(6)}, "c": torch.zeros(2)}),
        4: ({"a.b": t + 4, "c": torch.ones(2) * 4}, {"a.b": torch.zeros(6), "c": torch.zeros(2)}),  # nesting
        5: ({"c": torch.ones(2) * 5, "a.b": t + 5}, {"c": torch.zeros(2), "a.b": torch.zeros(6)}),  # order
        6: ({"c": torch.ones(2) * 6, "a.b": (t + 6).requires_grad_()}, {"c": torch.zeros(2), "a.b": torch.zeros(6)}),
        7: ({"c": torch.ones(2) * 7, "a.b": (t + 7).requires_grad_()}, {"c": torch.zeros(2), "a.b": torch.zeros(6)}),
    }
    with Checkpointer(tmp_path / "ckpt") as ck:
        for step, (state, _) in states.items():
            ck.save(step, state)
    with Checkpointer(tmp_path / "ckpt", read_only=True) as reader:
        for step, (state, template) in states.items():
            # The nesting is the checkpoint's too (DCP's planner_data): what `export` and `read_checkpoint`
            # rebuild. DCP's plan comparison ignores it, and step 4 came back nested like step 3.
            export_checkpoint(tmp_path / "ckpt", tmp_path / f"step{step}.pt", "torch", step=step)
            nested = load_file(tmp_path / f"step{step}.pt")
            assert list(nested) == list(state) and isinstance(nested.get("a"), dict) == ("a" in state), step
            assert reader.load(template, step=step) == step
            flat_got = {k: v for k, v in _flat(template)}
            flat_want = {k: v for k, v in _flat(state)}
            assert flat_got.keys() == flat_want.keys(), step
            for k, v in flat_want.items():
                assert torch.equal(flat_got[k], v.detach()) if isinstance(v, torch.Tensor) else flat_got[k] == v, (
                    f"step {step}: {k} came back as {flat_got[k]!r}, saved {v!r}"
                )


def _flat(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        out += _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    return out
