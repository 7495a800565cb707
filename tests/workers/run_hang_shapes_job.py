"""A job for tests/runner/test_run_hang_shapes.py: two gloo ranks; rank 1 stops in user code.

    python run_hang_shapes_job.py MODE [ROOT]

MODE async: ranks with RANK in the environment; rank 0 saves with ``blocking=False`` and waits in
``close()`` while the save's thread waits for rank 1 in ckptguard's protocol (a collective).
MODE fork: no RANK in the environment; the ranks are forked by ``torch.multiprocessing`` and
learn their rank from ``init_process_group``; rank 0 waits in all_reduce.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta


def stuck_in_eval() -> None:
    while True:
        time.sleep(0.2)


def async_save(root: str) -> None:
    import torch
    import torch.distributed as dist

    from ckptguard import Checkpointer

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    ck = Checkpointer(root)
    state = {"model": torch.nn.Linear(2, 2)}
    ck.save(1, state)
    print(f"rank {dist.get_rank()} saved 1", flush=True)
    if dist.get_rank() == 1:
        stuck_in_eval()
    ck.save(2, state, blocking=False)
    ck.close()


def forked_rank(rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    t = torch.ones(2)
    dist.all_reduce(t)
    print(f"rank {rank} ready", flush=True)
    if rank == 1:
        stuck_in_eval()
    dist.all_reduce(t)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if sys.argv[1] == "async":
        async_save(sys.argv[2])
    else:
        import torch.multiprocessing as mp

        mp.start_processes(forked_rank, args=(2, int(os.environ["MASTER_PORT"])), nprocs=2, start_method="fork")
