"""A torchrun worker that checkpoints to an s3:// root (the endpoint comes from AWS_ENDPOINT_URL).

Every rank saves shared tensors and a per-rank tensor, a pure function of (step,
rank), so any process can check what it loaded bitwise. Prints ``RESULT <json>``
lines that tests/storage/test_s3.py parses.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

import ckptguard
from ckptguard import _faults

from tests.support.results import emit_result


def result(**kw: object) -> None:
    emit_result(**kw)


def state_for(step: int, rank: int, elems: int, tag: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(1000 * step + rank + 7919 * tag)
    shared = torch.Generator().manual_seed(step + 7919 * tag)
    return {
        "model": {"w": torch.randn(256, 256, generator=shared), "b": torch.randn(256, generator=shared)},
        "mine": ckptguard.PerRank(torch.randn(elems, generator=g)),
        "step": step,
        "tag": tag,
    }


def empty_state(elems: int) -> dict[str, object]:
    return {
        "model": {"w": torch.zeros(256, 256), "b": torch.zeros(256)},
        "mine": ckptguard.PerRank(torch.zeros(elems)),
        "step": -1,
        "tag": -1,
    }


def check_loaded(out: dict[str, object], step: int, rank: int, elems: int) -> None:
    tag = int(out["tag"])  # type: ignore[call-overload]
    want = state_for(step, rank, elems, tag)
    assert out["step"] == step, (out["step"], step)
    for k in ("w", "b"):
        assert torch.equal(out["model"][k], want["model"][k]), f"model.{k} differs"  # type: ignore[index]
    assert torch.equal(out["mine"].value, want["mine"].value), "per-rank tensor differs"  # type: ignore[attr-defined]


def opts(args: argparse.Namespace) -> dict[str, object]:
    return {"part_size": args.part_size << 20}


def scenario_roundtrip(args: argparse.Namespace) -> None:
    """Save ``count`` steps (resuming after the newest committed one), then load the newest bitwise."""
    rank = dist.get_rank()
    ck = ckptguard.Checkpointer(
        args.root, keep_last=args.keep_last, storage_options=opts(args), lease_ttl_s=args.lease_ttl
    )
    out = empty_state(args.elems)
    start = ck.load(out)
    if start is not None:
        check_loaded(out, start, rank, args.elems)
    first = 0 if start is None else start + 1
    for step in range(first, first + args.count):
        if args.fault_step == step:
            _faults.arm(args.fault)
        ck.save(step, state_for(step, rank, args.elems, args.tag))
        result(saved=step)
    out = empty_state(args.elems)
    loaded = ck.load(out)
    assert loaded == first + args.count - 1, loaded
    check_loaded(out, loaded, rank, args.elems)
    result(loaded=loaded, steps=ck.steps(), resumed_from=start)
    ck.close()


def scenario_stall(args: argparse.Namespace) -> None:
    """Save step 1, then step 2 with rank 0 stopping itself (SIGSTOP) just before its commit."""
    rank = dist.get_rank()
    with open(os.path.join(args.scratch, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    ck = ckptguard.Checkpointer(args.root, storage_options=opts(args), lease_ttl_s=args.lease_ttl)
    ck.save(1, state_for(1, rank, args.elems, args.tag))
    result(saved=1)
    _faults.arm("before_publish:0:stop")
    try:
        ck.save(2, state_for(2, rank, args.elems, args.tag))
        result(saved=2)
    except ckptguard.CheckpointError as e:
        result(error=str(e), error_class=type(e).__name__)
    _faults.arm("")


def scenario_takeover(args: argparse.Namespace) -> None:
    """Take over a root whose holder stalled: load its newest step, save steps 2 and 3 with our tag."""
    rank = dist.get_rank()
    ck = ckptguard.Checkpointer(args.root, storage_options=opts(args), lease_ttl_s=30, lease_wait_s=90)
    out = empty_state(args.elems)
    loaded = ck.load(out)
    if loaded is not None:
        check_loaded(out, loaded, rank, args.elems)
    for step in (2, 3):
        ck.save(step, state_for(step, rank, args.elems, args.tag))
    result(loaded=loaded, steps=ck.steps())
    ck.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("--root", required=True)
    p.add_argument("--scratch", default=os.environ.get("CKPT_SCRATCH", "/tmp"))
    p.add_argument("--count", type=int, default=3)
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--elems", type=int, default=1 << 18)
    p.add_argument("--part-size", type=int, default=5, help="MiB")
    p.add_argument("--lease-ttl", type=float, default=30.0)
    p.add_argument("--tag", type=int, default=0)
    p.add_argument("--fault", default="")
    p.add_argument("--fault-step", type=int, default=None)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=240))
    globals()[f"scenario_{args.scenario}"](args)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
