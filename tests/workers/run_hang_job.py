"""A job for tests/runner/test_run_hang.py: WORLD ranks train with gloo; at step 2 rank STOP stops in MODE.

    python hang_job.py WORLD STOP MODE [FIFO]

Without RANK in the environment it is its own launcher: it starts WORLD ranks, sends heartbeats
while they import torch (silent seconds that are not a hang) and exits with the worst status.
MODE: user (a loop in user code), dataloader (a dataset item that never comes), fifo (reading a
FIFO nobody writes), collective (a recv nobody sends while the others all_reduce), none (no stop).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def launch(world: int) -> int:
    from ckptguard.runner import heartbeat

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = os.path.join(os.environ["JOB_TMP"], "ready")
    os.makedirs(ready, exist_ok=True)
    procs = [
        subprocess.Popen(
            [sys.executable, *sys.argv],
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": "1",
            },
        )
        for r in range(world)
    ]
    while len(os.listdir(ready)) < world and all(p.poll() is None for p in procs):
        heartbeat()
        time.sleep(0.2)
    return max(p.wait() for p in procs)


def rank_main(stop: int, mode: str, fifo: str | None) -> None:
    import datetime
    import threading

    from ckptguard.runner import heartbeat

    started = threading.Event()

    def beat() -> None:  # importing torch and the rendezvous are slow on a loaded machine, and silent
        while not started.is_set():
            heartbeat()
            time.sleep(0.5)

    threading.Thread(target=beat, daemon=True).start()
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(os.path.join(os.environ["JOB_TMP"], "ready"), exist_ok=True)
    open(os.path.join(os.environ["JOB_TMP"], "ready", str(rank)), "w").close()
    dist.barrier()
    started.set()
    t = torch.ones(4)
    for step in range(int(os.environ.get("JOB_STEPS", "1000"))):
        if step == 2 and rank == stop:
            stop_here(mode, fifo, rank, world, t)
        dist.all_reduce(t)
        t.fill_(1)
        print(f"rank {rank} step {step}", flush=True)
        time.sleep(float(os.environ.get("JOB_STEP_S", "0.05")))
    dist.destroy_process_group()


class Stuck:
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        while True:  # a dataset whose storage never answers
            time.sleep(0.1)


def stop_here(mode: str, fifo: str | None, rank: int, world: int, t: object) -> None:
    if mode == "user":
        while True:
            time.sleep(0.1)
    elif mode == "dataloader":
        from torch.utils.data import DataLoader

        next(iter(DataLoader(Stuck(), batch_size=2)))
    elif mode == "fifo":
        assert fifo is not None
        with open(fifo, "rb") as f:
            f.read()
    elif mode == "collective":
        import torch.distributed as dist

        dist.recv(t, src=(rank + 1) % world)  # type: ignore[arg-type]


if __name__ == "__main__":
    world, stop, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if "RANK" not in os.environ:
        sys.exit(launch(world))
    rank_main(stop, mode, sys.argv[4] if len(sys.argv) > 4 else None)
