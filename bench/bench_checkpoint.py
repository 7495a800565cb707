"""Save and load throughput of ckptguard against DCP, torch.save and the disk's limits; async saves; memory.

One command, one table, one JSON file. Two ranks (gloo, CPU) each hold half of
the state, nested as {"model": {name: tensor}} like a real state dict. Two states:
"large" (16 float32 tensors, 2 GiB in all) and "small" (20,000 tensors of 4 KiB-256
KiB). Every repetition runs the writers in rotated order with `sync` before
each; figures are medians and best-of. Loads go into preallocated tensors, cold: the bench's
files are evicted from the page cache before each (posix_fadvise DONTNEED; --drop-caches drops
the whole page cache instead, as root). A ckptguard load uses a fresh read-only Checkpointer, as
a restarted job does. Peak resident memory above the state is reported for saves and loads.

Each writer's files are deleted (and synced) right after it ran, outside the timing; a first
repetition warms up (page faults, first files) and is not counted.

Writers and readers, all on the same bytes:
- ckptguard               Checkpointer.save (sync) / Checkpointer.load
- ckptguard no checksum   the same save with the checksum function replaced by a no-op
- ckptguard async         save(blocking=False) + wait(): total time to committed; the time save()
                          blocked is reported separately
- host copy               one copy of the state into preallocated host memory (what async must cost)
- dcp.save / dcp.load     default FileSystemWriter / FileSystemReader
- raw writer / reader     each rank os.write()s its tensors to one file and fsyncs / preadv()s them back
- raw two-pass            the raw reader made all-or-nothing as ckptguard's default load is, and nothing
                          more: every tensor read and hashed, then read again from the page cache into
                          place and hashed again (the floor of that design)
- gather+torch.save       gather every rank's state on rank 0, torch.save, fsync (run after the
                          others, --torch-save-reps times: it fills rank 0's memory)
- dd                      `dd if=/dev/zero bs=64M conv=fdatasync` of the same total size, one process
Finally, resident memory of each rank over --rss-saves async saves of a 256 MiB state.

    python bench/bench_checkpoint.py                      # everything (about 15 minutes here)
    python bench/bench_checkpoint.py --quick              # small sizes, 2 repetitions: a smoke test
    python bench/bench_checkpoint.py --load-modes         # only what a load costs, per load mode:
        raw reader, ckptguard (the default load_memory_bytes), ckptguard staged (everything verified
        in host memory, then copied into place), ckptguard two-pass (load_memory_bytes=0: verified
        in a first pass, read into place in a second), cold and warm
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import ckptguard.dcp.planners as ckpt_planners
import ckptguard.dcp.writer as ckpt_writer
from ckptguard import Checkpointer
from ckptguard.storage.fileio import write_all

WORLD = 2


def make_state(kind: str, rank: int, total_bytes: int, small_count: int) -> dict[str, Any]:
    """This rank's half of the state, under per-rank names (each rank writes its own tensors)."""
    g = torch.Generator().manual_seed(rank)
    if kind == "large":
        n = 8
        numel = total_bytes // WORLD // 4 // n
        tensors = {f"r{rank}.t{i}": torch.rand(numel, generator=g) for i in range(n)}
    else:
        sizes = torch.randint(1024, 65536 + 1, (small_count // WORLD,), generator=g)  # float32: 4 KiB-256 KiB
        tensors = {f"r{rank}.p{i}": torch.rand(int(s), generator=g) for i, s in enumerate(sizes)}
    return {"model": tensors}


def nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def evict(work: Path, everything: bool) -> bool:
    """Make the next read cold: the files under ``work`` are written back and dropped from the page
    cache (posix_fadvise DONTNEED, file by file: other users' caches are left alone). With
    ``everything`` (--drop-caches, root only) the whole page cache is dropped instead."""
    subprocess.run(["sync"], check=False)
    if everything:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return True
        except OSError:
            return False
    for dirpath, _, names in os.walk(work):
        for n in names:
            try:
                fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def reset_peak() -> int:
    """Reset this process's peak resident set (Linux: clear_refs 5) and return the resident set now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
    except OSError:
        pass
    return rss_bytes()


def peak_rss() -> int:
    """This process's peak resident set since the last reset_peak() (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


# -- reference writers and readers: each returns after its bytes are durable ---------------------


def raw_write(state: dict[str, Any], path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in state["model"].values():
            write_all(fd, [memoryview(t.numpy()).cast("B")])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(state: dict[str, Any], path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        for t in state["model"].values():
            view = memoryview(t.numpy()).cast("B")
            got = 0
            while got < len(view):
                n = os.preadv(fd, [view[got:]], offset + got)
                assert n > 0
                got += n
            offset += len(view)
    finally:
        os.close(fd)


def raw_read_twice(state: dict[str, Any], path: Path) -> None:
    """The raw reader made all-or-nothing the way ckptguard's default load is, with nothing else: each
    tensor read into one reused scratch buffer and hashed (xxh3-64), then, all verified, read again
    from the page cache into place and hashed again. The floor of a checksummed all-or-nothing load
    that holds no second copy of the state."""
    sizes = [t.numel() * t.element_size() for t in state["model"].values()]
    scratch = memoryview(bytearray(max(sizes, default=0)))
    fd = os.open(path, os.O_RDONLY)
    try:
        digests = []
        offset = 0
        for size in sizes:
            got = 0
            while got < size:
                n = os.preadv(fd, [scratch[got:size]], offset + got)
                assert n > 0
                got += n
            digests.append(xxhash.xxh3_64_intdigest(scratch[:size]))
            offset += size
        raw_read(state, path)
        for t, digest in zip(state["model"].values(), digests, strict=True):
            assert xxhash.xxh3_64_intdigest(memoryview(t.numpy()).cast("B")) == digest
    finally:
        os.close(fd)


def host_copy(state: dict[str, Any], dest: dict[str, Any]) -> None:
    for k, t in state["model"].items():
        dest["model"][k].copy_(t)


def gather_torch_save(state: dict[str, Any], path: Path, rank: int) -> None:
    out: list[Any] | None = [None] * WORLD if rank == 0 else None
    dist.gather_object(state, out, dst=0)
    if rank == 0:
        assert out is not None
        merged = {k: v for part in out for k, v in part["model"].items()}
        with open(path, "wb") as f:
            torch.save(merged, f)
            f.flush()
            os.fsync(f.fileno())


def dd(path: Path, total: int) -> None:
    count = max(1, total // (64 << 20))
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}", "conv=fdatasync"],
        check=True,
        capture_output=True,
    )


@contextmanager
def checksums_off() -> Iterator[None]:
    """The same save with the checksum replaced by a constant: what checksumming costs.

    Both places a save checksums: the writer (every item) and the planner (replicated values).
    """
    modules = (ckpt_writer, ckpt_planners)
    real = [m.checksum for m in modules]
    for m in modules:
        m.checksum = lambda algorithm, data: "0" * 16  # type: ignore[assignment]
    try:
        yield
    finally:
        for m, fn in zip(modules, real, strict=True):
            m.checksum = fn  # type: ignore[assignment]


# -- the benchmark, run on every rank ------------------------------------------------------------


def timed(fn: Callable[[], None], peaks: list[int] | None = None) -> float:
    """Seconds of ``fn`` on all ranks; with ``peaks``, also this rank's peak resident set above what
    was resident before (the state and the caller's template are resident before)."""
    dist.barrier()
    before = reset_peak() if peaks is not None else 0
    start = time.perf_counter()
    fn()
    dist.barrier()
    seconds = time.perf_counter() - start
    if peaks is not None:
        peaks.append(max(0, peak_rss() - before))
    return seconds


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
    ck_plain = Checkpointer(work / "ckptguard-nosum")
    ck_async = Checkpointer(work / "ckptguard-async")
    copy_dest = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    blocked: list[float] = []

    def save_nosum(i: int) -> None:
        with checksums_off():
            ck_plain.save(i, state)

    def save_async(i: int) -> None:
        start = time.perf_counter()
        ck_async.save(i, state, blocking=False)
        blocked.append(time.perf_counter() - start)
        ck_async.wait()

    writers: dict[str, Callable[[int], None]] = {
        "ckptguard": lambda i: ck.save(i, state),
        "ckptguard no checksum": save_nosum,
        "ckptguard async": save_async,
        "dcp.save": lambda i: dcp.save(state, checkpoint_id=str(work / f"dcp{i}")),
        "raw writer": lambda i: raw_write(state, work / f"raw{i}.r{rank}"),
        "host copy": lambda i: host_copy(state, copy_dest),
    }
    writers["dd"] = lambda i: dd(work / f"dd{i}", total) if rank == 0 else None
    outputs = {  # what each writer leaves on disk at repetition i
        "ckptguard": lambda i: [f"ckptguard/step-{i:08d}"],
        "ckptguard no checksum": lambda i: [f"ckptguard-nosum/step-{i:08d}"],
        "ckptguard async": lambda i: [f"ckptguard-async/step-{i:08d}"],
        "dcp.save": lambda i: [f"dcp{i}"],
        "raw writer": lambda i: [f"raw{i}.r0", f"raw{i}.r1"],
        "host copy": lambda i: [],
        "gather+torch.save": lambda i: [f"torch{i}.pt"],
        "dd": lambda i: [f"dd{i}"],
    }
    times: dict[str, list[float]] = {w: [] for w in writers}
    save_peaks: dict[str, list[int]] = {w: [] for w in ("ckptguard", "dcp.save", "raw writer")}
    save_phases: list[dict[str, float]] = []  # this rank's Checkpointer.last_save_stats, per repetition
    order = list(writers)
    last = args.reps  # repetition 0 is a warm-up (first touch of memory, first files): not counted
    for rep in range(args.reps + 1):
        for name in order[rep % len(order) :] + order[: rep % len(order)]:
            if rank == 0:
                subprocess.run(["sync"], check=False)
            seconds = timed(lambda n=name, r=rep: writers[n](r), save_peaks.get(name) if rep else None)
            if rep:
                times[name].append(seconds)
                if name == "ckptguard":
                    save_phases.append(dict(ck.last_save_stats.seconds))
            gc.collect()
            if rep < last:  # free the disk now (only the last repetition's files are kept for the loads)
                dist.barrier()
                if rank == 0:
                    for out in outputs[name](rep):
                        path = work / out
                        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
                    subprocess.run(["sync"], check=False)
                dist.barrier()
    copy_dest.clear()  # free it before the loads
    # The caller's template, touched once: a fresh large tensor is an untouched mapping whose pages the
    # first reader would fault in, counted as that reader's memory (one rank's whole state).
    dest = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}

    def fresh_load() -> None:  # a restarted job: a new Checkpointer, then load
        with Checkpointer(work / "ckptguard", read_only=True) as fresh:
            fresh.load(dest, step=last)
            load_phases.append(dict(fresh.last_load_stats.seconds))

    readers: dict[str, Callable[[], None]] = {
        "ckptguard": fresh_load,
        "dcp.load": lambda: dcp.load(dest, checkpoint_id=str(work / f"dcp{last}")),
        "raw reader": lambda: raw_read(dest, work / f"raw{last}.r{rank}"),
        "raw two-pass": lambda: raw_read_twice(dest, work / f"raw{last}.r{rank}"),
    }
    load_times: dict[str, list[float]] = {r: [] for r in readers}
    load_peaks: dict[str, list[int]] = {r: [] for r in readers}
    load_phases: list[dict[str, float]] = []
    cold = True
    names = list(readers)
    for rep in range(args.load_reps + 1):  # repetition 0 warms up (first touch of dest), not counted
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            dist.barrier()
            if rank == 0:
                cold = evict(work, args.drop_caches) and cold
            dist.barrier()
            seconds = timed(readers[name], load_peaks[name])
            if rep:
                load_times[name].append(seconds)
            elif name == "ckptguard":
                load_phases.pop()
    for k in state["model"]:
        assert torch.equal(dest["model"][k], state["model"][k]), f"{kind}: {k} differs after load"
    # gather + torch.save last: it pickles every rank's state into rank 0's memory, which would
    # squeeze the page cache under the writers measured after it.
    dest.clear()
    if not args.no_torch_save:
        times["gather+torch.save"] = []
        for rep in range(args.torch_save_reps):
            if rank == 0:
                subprocess.run(["sync"], check=False)
            times["gather+torch.save"].append(
                timed(lambda r=rep: gather_torch_save(state, work / f"torch{r}.pt", rank))
            )
            gc.collect()
            dist.barrier()
            if rank == 0:
                (work / f"torch{rep}.pt").unlink(missing_ok=True)
            dist.barrier()
    all_blocked: list[Any] = [None] * WORLD
    dist.all_gather_object(all_blocked, blocked)
    all_peaks: list[Any] = [None] * WORLD
    dist.all_gather_object(all_peaks, {"save": save_peaks, "load": load_peaks})
    for c in (ck, ck_plain, ck_async):
        c.close()
    clean(work, rank)
    return {
        "bytes": total,
        "tensors": len(state["model"]) * WORLD,
        "save": times,
        "load": load_times,
        "cold": cold,
        "async_blocked": [max(b) for b in zip(*all_blocked, strict=True)],
        "phases_rank0": {"save": save_phases, "load": load_phases},
        "rank_bytes": nbytes(state),
        "peak_rss_above": {
            op: {w: max(max(p[op][w] or [0]) for p in all_peaks) for w in all_peaks[0][op]} for op in ("save", "load")
        },
    }


def bench_load_modes(kind: str, rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """What a load costs in each mode, against the raw reader, on one saved state (cold and warm)."""
    state = make_state(kind, rank, int(args.size_gib * (1 << 30)), args.small_count)
    work = Path(args.dir) / f"loads-{kind}"
    clean(work, rank)
    ck = Checkpointer(work / "ckptguard")
    ck.save(1, state)
    raw_write(state, work / f"raw.r{rank}")
    dist.barrier()

    def fresh_load(cap: int | None) -> None:  # a restarted job: a new Checkpointer, then load
        with Checkpointer(work / "ckptguard", read_only=True, load_memory_bytes=cap) as c:
            c.load(dest, step=1)

    readers: dict[str, Callable[[], None]] = {
        "raw reader": lambda: raw_read(dest, work / f"raw.r{rank}"),
        "raw two-pass": lambda: raw_read_twice(dest, work / f"raw.r{rank}"),
        "ckptguard": lambda: fresh_load(None),
        "ckptguard staged": lambda: fresh_load(1 << 40),
        "ckptguard two-pass": lambda: fresh_load(0),
    }
    dest = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    out: dict[str, dict[str, list[float]]] = {"cold": {r: [] for r in readers}, "warm": {r: [] for r in readers}}
    cold = True
    names = list(readers)
    for rep in range(args.load_reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            dist.barrier()
            if rank == 0:
                cold = evict(work, args.drop_caches) and cold
            dist.barrier()
            out["cold"][name].append(timed(readers[name]))
            out["warm"][name].append(timed(readers[name]))
            for k in state["model"]:
                assert torch.equal(dest["model"][k], state["model"][k]), f"{name}: {k} differs after load"
                dest["model"][k].zero_()
    ck.close()
    clean(work, rank)
    return {"bytes": nbytes(state) * WORLD, "tensors": len(state["model"]) * WORLD, "loads": out, "cold": cold}


def bench_rss(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """Resident memory over many async saves of one state (a leak per save would show)."""
    state = make_state("small", rank, 0, 2000)  # 2,000 tensors, about 256 MiB in all
    work = Path(args.dir) / "rss"
    clean(work, rank)
    ck = Checkpointer(work / "ckptguard", keep_last=1)
    samples = []
    for i in range(args.rss_saves):
        ck.save(i, state, blocking=False)
        ck.wait()
        if i in (0, 9) or i == args.rss_saves - 1:
            gc.collect()
            samples.append((i + 1, rss_bytes()))
    ck.close()
    clean(work, rank)
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, samples)
    return {"bytes": nbytes(state) * WORLD, "samples": gathered}


def worker(rank: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=30))
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    if args.load_modes:
        for kind in args.states:
            results[kind] = bench_load_modes(kind, rank, args)
            gc.collect()
        if rank == 0:
            Path(out_path).write_text(json.dumps(results))
        dist.barrier()
        dist.destroy_process_group()
        return
    for kind in args.states:
        results[kind] = bench_state(kind, rank, args)
        gc.collect()
    if args.rss_saves:
        results["rss"] = bench_rss(rank, args)
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
        blocked = statistics.median(r["async_blocked"])
        lines.append(
            f"\nstate {kind!r}: {r['tensors']} tensors, {gb:.2f} GB over {WORLD} ranks "
            f"(saves: median of {args.reps}; loads: median of {args.load_reps}, "
            f"{'cold' if results['cold_loads'] else 'WARM: page cache not dropped'})"
        )
        lines.append(f"  {'save':<24} {'seconds':>8} {'GB/s':>7} {'vs raw':>7} {'vs dcp':>7}")
        for w, t in med.items():
            lines.append(f"  {w:<24} {t:8.3f} {gb / t:7.2f} {med['raw writer'] / t:7.2f} {med['dcp.save'] / t:7.2f}")
        lines.append(f"  {'async save() blocked':<24} {blocked:8.3f} {gb / blocked:7.2f}")
        lines.append(f"  {'load':<24} {'seconds':>8} {'GB/s':>7} {'vs raw':>7} {'vs dcp':>7}")
        for w, t in lmed.items():
            lines.append(f"  {w:<24} {t:8.3f} {gb / t:7.2f} {lmed['raw reader'] / t:7.2f} {lmed['dcp.load'] / t:7.2f}")
        best = {w: min(v) for w, v in r["save"].items()}
        lbest = {w: min(v) for w, v in r["load"].items()}
        lines.append(
            "  best of each (the disk at its quietest): "
            + "; ".join(
                [
                    f"save vs raw {best['raw writer'] / best['ckptguard']:.2f}x",
                    f"save vs dcp {best['dcp.save'] / best['ckptguard']:.2f}x",
                    f"load vs raw {lbest['raw reader'] / lbest['ckptguard']:.2f}x",
                    f"load vs dcp {lbest['dcp.load'] / lbest['ckptguard']:.2f}x",
                ]
            )
        )
        if "peak_rss_above" in r:
            state_mb = r["rank_bytes"] / 1e6
            for op, peaks in r["peak_rss_above"].items():
                lines.append(
                    f"  peak resident set above the state during {op} (max over ranks and reps; state "
                    f"{state_mb:.0f} MB per rank): "
                    + "; ".join(f"{w} {v / 1e6:.0f} MB ({v / r['rank_bytes']:.1%})" for w, v in peaks.items())
                )
        for op, runs in r.get("phases_rank0", {}).items():
            if runs:
                phases = {k: statistics.median(x.get(k, 0.0) for x in runs) for k in runs[0]}
                lines.append(
                    f"  ckptguard {op} phases on rank 0 (median s): "
                    + ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
                )
        # The disk's speed drifts over minutes: a ratio of the two readers' times in the same repetition
        # (run back to back) is steadier than the ratio of their medians. Median and range over repetitions.
        paired = {
            ref: sorted(a / b for a, b in zip(r["load"][ref], r["load"]["ckptguard"], strict=True))
            for ref in ("raw two-pass", "raw reader")
        }
        for ref, ratios in paired.items():
            lines.append(
                f"  paired per repetition: cold load vs {ref} {statistics.median(ratios):.2f}x "
                f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}x over {len(ratios)})"
            )
        figures = {
            "sync save vs raw writer": med["raw writer"] / med["ckptguard"],
            "sync save vs dcp.save": med["dcp.save"] / med["ckptguard"],
            "cold load vs raw reader": lmed["raw reader"] / lmed["ckptguard"],
            "cold load vs dcp.load": lmed["dcp.load"] / lmed["ckptguard"],
            "cold load vs raw two-pass": lmed["raw two-pass"] / lmed["ckptguard"],
            "checksum cost": med["ckptguard"] / med["ckptguard no checksum"] - 1,
            "async blocked vs host copy": blocked / med["host copy"],
            "async total vs sync save": med["ckptguard async"] / med["ckptguard"],
            # The floors the two ratios above are bounded by on this machine: an all-or-nothing load
            # that holds no second copy reads twice (the raw two-pass reader); an async save copies the
            # state once more than a sync one, and on a machine whose cores the save already keeps busy
            # that copy adds to the total.
            "floor: raw two-pass vs raw reader": lmed["raw reader"] / lmed["raw two-pass"],
            "floor: async total (1 + host copy / sync save)": 1 + med["host copy"] / med["ckptguard"],
            "paired: cold load vs raw two-pass": statistics.median(paired["raw two-pass"]),
        }
        if "gather+torch.save" in med:
            figures["sync save vs gather+torch.save"] = med["gather+torch.save"] / med["ckptguard"]
        figures["sync save vs dd"] = med["dd"] / med["ckptguard"]
        lines.append(
            "  figures: "
            + "; ".join(f"{k} {v:.2f}x" if "cost" not in k else f"{k} {v:+.1%}" for k, v in figures.items())
        )
        summary[kind] = {
            "bytes": r["bytes"],
            "tensors": r["tensors"],
            "save_s": med,
            "load_s": lmed,
            "async_blocked_s": blocked,
            "figures": figures,
            "raw": r,
        }
    if "rss" in results:
        rss = results["rss"]
        lines.append(
            f"\nresident memory over {args.rss_saves} async saves of {rss['bytes'] / 1e6:.0f} MB "
            f"({rss['bytes'] / WORLD / 1e6:.0f} MB per rank):"
        )
        growth = []
        for rank, samples in enumerate(rss["samples"]):
            first = dict(samples)[1]
            tenth = dict(samples).get(10, first)
            lastn, last = samples[-1]
            growth.append((last - tenth) / tenth)
            lines.append(
                f"  rank {rank}: after save 1 {first / 1e6:.0f} MB, after save 10 {tenth / 1e6:.0f} MB, "
                f"after save {lastn} {last / 1e6:.0f} MB: growth from save 10 {growth[-1]:+.2%}"
            )
        summary["rss"] = {"samples": rss["samples"], "growth_after_warmup": max(growth)}
    print("\n".join(lines))
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/ckptguard-bench")
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--small-count", type=int, default=20_000)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--load-reps", type=int, default=7)
    p.add_argument("--rss-saves", type=int, default=100)
    p.add_argument("--states", nargs="+", default=["large", "small"], choices=["large", "small"])
    p.add_argument("--no-torch-save", action="store_true", help="skip gather + torch.save (slow)")
    p.add_argument("--torch-save-reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="0.25 GiB, 2,000 small tensors, 2 repetitions, 10 saves")
    p.add_argument("--json", default=None, help="where to write the JSON result (default bench/results/)")
    p.add_argument("--load-modes", action="store_true", help="only loads: raw reader vs each ckptguard load mode")
    p.add_argument(
        "--drop-caches",
        action="store_true",
        help="cold loads by dropping the whole page cache (root); default: evict only the bench's files",
    )
    args = p.parse_args()
    if args.quick:
        args.size_gib, args.small_count, args.reps, args.load_reps, args.rss_saves = 0.25, 2000, 2, 1, 10
        args.torch_save_reps = 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(args.dir) / "result.json"
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    machine = (
        f"{platform.node()} {platform.machine()}, {os.cpu_count()} cpus, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, "
        f"python {platform.python_version()}, torch {torch.__version__}, dir {args.dir}"
    )
    print(f"machine: {machine}")
    mp.spawn(worker, args=(port, args, str(out)), nprocs=WORLD, join=True)
    results = json.loads(out.read_text())
    if args.load_modes:
        print(f"\nloads, median seconds over {args.load_reps} (cold: page cache dropped; ratio: vs raw reader)")
        for kind in args.states:
            r = results[kind]
            print(f"{kind}: {r['bytes'] / 1e9:.2f} GB in {r['tensors']} tensors; cold loads really cold: {r['cold']}")
            for temp in ("cold", "warm"):
                raw = statistics.median(r["loads"][temp]["raw reader"])
                for name, times in r["loads"][temp].items():
                    med = statistics.median(times)
                    print(f"  {temp:4} {name:20} {med:7.3f} s  {r['bytes'] / med / 1e9:5.2f} GB/s  x{med / raw:.2f}")
        dest = (
            Path(args.json)
            if args.json
            else Path(__file__).parent / "results" / (f"loads-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
        )
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps({"machine": machine, "args": vars(args), "results": results}, indent=1))
        print(f"\nJSON result: {dest}")
        return
    summary = render(results, args)
    dest = (
        Path(args.json)
        if args.json
        else Path(__file__).parent / "results" / (f"checkpoint-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    )
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"machine": machine, "args": vars(args), "summary": summary}, indent=1, default=str))
    print(f"\nJSON result: {dest}")


if __name__ == "__main__":
    main()
