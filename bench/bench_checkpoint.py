"""Save and load throughput: ckptguard against dcp.save/dcp.load, gather + torch.save, and the disk's limit.

One command, one table, one JSON file. Two ranks (gloo, CPU) each hold half of
the state. Two states: "large" (few big float32 tensors, ~2 GiB in all) and
"small" (20,000 tensors of 4 KiB-256 KiB). Every repetition runs the writers in
rotated order, with `sync` before each; figures are medians. Cold loads drop the
page cache first (needs root; otherwise they are reported as warm).

Reference writers:
- raw writer: each rank os.write()s its tensors' bytes to one file and fsyncs it (the physical limit
  for these bytes through the page cache);
- raw reader: each rank reads those files into preallocated tensors;
- dd: `dd if=/dev/zero bs=64M conv=fdatasync` of the same total size, from one process;
- dcp: `dcp.save`/`dcp.load` with the default FileSystemWriter/FileSystemReader;
- torch.save: gather every rank's state on rank 0, torch.save, fsync.

    python bench/bench_checkpoint.py                      # full run (takes several minutes)
    python bench/bench_checkpoint.py --quick              # small sizes, 2 repetitions, smoke test
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from ckptguard import Checkpointer
from ckptguard.storage.posix import write_all

WORLD = 2


def make_state(kind: str, rank: int, total_bytes: int, small_count: int) -> dict[str, torch.Tensor]:
    """This rank's half of the state, under per-rank names (each rank writes its own tensors)."""
    g = torch.Generator().manual_seed(rank)
    if kind == "large":
        per_rank = total_bytes // WORLD
        n = 8
        numel = per_rank // 4 // n
        return {f"r{rank}.t{i}": torch.rand(numel, generator=g) for i in range(n)}
    sizes = torch.randint(1024, 65536 + 1, (small_count // WORLD,), generator=g)  # float32: 4 KiB-256 KiB
    return {f"r{rank}.p{i}": torch.rand(int(s), generator=g) for i, s in enumerate(sizes)}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def drop_caches() -> bool:
    subprocess.run(["sync"], check=False)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# -- writers and readers: each returns after its bytes are durable ------------------------------


def raw_write(state: dict[str, torch.Tensor], path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in state.values():
            write_all(fd, memoryview(t.numpy()).cast("B"))
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(state: dict[str, torch.Tensor], path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        for t in state.values():
            view = memoryview(t.numpy()).cast("B")
            got = 0
            while got < len(view):
                n = os.preadv(fd, [view[got:]], offset + got)
                assert n > 0
                got += n
            offset += len(view)
    finally:
        os.close(fd)


def gather_torch_save(state: dict[str, torch.Tensor], path: Path, rank: int) -> None:
    out: list[Any] = [None] * WORLD if rank == 0 else None  # type: ignore[assignment]
    dist.gather_object(state, out, dst=0)
    if rank == 0:
        merged = {k: v for part in out for k, v in part.items()}
        with open(path, "wb") as f:
            torch.save(merged, f)
            f.flush()
            os.fsync(f.fileno())


def dd(path: Path, total: int) -> None:
    count = max(1, total // (64 << 20))
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}", "conv=fdatasync"],
                   check=True, capture_output=True)


def ck_load(ck: Checkpointer, dest: dict[str, torch.Tensor], step: int) -> None:
    ck.load(dest, step=step)


# -- the benchmark, run on every rank --------------------------------------------------------------


def timed(fn: Callable[[], None], rank: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def clean(path: Path, rank: int) -> None:
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    dist.barrier()


def bench_state(kind: str, rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """All writers and readers on one state; returns the timings (on every rank)."""
    state = make_state(kind, rank, int(args.size_gib * (1 << 30)), args.small_count)
    total = nbytes(state) * WORLD
    work = Path(args.dir) / kind
    clean(work, rank)
    ck = Checkpointer(work / "ckptguard")
    writers: dict[str, Callable[[int], None]] = {
        "ckptguard": lambda i: ck.save(i, state),
        "dcp.save": lambda i: dcp.save(state, checkpoint_id=str(work / f"dcp{i}")),
        "raw writer": lambda i: raw_write(state, work / f"raw{i}.r{rank}"),
    }
    if not args.no_torch_save:
        writers["gather+torch.save"] = lambda i: gather_torch_save(state, work / f"torch{i}.pt", rank)
    writers["dd"] = lambda i: dd(work / f"dd{i}", total) if rank == 0 else None
    times: dict[str, list[float]] = {w: [] for w in writers}
    order = list(writers)
    for rep in range(args.reps):
        for name in order[rep % len(order):] + order[: rep % len(order)]:
            if rank == 0:
                subprocess.run(["sync"], check=False)
            times[name].append(timed(lambda n=name, r=rep: writers[n](r), rank))
            gc.collect()
        if rep < args.reps - 1:  # keep only the last repetition's files, for the loads
            dist.barrier()
            if rank == 0:
                for name in (f"dcp{rep}", f"raw{rep}.r0", f"raw{rep}.r1", f"torch{rep}.pt", f"dd{rep}",
                             f"ckptguard/step-{rep:08d}"):
                    path = work / name
                    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            dist.barrier()
    dest = {k: torch.empty_like(v) for k, v in state.items()}  # loads go into preallocated tensors
    last = args.reps - 1
    readers: dict[str, Callable[[], None]] = {
        "ckptguard": lambda: ck_load(ck, dest, last),
        "dcp.load": lambda: dcp.load(dest, checkpoint_id=str(work / f"dcp{last}")),
        "raw reader": lambda: raw_read(dest, work / f"raw{last}.r{rank}"),
    }
    load_times: dict[str, list[float]] = {r: [] for r in readers}
    cold = True
    names = list(readers)
    for rep in range(args.load_reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            dist.barrier()
            if rank == 0:
                cold = drop_caches() and cold
            load_times[name].append(timed(readers[name], rank))
    for k in state:
        assert torch.equal(dest[k], state[k]), f"{kind}: {k} differs after load"
    ck.close()
    clean(work, rank)
    return {"bytes": total, "tensors": len(state) * WORLD, "save": times, "load": load_times, "cold": cold}


def worker(rank: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=30))
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for kind in args.states:
        results[kind] = bench_state(kind, rank, args)
        gc.collect()
    if rank == 0:
        results["cold_loads"] = all(results[k]["cold"] for k in args.states)
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def render(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    lines = []
    for kind in args.states:
        r = results[kind]
        gb = r["bytes"] / 1e9
        med = {w: statistics.median(v) for w, v in r["save"].items()}
        lmed = {w: statistics.median(v) for w, v in r["load"].items()}
        lines.append(f"\nstate {kind!r}: {r['tensors']} tensors, {gb:.2f} GB over {WORLD} ranks "
                     f"(saves: median of {args.reps}; loads: median of {args.load_reps}, "
                     f"{'cold' if results['cold_loads'] else 'WARM: page cache not dropped'})")
        lines.append(f"  {'save':<20} {'seconds':>8} {'GB/s':>7} {'vs raw':>7} {'vs dcp':>7}")
        for w, t in med.items():
            lines.append(f"  {w:<20} {t:8.3f} {gb / t:7.2f} {med['raw writer'] / t:7.2f} {med['dcp.save'] / t:7.2f}")
        lines.append(f"  {'load':<20} {'seconds':>8} {'GB/s':>7} {'vs raw':>7} {'vs dcp':>7}")
        for w, t in lmed.items():
            lines.append(f"  {w:<20} {t:8.3f} {gb / t:7.2f} {lmed['raw reader'] / t:7.2f} {lmed['dcp.load'] / t:7.2f}")
        summary[kind] = {"bytes": r["bytes"], "save_s": med, "load_s": lmed,
                         "save_vs_raw": med["raw writer"] / med["ckptguard"],
                         "save_vs_dcp": med["dcp.save"] / med["ckptguard"],
                         "load_vs_raw": lmed["raw reader"] / lmed["ckptguard"],
                         "load_vs_dcp": lmed["dcp.load"] / lmed["ckptguard"], "raw": r}
    print("\n".join(lines))
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/ckptguard-bench")
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--small-count", type=int, default=20_000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--load-reps", type=int, default=3)
    p.add_argument("--states", nargs="+", default=["large", "small"], choices=["large", "small"])
    p.add_argument("--no-torch-save", action="store_true", help="skip gather + torch.save (slow)")
    p.add_argument("--quick", action="store_true", help="0.25 GiB, 2,000 small tensors, 2 repetitions")
    p.add_argument("--json", default=None, help="where to write the JSON result (default bench/results/)")
    args = p.parse_args()
    if args.quick:
        args.size_gib, args.small_count, args.reps, args.load_reps = 0.25, 2000, 2, 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(args.dir) / "result.json"
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"dir {args.dir}")
    mp.spawn(worker, args=(port, args, str(out)), nprocs=WORLD, join=True)
    results = json.loads(out.read_text())
    summary = render(results, args)
    dest = Path(args.json) if args.json else Path(__file__).parent / "results" / (
        f"checkpoint-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"args": vars(args), "summary": summary}, indent=1, default=str))
    print(f"\nJSON result: {dest}")


if __name__ == "__main__":
    main()
