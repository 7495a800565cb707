#!/usr/bin/env python
"""Saves of a state that lives on the GPU: ckptguard's sync and async saves against DCP's.

What an async save costs training is the time ``save()`` blocks: one device-to-host copy into
pinned host buffers (reused across saves) on a side CUDA stream, then the write runs in the
background. This bench measures it against that copy alone and against ``dcp.async_save``, and the
total time to a committed checkpoint against the sync save; then loads back into device tensors.

    python bench/bench_gpu.py                          # --device cuda: needs a GPU
    python bench/bench_gpu.py --device cpu --size-gib 0.1 --reps 2    # the same code paths on CPU

One process, one rank (a single-member gloo group: DCP's async save needs a process group). Every
repetition runs the writers in rotated order after a warm-up that is not counted; medians and
best-of. Files are deleted after each writer, outside the timing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ckptguard import Checkpointer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_state(device: torch.device, total_bytes: int, tensors: int) -> dict[str, Any]:
    numel = max(1, total_bytes // 4 // tensors)
    return {"model": {f"layer{i}.weight": torch.randn(numel, device=device) for i in range(tensors)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--size-gib", type=float, default=4.0)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--json", default=None, help="write the figures here as JSON")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "bench_gpu: --device cuda needs a GPU (torch.cuda.is_available() is False); "
            "use --device cpu to run the same code paths on the CPU"
        )
    device = torch.device(args.device)
    work = Path(args.dir or tempfile.mkdtemp(prefix="ckptguard-gpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{work / 'pg'}", rank=0, world_size=1)
    try:
        run(args, device, work)
    finally:
        dist.destroy_process_group()
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, device: torch.device, work: Path) -> dict[str, Any]:
    state = make_state(device, int(args.size_gib * (1 << 30)), args.tensors)
    total = sum(t.numel() * t.element_size() for t in state["model"].values())
    pinned = {
        k: torch.empty(t.shape, dtype=t.dtype, pin_memory=device.type == "cuda") for k, t in state["model"].items()
    }
    ck_sync, ck_async = Checkpointer(work / "sync"), Checkpointer(work / "async")
    blocked: dict[str, list[float]] = {"ckptguard async": [], "dcp.async_save": []}

    def d2h_copy(i: int) -> None:
        for k, t in state["model"].items():
            pinned[k].copy_(t, non_blocking=True)
        sync(device)

    def ck_async_save(i: int) -> None:
        start = time.perf_counter()
        ck_async.save(i, state, blocking=False)
        blocked["ckptguard async"].append(time.perf_counter() - start)
        ck_async.wait()

    def dcp_async_save(i: int) -> None:
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(work / f"dcpa{i}"))
        blocked["dcp.async_save"].append(time.perf_counter() - start)
        future.result()

    writers: dict[str, Callable[[int], None]] = {
        "device-to-host copy": d2h_copy,
        "ckptguard sync": lambda i: ck_sync.save(i, state),
        "ckptguard async": ck_async_save,
        "dcp.save": lambda i: dcp.save(state, checkpoint_id=str(work / f"dcp{i}")),
        "dcp.async_save": dcp_async_save,
    }
    leftovers = {
        "ckptguard sync": "sync/step-{:08d}",
        "ckptguard async": "async/step-{:08d}",
        "dcp.save": "dcp{}",
        "dcp.async_save": "dcpa{}",
    }
    times: dict[str, list[float]] = {w: [] for w in writers}
    order = list(writers)
    for rep in range(args.reps + 1):
        for name in order[rep % len(order) :] + order[: rep % len(order)]:
            sync(device)
            start = time.perf_counter()
            writers[name](rep)
            sync(device)
            if rep:
                times[name].append(time.perf_counter() - start)
            elif name in blocked:
                blocked[name].clear()  # the warm-up allocates buffers and starts threads
            if name == "ckptguard sync" or name == "ckptguard async":
                (ck_sync if name == "ckptguard sync" else ck_async).delete(rep)
            elif name in leftovers:
                shutil.rmtree(work / leftovers[name].format(rep), ignore_errors=True)

    # Loads into device tensors: the last step of each writer, kept.
    ck_sync.save(10_000, state)
    dcp.save(state, checkpoint_id=str(work / "dcp-load"))
    into = {"model": {k: torch.empty_like(t) for k, t in state["model"].items()}}
    loads: dict[str, list[float]] = {"ckptguard load": [], "dcp.load": []}
    load_phases = None
    for rep in range(args.reps + 1):
        for name in ["ckptguard load", "dcp.load"] if rep % 2 == 0 else ["dcp.load", "ckptguard load"]:
            sync(device)
            start = time.perf_counter()
            if name == "ckptguard load":
                loader = Checkpointer(work / "sync", read_only=True)
                loader.load(into, step=10_000)
                load_phases = loader.last_load_stats
            else:
                dcp.load(into, checkpoint_id=str(work / "dcp-load"))
            sync(device)
            if rep:
                loads[name].append(time.perf_counter() - start)
    for k, t in state["model"].items():
        if not torch.equal(into["model"][k], t):
            raise SystemExit(f"bench_gpu: {k} did not load back bitwise-equal")

    med = {k: statistics.median(v) for k, v in (times | loads | {f"{b} blocked": blocked[b] for b in blocked}).items()}
    best = {k: min(v) for k, v in (times | loads | {f"{b} blocked": blocked[b] for b in blocked}).items()}
    gb = total / 1e9
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"state: {args.tensors} tensors, {gb:.2f} GB on {device} ({name})")
    print(f"{'':28} {'median s':>9} {'best s':>9} {'GB/s':>7}")
    for k in med:
        print(f"{k:28} {med[k]:9.3f} {best[k]:9.3f} {gb / med[k]:7.2f}")
    figures = {
        "async blocked vs device-to-host copy": med["ckptguard async blocked"] / med["device-to-host copy"],
        "async blocked vs dcp.async_save blocked": med["ckptguard async blocked"] / med["dcp.async_save blocked"],
        "async total vs sync save": med["ckptguard async"] / med["ckptguard sync"],
        "async total vs dcp.async_save total": med["ckptguard async"] / med["dcp.async_save"],
        "sync save vs dcp.save": med["dcp.save"] / med["ckptguard sync"],
        "load vs dcp.load": med["dcp.load"] / med["ckptguard load"],
    }
    print(f"phases of the last sync save: {ck_sync.last_save_stats}")
    print(f"phases of the last load: {load_phases}")
    print("figures (time ratios; 'vs dcp' rows: DCP's time / ckptguard's, above 1 = ckptguard faster):")
    for k, v in figures.items():
        print(f"  {k:42} {v:6.2f}x")
    result = {
        "device": str(device),
        "bytes": total,
        "tensors": args.tensors,
        "reps": args.reps,
        "median_s": med,
        "best_s": best,
        "figures": figures,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
