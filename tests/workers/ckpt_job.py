"""A torchrun worker that trains a tiny model deterministically and checkpoints with ckptguard.

Scenarios (argv[1]) exercise one behaviour each; every check is an assert, and a
worker reports with ``emit_result`` (tests/support/results.py), which the tests parse. Training is a pure
function of the step, so any rank can recompute the exact state of any step and
compare a loaded checkpoint bitwise.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys

import torch
import torch.distributed as dist
from torch import nn

import ckptguard
from ckptguard import _faults

from tests.support.results import emit_result  # the repo root is on PYTHONPATH (run_job)


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(4, 16, generator=g)
    loss = model(x).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    for p in model.parameters():  # what DDP's all-reduce would do: identical grads everywhere
        assert p.grad is not None
    optim.step()


def replay(upto: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(upto + 1):
        train_step(model, optim, s)
    return model, optim


def assert_equal_state(a: nn.Module, b: nn.Module) -> None:
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb), f"tensor {ka} differs"


def scenario_saves(args: argparse.Namespace) -> None:
    """Save every step into one root; at the end the newest loads bitwise-equal."""
    ck = ckptguard.Checkpointer(args.root, keep_last=args.keep_last)
    emit_result(topology=[list(d) for d in ck.topology.domains])
    model = make_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = ck.load({"model": model, "optim": optim})
    first = 0 if start is None else start + 1
    if start is not None:
        assert_equal_state(model, replay(start)[0])
    for step in range(first, first + args.count):
        train_step(model, optim, step)
        if args.fault_step == step:
            ck.wait()  # the fault is for this save, not for the previous one still in the background
            _faults.arm(args.fault)
        ck.save(step, {"model": model, "optim": optim, "extra": {"step": step}}, blocking=not args.background)
        emit_result(saved=step)
    ck.wait()
    fresh = make_model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    extra = {"step": -1}
    loaded = ck.load({"model": fresh, "optim": fresh_opt, "extra": extra})
    assert loaded == first + args.count - 1 and extra["step"] == loaded, (loaded, extra)
    assert_equal_state(fresh, model)
    emit_result(loaded=loaded, steps=ck.steps(), resumed_from=start)
    ck.close()


def scenario_resume(args: argparse.Namespace) -> None:
    """After a crash: load the newest committed step, check it bitwise, save once more."""
    ck = ckptguard.Checkpointer(args.root, keep_last=args.keep_last)
    model = make_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = {"step": -1}
    loaded = ck.load({"model": model, "optim": optim, "extra": extra})
    steps_before = ck.steps()
    if loaded is not None:
        assert extra["step"] == loaded
        ref_model, ref_optim = replay(loaded)
        assert_equal_state(model, ref_model)
        for (k, v), (k2, v2) in zip(
            optim.state_dict()["state"].items(), ref_optim.state_dict()["state"].items(), strict=True
        ):
            assert k == k2 and all(torch.equal(v[n], v2[n]) for n in v), "optimizer state differs"
    nxt = (loaded if loaded is not None else -1) + 1
    train_step(model, optim, nxt)
    ck.save(nxt, {"model": model, "optim": optim, "extra": {"step": nxt}})
    emit_result(loaded=loaded, steps_before=steps_before, steps_after=ck.steps())
    ck.close()


def scenario_artifacts(args: argparse.Namespace) -> None:
    """Per-rank files= directories round-trip; with --collide, two ranks name one directory."""
    rank = dist.get_rank()
    base = os.path.join(args.scratch, "offload")
    mine = os.path.join(base, "shared" if args.collide and rank in (1, 2) else f"rank{rank}")
    os.makedirs(os.path.join(mine, "sub"), exist_ok=True)
    with open(os.path.join(mine, "state.bin"), "wb") as f:
        f.write(bytes([rank]) * (1000 + rank))
    with open(os.path.join(mine, "sub", "meta.txt"), "w") as f:
        f.write(f"rank {rank}\n")
    ck = ckptguard.Checkpointer(args.root)
    model = make_model()
    try:
        ck.save(7, {"model": model}, files={"offloaded": mine})
    except ckptguard.CheckpointError as e:
        staging = (
            os.listdir(os.path.join(args.root, ".ckptguard", "staging"))
            if os.path.isdir(os.path.join(args.root, ".ckptguard", "staging"))
            else []
        )
        emit_result(error=str(e), error_rank=e.rank, steps=ck.steps(), staging=staging)
        ck.close()
        return
    dist.barrier()
    shutil.rmtree(mine)
    ck.load({"model": model}, files={"offloaded": mine})
    with open(os.path.join(mine, "state.bin"), "rb") as f:
        assert f.read() == bytes([rank]) * (1000 + rank)
    with open(os.path.join(mine, "sub", "meta.txt")) as f:
        assert f.read() == f"rank {rank}\n"
    emit_result(restored=True, steps=ck.steps())
    ck.close()


def scenario_save_file(args: argparse.Namespace) -> None:
    """Every rank calls save_file(group=True) on one path with its own tensors: one writer, verified load."""
    rank = dist.get_rank()
    path = os.path.join(args.root, "model.pt")
    for i in range(args.count):
        obj = {"rank": rank, "i": i, "w": torch.full((256, 256), float(rank))}
        ckptguard.save_file(obj, path, group=True)  # collective: the leader of each domain writes
        loaded = ckptguard.load_file(path)
        leader = min(r for r in range(dist.get_world_size()) if r in _domain_of(rank, args))
        assert loaded["rank"] == leader and loaded["i"] == i, (loaded["rank"], leader)
        assert torch.equal(loaded["w"], torch.full((256, 256), float(leader)))
    leftovers = [n for n in os.listdir(args.root) if n != "model.pt"]
    emit_result(ok=True, leftovers=leftovers)


def scenario_per_rank(args: argparse.Namespace) -> None:
    """Per-rank values: refused when saved as plain values, round-trip when wrapped in PerRank."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    ck = ckptguard.Checkpointer(args.root)
    try:
        ck.save(1, {"rng": gen.get_state(), "step": 5})
        emit_result(plain_error=None)
    except ckptguard.CheckpointError as e:
        emit_result(plain_error=str(e))
    ck.save(2, {"rng": ckptguard.PerRank(gen.get_state()), "loader": ckptguard.PerRank({"pos": 10 * rank})})
    state = {"rng": ckptguard.PerRank(torch.zeros_like(gen.get_state())), "loader": ckptguard.PerRank({"pos": -1})}
    ck.load(state)
    assert torch.equal(state["rng"].value, gen.get_state()) and state["loader"].value == {"pos": 10 * rank}
    emit_result(per_rank_ok=True, steps=ck.steps())
    ck.close()


def scenario_subgroups(args: argparse.Namespace) -> None:
    """Two gloo subgroups (e.g. two pipeline stages), each with its own Checkpointer and root."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    stage = rank // 2
    ck = ckptguard.Checkpointer(os.path.join(args.root, f"stage{stage}"), process_group=groups[stage])
    state = {"w": torch.full((8,), float(stage))}
    ck.save(1, state)
    out = {"w": torch.zeros(8)}
    ck.load(out)
    assert torch.equal(out["w"], torch.full((8,), float(stage)))
    emit_result(stage=stage, topology=[list(d) for d in ck.topology.domains], world=ck.topology.world_size)
    ck.close()


def _fsdp_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(99)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 40), nn.ReLU(), nn.Linear(40, 8))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    return {"model": msd, "optim": osd}


def scenario_fsdp_save(args: argparse.Namespace) -> None:
    """FSDP2 (DTensor) on CPU: train, save sharded, and write the full state for comparison."""
    model, optim = _fsdp_model()
    for step in range(2):
        g = torch.Generator().manual_seed(step * 100 + dist.get_rank())
        model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    ck = ckptguard.Checkpointer(args.root)
    ck.save(2, {"model": model, "optim": optim})
    full = _full_state(model, optim)
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(args.scratch, "reference.pt"))
    emit_result(saved=2)
    ck.close()


def scenario_fsdp_load(args: argparse.Namespace) -> None:
    """Load the FSDP2 checkpoint at another world size; the full state must equal the reference bitwise."""
    model, optim = _fsdp_model()
    ck = ckptguard.Checkpointer(args.root, read_only=True)
    step = ck.load({"model": model, "optim": optim})
    full = _full_state(model, optim)
    ref = torch.load(os.path.join(args.scratch, "reference.pt"), weights_only=True)
    for k, v in ref["model"].items():
        assert torch.equal(full["model"][k], v), f"model {k} differs after resharding"
    n = 0
    for pk, st in ref["optim"]["state"].items():
        for name, v in st.items():
            assert torch.equal(full["optim"]["state"][pk][name], v), f"optim {pk}.{name} differs"
            n += 1
    emit_result(loaded=step, world=dist.get_world_size(), optim_tensors=n)


def scenario_refused_on_one_rank(args: argparse.Namespace) -> None:
    """Rank 1 passes a value nothing can save: every rank's save raises, nothing is written, and the
    next save, of good values, commits on every rank."""
    rank = dist.get_rank()
    ck = ckptguard.Checkpointer(args.root)
    state: dict[str, object] = {"w": torch.arange(4.0)}
    if rank == 1:
        state["bad"] = object()
    error = ""
    try:
        ck.save(1, state)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    ck.save(2, {"w": torch.arange(4.0)})
    emit_result(error=error, steps=ck.steps())
    ck.close()


def _domain_of(rank: int, args: argparse.Namespace) -> list[int]:
    world = dist.get_world_size()
    if args.private_per_node:
        per = int(os.environ["LOCAL_WORLD_SIZE"])
        node = rank // per
        return list(range(node * per, node * per + per))
    return list(range(world))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("--root", default=os.environ.get("CKPT_ROOT"))
    p.add_argument("--scratch", default=os.environ.get("CKPT_SCRATCH"))
    p.add_argument("--count", type=int, default=3)
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--fault", default="")
    p.add_argument("--fault-step", type=int, default=None)
    p.add_argument("--collide", action="store_true")
    p.add_argument("--private-per-node", action="store_true")
    p.add_argument("--background", action="store_true", help="save with blocking=False")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    globals()[f"scenario_{args.scenario}"](args)
    # Leave together: if the node hosting the rendezvous store exits first, gloo's
    # teardown on the other node aborts (noise that would hide real failures).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
