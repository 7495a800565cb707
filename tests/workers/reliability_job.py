"""Worker for tests/crash/test_reliability.py: the scenarios that need real processes.

Runs under torchrun (multi-domain scenarios) or as a plain single-process job
(the lease scenarios: one job = one process, SIGSTOPped by the fault hook).
Every rank prints ``RESULT <json>`` lines that the tests parse.
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


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def result(**kw: object) -> None:
    emit_result(**kw)


def state_of(step: int, version: int = 1) -> dict[str, torch.Tensor]:
    """A state that is a pure function of (step, version): any job can check what it loaded."""
    return {"w": torch.full((64,), float(step * 10 + version)), "v": torch.arange(8) + step * 100 + version}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in b)


def dirs(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step-"))


def scenario_overwrite_crash(args: argparse.Namespace) -> None:
    """Overwrite crash, first job: committed {90, 100}, then save(100, overwrite=True) with a fault armed."""
    ck = ckptguard.Checkpointer(args.root)
    ck.save(90, state_of(90))
    ck.save(100, state_of(100))
    result(steps=ck.steps(), dirs=dirs(args.root))
    _faults.arm(args.fault)
    ck.save(100, state_of(100, 2), overwrite=True)
    result(overwritten=True, dirs=dirs(args.root))
    ck.close()


def scenario_overwrite_resume(args: argparse.Namespace) -> None:
    """Overwrite crash, the restart: step 100 must load (the old version), and the next save cleans up."""
    ck = ckptguard.Checkpointer(args.root)
    steps_at_start = ck.steps()
    out = {"w": torch.zeros(64), "v": torch.zeros(8, dtype=torch.long)}
    loaded = ck.load(out)
    which = next((v for v in (1, 2) if loaded is not None and same(out, state_of(loaded, v))), None)
    ck.save(110, state_of(110))
    ck.wait()
    ck.close()  # waits for the background removal of what the save retired
    result(steps_at_start=steps_at_start, loaded=loaded, version=which, steps_after=ck.steps(), dirs=dirs(args.root))


def scenario_stall_holder(args: argparse.Namespace) -> None:
    """Stalled job, job A: commits, then stalls (SIGSTOP) at the armed phase; resumed after a takeover."""
    ck = ckptguard.Checkpointer(args.root, keep_last=1, lease_ttl_s=args.lease_ttl)
    ck.save(1, state_of(1))
    ck.save(2, state_of(2))
    _faults.arm(args.fault)
    try:
        ck.save(3, state_of(3))
        result(save3="ok")
    except ckptguard.CheckpointError as e:
        result(save3=type(e).__name__, message=str(e))
    try:
        ck.save(4, state_of(4))
        result(save4="ok")
    except ckptguard.CheckpointError as e:
        result(save4=type(e).__name__, message=str(e))
    ck.close()


def scenario_taker(args: argparse.Namespace) -> None:
    """Stalled job, job B: takes the root over from the stalled job, commits, then stalls inside a save."""
    ck = ckptguard.Checkpointer(args.root, keep_last=2, lease_ttl_s=args.lease_ttl, lease_wait_s=60)
    out = {"w": torch.zeros(64), "v": torch.zeros(8, dtype=torch.long)}
    loaded = ck.load(out)
    result(loaded=loaded, steps=ck.steps())
    ck.save(10, state_of(10))
    _faults.arm(args.fault)
    ck.save(11, state_of(11))  # stalls before its publish: an attempt of ours sits in staging
    out = {"w": torch.zeros(64), "v": torch.zeros(8, dtype=torch.long)}
    assert ck.load(out) == 11 and same(out, state_of(11))
    result(saved=11, steps=ck.steps())
    ck.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("--root", default=os.environ.get("CKPT_ROOT"))
    p.add_argument("--fault", default="")
    p.add_argument("--lease-ttl", type=float, default=2.0)
    args = p.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    globals()[f"scenario_{args.scenario}"](args)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
