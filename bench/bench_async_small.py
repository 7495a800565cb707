"""Sync vs async save of bench_checkpoint.py's small state, without the disk in the way.

Two ranks (gloo) each save ``--count`` float32 tensors of 4 KiB-256 KiB (10,000: 1.33 GB per rank, the
small state of ``bench_checkpoint.py --small-count 20000``), with a sync and an async Checkpointer in turn,
on ``--dir`` (tmpfs such as /dev/shm takes the disk's noise out; retention keeps one step of each). Prints
the medians and their ratio (the async target is ≤ 1.15× on CPU), the time ``save(blocking=False)``
blocked, and every repetition.

    python bench/bench_async_small.py --dir /dev/shm/ckptguard-async --count 10000 --reps 8
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from ckptguard import Checkpointer

WORLD = 2


def make_state(rank: int, count: int) -> dict[str, Any]:
    """This rank's tensors, as bench_checkpoint.py's small state makes them."""
    g = torch.Generator().manual_seed(rank)
    sizes = torch.randint(1024, 65536 + 1, (count,), generator=g)
    return {"model": {f"r{rank}.p{i}": torch.rand(int(s), generator=g) for i, s in enumerate(sizes)}}


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    state = make_state(rank, args.count)
    sync = Checkpointer(os.path.join(args.dir, "sync"), keep_last=1)
    background = Checkpointer(os.path.join(args.dir, "async"), keep_last=1)
    times: dict[str, list[float]] = {"sync": [], "async": [], "blocked": []}
    for rep in range(args.reps + 1):  # repetition 0 warms up (first touch of the buffers): not counted
        for name in ("sync", "async") if rep % 2 else ("async", "sync"):
            dist.barrier()
            start = time.perf_counter()
            if name == "sync":
                sync.save(rep, state)
            else:
                background.save(rep, state, blocking=False)
                blocked = time.perf_counter() - start
                background.wait()
            took = time.perf_counter() - start
            dist.barrier()
            if rep:
                times[name].append(took)
                if name == "async":
                    times["blocked"].append(blocked)
    if rank == 0:
        s, a = statistics.median(times["sync"]), statistics.median(times["async"])
        print(
            f"{args.count} tensors per rank, medians of {args.reps}: sync {s:.3f} s, async total {a:.3f} s "
            f"({a / s:.2f}x sync), save() blocked {statistics.median(times['blocked']):.3f} s"
        )
        for name in ("sync", "async"):
            print(f"  {name:5}: " + " ".join(f"{t:.2f}" for t in times[name]))
    sync.close()
    background.close()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/dev/shm/ckptguard-async")
    p.add_argument("--count", type=int, default=10_000, help="tensors per rank")
    p.add_argument("--reps", type=int, default=8)
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(worker, args=(port, args), nprocs=WORLD)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
