"""The protocol's own cost at 1,024 and 16,384 ranks, by simulation (no processes).

The leader of a storage domain (rank 0 on a shared filesystem) does the work
that grows with the number of ranks: it receives every rank's report, decides
the save (files= disjointness, versions), builds the manifest, writes it while
it checks every file is visible with its size (save.commit_when_visible), and
publishes; at start-up it
decides the storage domains from the probe reports. This script feeds those
functions exactly what N ranks would send, runs them in one process, and
reports time, peak Python memory (tracemalloc) and the bytes rank 0 receives
(pickled, as the collectives send them) and writes (the manifest).

The state modelled is sharded FSDP-style: K tensors, each split into N chunks,
one per rank (K items per rank), plus one files= directory per rank and a few
small replicated values per rank. The file-visibility check lists a real
directory holding one data file per rank.

    python bench/bench_protocol_scale.py                   # N = 1,024 and 16,384, K = 4 and 64
    python bench/bench_protocol_scale.py --ranks 16384 --items 4
    python bench/bench_protocol_scale.py --ranks 16384 --items 64 --repeat 3   # medians of 3 timed runs
    python bench/bench_protocol_scale.py --ranks 16384 --items 64 --ab 5       # CPU A/B of the chunk lists
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from ckptguard.comm import ordered_failures
from ckptguard.dcp.planners import combined_digest, ranks_differing
from ckptguard.protocol import layout
from ckptguard.protocol.artifacts import ArtifactTarget
from ckptguard.protocol.decisions import (
    Committed,
    LeaderView,
    PlanReport,
    RankWrites,
    build_manifests,
    decide_plan,
    retention,
)
from ckptguard.protocol.itemtable import ItemTable
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import FileEntry, StoredItem
from ckptguard.protocol.root import PosixRoot
from ckptguard.protocol.save import commit_when_visible
from ckptguard.protocol.timing import gc_paused
from ckptguard.protocol.topology import Topology, _decide, to_ranges
from ckptguard.storage.posix import PosixStorage

RANKS_PER_HOST = 8


def inputs(n: int, k: int) -> dict[str, Any]:
    """What rank 0 receives from N ranks (built outside the measurement)."""
    hosts = [f"node{r // RANKS_PER_HOST:05d}" for r in range(n)]
    host_first = {h: r for r, h in reversed(list(enumerate(hosts)))}
    probe = [
        {"lister": True, "seen": to_ranges(list(range(n)))}
        if host_first[hosts[r]] == r
        else {"lister": False, "sees_host_first": True}
        for r in range(n)
    ]
    plan_reports = [
        PlanReport(
            [ArtifactTarget(r, hosts[r], "offloaded", f"/local/offload/rank{r:05d}")],
            LeaderView([], {s: {1: s + 1} for s in range(3)}, 3) if r == 0 else None,
        )
        for r in range(n)
    ]
    shard = 1 << 20  # elements per chunk (4 MiB of float32)
    md = Metadata(
        state_dict_metadata={
            f"model.layer{t}.flat_param": TensorStorageMetadata(
                properties=TensorProperties(dtype=torch.float32),
                size=torch.Size([shard * n]),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size([r * shard]), sizes=torch.Size([shard])) for r in range(n)
                ],
            )
            for t in range(k)
        },
        planner_data={f"model.layer{t}.flat_param": ("model", f"layer{t}.flat_param") for t in range(k)},
    )
    writes = []
    for r in range(n):
        rel = layout.data_file(r, 0)
        items = [
            StoredItem(
                f"model.layer{t}.flat_param",
                (r * shard,),
                rel,
                t * shard * 4,
                shard * 4,
                f"{r * 1000 + t:016x}",
                "float32",
                (shard,),
            )
            for t in range(k)
        ]
        # Each rank sends its rows as columns (save.py's report_writes), built on the rank.
        writes.append(RankWrites([FileEntry(rel, k * shard * 4, r)], [], ItemTable.from_items(items, [rel])))
    # What each rank sends for the check of plain values: one digest over all of them.
    plain = [
        combined_digest({f"optim.param_groups.0.{p}": "00000000deadbeef" for p in ("lr", "betas", "eps")})
        for _ in range(n)
    ]
    return {
        "hosts": hosts,
        "host_first": host_first,
        "probe": probe,
        "plan": plan_reports,
        "md": md,
        "writes": writes,
        "plain": plain,
        "statuses": [None] * n,
    }


def leader_work(data: dict[str, Any], n: int, root: Path, staging: Path) -> tuple[dict[str, float], int]:
    """Everything rank 0 does that grows with the number of ranks; returns timings and manifest bytes."""
    croot = PosixRoot(PosixStorage(str(root)))
    timings: dict[str, float] = {}
    t = time.perf_counter()
    domains, problem = _decide(data["probe"], data["hosts"], data["host_first"])
    assert domains and not problem and len(domains) == 1
    timings["probe decision (start-up)"] = time.perf_counter() - t

    t = time.perf_counter()
    plan = decide_plan(str(root), 3, False, data["plan"])  # raises if the save is refused
    assert not plan.uncertain and plan.version == 1, plan
    timings["save plan: failures, versions, files= disjointness"] = time.perf_counter() - t

    topo = Topology(0, n, tuple(tuple(d) for d in domains), tuple(data["hosts"]))
    t = time.perf_counter()
    assert ranks_differing(data["plain"]) == []
    # DCP's global Metadata, as Checkpointer passes it: build_manifests encodes it.
    manifest = build_manifests(topo, CheckpointName(3), plan.attempt, "xxh3-64", data["writes"], {}, data["md"])[0]
    timings["commit: build manifest"] = time.perf_counter() - t

    t = time.perf_counter()
    # As save.py does it: every file checked visible with its size (in a thread) while the manifest is
    # encoded, written and fsynced; the publish after both.
    commit_when_visible(croot, str(staging), manifest, True, 60, lambda: None)
    timings["commit: write manifest | files visible, publish"] = time.perf_counter() - t
    manifest_bytes = os.path.getsize(os.path.join(croot.dir(CheckpointName(3)), layout.MANIFEST))

    t = time.perf_counter()
    assert not ordered_failures(data["statuses"])
    retention({s: Committed(1, s + 1) for s in range(4)}, 3, 3, None)
    timings["commit agreement and retention"] = time.perf_counter() - t
    return timings, manifest_bytes


def make_root(data: dict[str, Any], root: Path) -> Path:
    staging = root / ".ckptguard" / "staging" / ("step-00000003." + "ab" * 16)
    (staging / "data").mkdir(parents=True)
    for w in data["writes"]:  # the files the ranks wrote (sparse: sizes without the bytes)
        for f in w.files:
            with open(staging / f.path, "wb") as fh:
                fh.truncate(f.size)
    return staging


def run(n: int, k: int, workdir: Path, repeat: int = 1) -> dict[str, Any]:
    data = inputs(n, k)
    received = {
        "probe": len(pickle.dumps(data["probe"])),
        "plan": len(pickle.dumps(data["plan"])),
        "commit": len(pickle.dumps(data["writes"])) + len(pickle.dumps(data["plain"])),
    }
    # Timed without tracing (tracemalloc slows allocation-heavy code several times), ``repeat`` times
    # on the same inputs (built once: at 16,384 x 64 that takes far longer than the leader's work) ...
    runs: list[dict[str, float]] = []
    for i in range(repeat):
        root = workdir / f"root-{n}-{k}-a{i}"
        staging = make_root(data, root)
        with gc_paused():  # as in Checkpointer: no cyclic GC during the protocol's phases
            t, manifest_bytes = leader_work(data, n, root, staging)
        runs.append(t)
        shutil.rmtree(root)
    totals = [sum(t.values()) for t in runs]
    timings = {phase: statistics.median(t[phase] for t in runs) for phase in runs[0]}
    # ... then once more under tracemalloc for the peak of Python memory.
    root = workdir / f"root-{n}-{k}-b"
    staging = make_root(data, root)
    tracemalloc.start()
    with gc_paused():
        leader_work(data, n, root, staging)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    shutil.rmtree(root)
    return {
        "ranks": n,
        "items_per_rank": k,
        "seconds": timings,
        "total_s": statistics.median(totals),
        "total_s_runs": totals,
        "peak_python_mb": peak / 1e6,
        "received_mb": {k_: v / 1e6 for k_, v in received.items()},
        "manifest_mb": manifest_bytes / 1e6,
    }


def ab(n: int, k: int, rounds: int) -> None:
    """CPU time (process_time) of building and encoding the manifest, DCP's chunk lists walked from its
    objects (metadata_to_json) against built from the item tables (build_manifests given the
    Metadata), alternated on the same inputs in this process; the two manifests' bytes compared."""
    from ckptguard.dcp.codec import metadata_to_json

    data = inputs(n, k)
    topo = Topology(0, n, (tuple(range(n)),), tuple(data["hosts"]))

    def encoded(dcp: Any) -> bytes:
        m = build_manifests(topo, CheckpointName(3), "ab" * 16, "xxh3-64", data["writes"], {}, dcp)[0]
        m.created_at = 0.0
        return m.to_json()

    ways = {"walked": lambda: encoded(metadata_to_json(data["md"])), "tables": lambda: encoded(data["md"])}
    assert ways["walked"]() == ways["tables"](), "the manifests differ"
    cpu: dict[str, list[float]] = {w: [] for w in ways}
    with gc_paused():
        for _ in range(rounds):
            for w, f in ways.items():
                t = time.process_time()
                f()
                cpu[w].append(time.process_time() - t)
    for w, v in cpu.items():
        print(
            f"{n} x {k}, chunk lists {w:<7}: best {min(v):.3f} s CPU, median {statistics.median(v):.3f} s "
            f"(runs {', '.join(f'{x:.3f}' for x in v)})"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 16384])
    p.add_argument("--items", type=int, nargs="+", default=[4, 64])
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="time the leader's work this many times on the same inputs; report medians",
    )
    p.add_argument("--json", default=None)
    p.add_argument(
        "--ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="instead: CPU time of building + encoding the manifest with DCP's chunk lists walked "
        "and from the tables, alternated ROUNDS times (identical bytes checked)",
    )
    args = p.parse_args()
    if args.ab:
        for k in args.items:
            for n in args.ranks:
                ab(n, k, args.ab)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="ckptguard-scale-") as tmp:
        for k in args.items:
            for n in args.ranks:
                rows.append(run(n, k, Path(tmp), args.repeat))
    print(
        f"{'ranks':>7} {'items/rank':>10} {'leader s':>9} {'peak MB':>8} {'manifest MB':>12} "
        f"{'rank 0 receives MB (probe/plan/commit)':>40}"
    )
    for r in rows:
        rec = r["received_mb"]
        print(
            f"{r['ranks']:>7} {r['items_per_rank']:>10} {r['total_s']:9.3f} {r['peak_python_mb']:8.1f} "
            f"{r['manifest_mb']:12.2f} {rec['probe']:>12.2f} / {rec['plan']:.2f} / {rec['commit']:.2f}"
        )
    for r in rows:
        runs = ", ".join(f"{t:.3f}" for t in r["total_s_runs"])
        print(f"\n{r['ranks']} ranks x {r['items_per_rank']} items per rank (medians; runs: {runs} s):")
        for name, s in r["seconds"].items():
            print(f"  {name:<50} {s:8.4f} s")
    out = (
        Path(args.json)
        if args.json
        else Path(__file__).parent / "results" / (f"protocol-scale-{time.strftime('%Y%m%d-%H%M%S')}.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"\nJSON result: {out}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
