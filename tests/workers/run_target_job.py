"""A torchrun worker for `ckptguard run` tests: saves a checkpoint per step, and fails as asked.

``--fail raise|kill|hang`` makes rank ``--fail-rank`` raise (its data loader's ``state_dict``
fails), SIGKILL itself, or hang inside the save of step ``--fail-step``; the other ranks then fail
as collateral (PeerError, or the launcher's SIGTERM). ``--fail none`` finishes. The entry point is
decorated with torchrun's ``@record``, so the agent keeps the failing worker's error file.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import ckptguard
from ckptguard import PerRank, _faults

ACTIONS = {"kill": "kill", "hang": "sleep"}


class Loader:
    """Data-loader position, saved with the model; ``broken`` makes its state_dict raise."""

    def __init__(self) -> None:
        self.position = 0
        self.broken = False

    def state_dict(self) -> dict[str, int]:
        if self.broken:
            raise RuntimeError(f"sampler state of rank {dist.get_rank()} is inconsistent: position {self.position}")
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


@record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fail", choices=["none", "raise", *ACTIONS], default="none")
    p.add_argument("--fail-rank", type=int, default=3)
    p.add_argument("--fail-step", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ck = ckptguard.Checkpointer(args.root, collective_timeout_s=args.timeout)
    loader = Loader()
    for step in range(1, args.steps + 1):
        loader.position = step * 10
        if step == args.fail_step and args.fail != "none" and rank == args.fail_rank:
            if args.fail == "raise":
                loader.broken = True
            else:
                _faults.arm(f"before_write:{rank}:{ACTIONS[args.fail]}")
        ck.save(step, {"w": torch.full((64,), float(step)), "loader": PerRank(loader)})
        print(f"rank {rank} saved step {step} on {os.uname().nodename}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
