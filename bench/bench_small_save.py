"""Where a sync save of many small tensors spends its time, against the raw writer: wall and CPU.

Two ranks (gloo, CPU), each with its own ``--count`` float32 tensors of 4 KiB-256 KiB. Every
repetition runs, in rotated order with ``sync`` before each: the raw writer (each rank
os.write()s its tensors into one new file and fsyncs it), and Checkpointer.save with each of
the ``--io-threads`` values. Reported per writer: wall (best and median over ranks' barrier to
barrier), rank 0's CPU time (user + system of the whole process, so the write threads count),
and, for ckptguard, rank 0's median save phases and the part of the write phase spent in the
writer (``GuardedWriter.write_data``; the rest of that phase is DCP's planning).

CPU time is reported because on a loaded machine wall time moves with what else runs: the
machine these figures come from has 2 cores shared with other jobs.

    python bench/bench_small_save.py --count 3000 --reps 6 --io-threads 4 1
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import ckptguard.dcp.writer as ckpt_writer
from bench_checkpoint import WORLD, make_state, raw_write  # the same state and raw writer as the main bench
from ckptguard import Checkpointer


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_rank(rank: int, port: int, work: str, args: argparse.Namespace, queue: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    state = make_state("small", rank, 0, args.count * WORLD)
    writer_seconds: list[float] = []
    real_write_data = ckpt_writer.GuardedWriter.write_data

    def timed_write_data(self: Any, plan: Any, planner: Any) -> Any:
        start = time.perf_counter()
        try:
            return real_write_data(self, plan, planner)
        finally:
            writer_seconds.append(time.perf_counter() - start)

    ckpt_writer.GuardedWriter.write_data = timed_write_data  # type: ignore[method-assign]
    step = [0]

    def raw() -> None:
        raw_write(state, Path(work) / f"raw{step[0]}.r{rank}")
        step[0] += 1

    checkpointers = {
        n: Checkpointer(os.path.join(work, f"ckptguard-{n}"), keep_last=1, io_threads=n) for n in args.io_threads
    }

    def save_with(n: int) -> Callable[[], None]:
        def save() -> None:
            step[0] += 1
            checkpointers[n].save(step[0], state)

        return save

    writers: list[tuple[str, Callable[[], None]]] = [("raw writer", raw)]
    writers += [(f"ckptguard io_threads={n}", save_with(n)) for n in args.io_threads]
    results: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in writers}
    phases: dict[str, list[dict[str, float]]] = {name: [] for name, _ in writers}
    for rep in range(args.reps + 1):  # repetition 0 warms up
        for name, fn in writers[rep % len(writers) :] + writers[: rep % len(writers)]:
            dist.barrier()
            if rank == 0:
                os.sync()
            dist.barrier()
            cpu, start = cpu_seconds(), time.perf_counter()
            fn()
            dist.barrier()
            wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
            if rep:
                results[name].append((wall, cpu))
                if name != "raw writer":
                    n = int(name.rsplit("=", 1)[1])
                    phases[name].append({**checkpointers[n].last_save_stats.seconds, "write_data": writer_seconds[-1]})
            if rank == 0:
                for entry in os.listdir(work):
                    if entry.startswith("raw"):
                        os.unlink(os.path.join(work, entry))
    if rank == 0:
        queue.put((results, phases))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=3000, help="tensors per rank")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--io-threads", type=int, nargs="+", default=[4, 1])
    parser.add_argument("--dir", default=None, help="where to write (default: a new directory under /tmp)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tempfile.mkdtemp(prefix="ckptguard-small-save-", dir=args.dir)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, port, work, args, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results, phases = queue.get()
    for p in procs:
        p.join()
    shutil.rmtree(work, ignore_errors=True)
    raw = results["raw writer"]
    raw_best, raw_med = min(w for w, _ in raw), statistics.median(w for w, _ in raw)
    print(f"{args.count} tensors of 4-256 KiB per rank, {WORLD} ranks, {args.reps} repetitions, rotated")
    print(f"{'writer':26s} {'best s':>7s} {'median s':>9s} {'vs raw':>7s} {'(med)':>6s} {'cpu s r0':>9s}")
    for name, rows in results.items():
        best, med = min(w for w, _ in rows), statistics.median(w for w, _ in rows)
        cpu = statistics.median(c for _, c in rows)
        print(f"{name:26s} {best:7.3f} {med:9.3f} {raw_best / best:7.2f} {raw_med / med:6.2f} {cpu:9.3f}")
        if phases[name]:
            keys = phases[name][0].keys()
            print(
                "    rank 0 phases (median s): "
                + ", ".join(f"{k} {statistics.median(p[k] for p in phases[name]):.3f}" for k in keys)
            )


if __name__ == "__main__":
    main()
