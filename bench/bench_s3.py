"""Save and load throughput to an S3 endpoint on loopback: ckptguard against boto3's own transfer manager.

One process holds a state of --mib MiB (float32 tensors of --tensor-mib MiB each). In
each repetition, in rotated order:

- ckptguard save      Checkpointer("s3://bench/...").save(step, state): multipart uploads
                      with CRC32C, the conditional commit, the index and `latest`
- ckptguard load      Checkpointer.load into preallocated tensors: parallel ranged GETs
                      straight into the tensors, every byte checked
- boto3 upload_file   the same bytes, from a file in /dev/shm, by `client.upload_file`
                      (s3transfer: multipart, threads), the client's own limit here
- boto3 download_file the same object back into /dev/shm

The endpoint is moto's server (`python -m moto.server`) on 127.0.0.1, shared by
both: on this 2-core machine the server, not the network, is the bottleneck, so
compare ratios from one run. Medians; the first repetition warms up and is not counted.

Peak memory: around each operation the kernel's high-water mark of this process's
resident set is reset (``/proc/self/clear_refs``) and read back after (``VmHWM``); the
figure reported is that peak above the resident set at the start of the operation,
which already holds the state and the preallocated load targets (their pages touched).

    python bench/bench_s3.py                 # 512 MiB, 4 repetitions (~3 minutes here)
    python bench/bench_s3.py --quick         # 64 MiB, 2 repetitions
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # tests.support

from ckptguard import Checkpointer  # noqa: E402

from tests.support.beds.s3 import CREDENTIALS, MotoServer  # noqa: E402


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class PeakRss:
    """Peak resident memory above the start of a ``with`` block (Linux: VmHWM reset by clear_refs)."""

    def __enter__(self) -> PeakRss:
        Path("/proc/self/clear_refs").write_text("5")
        self.start = _status_kib("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.above = (_status_kib("VmHWM") - self.start) * 1024


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--tensor-mib", type=int, default=32)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--part-mib", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args()
    if args.quick:
        args.mib, args.reps = 64, 2
    server = MotoServer()
    server.start()
    os.environ.update({**CREDENTIALS, "AWS_ENDPOINT_URL": server.url})
    try:
        run(args, server)
    finally:
        server.stop()


def run(args: argparse.Namespace, server: MotoServer) -> None:
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3", endpoint_url=server.url)
    client.create_bucket(Bucket="bench")
    n = max(1, args.mib // args.tensor_mib)
    elems = args.tensor_mib << 18
    state = {"model": {f"t{i}": torch.randn(elems) for i in range(n)}}
    nbytes = n * elems * 4
    target = {"model": {f"t{i}": torch.zeros(elems) for i in range(n)}}  # zeros: pages resident
    options = {"part_size": args.part_mib << 20, "max_concurrency": args.concurrency}
    transfer = TransferConfig(
        multipart_threshold=args.part_mib << 20,
        multipart_chunksize=args.part_mib << 20,
        max_concurrency=args.concurrency,
    )
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    src = shm / f"bench_s3_{os.getpid()}.bin"
    dst = shm / f"bench_s3_{os.getpid()}.out"
    with open(src, "wb") as f:
        for t in state["model"].values():
            f.write(t.numpy().tobytes())
    names = ("ckptguard save", "ckptguard load", "boto3 upload_file", "boto3 download_file")
    times: dict[str, list[float]] = {k: [] for k in names}
    peaks: dict[str, list[int]] = {k: [] for k in names}

    def clear() -> None:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket="bench"):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket="bench", Delete={"Objects": keys, "Quiet": True})

    def ours(rep: int) -> None:
        with Checkpointer(f"s3://bench/ck{rep}", storage_options=options) as ck:
            with PeakRss() as m:
                t = time.perf_counter()
                ck.save(1, state)
                times["ckptguard save"].append(time.perf_counter() - t)
            peaks["ckptguard save"].append(m.above)
            with PeakRss() as m:
                t = time.perf_counter()
                ck.load(target)
                times["ckptguard load"].append(time.perf_counter() - t)
            peaks["ckptguard load"].append(m.above)
        assert all(torch.equal(state["model"][k], target["model"][k]) for k in state["model"])

    def theirs(rep: int) -> None:
        with PeakRss() as m:
            t = time.perf_counter()
            client.upload_file(str(src), "bench", f"plain{rep}.bin", Config=transfer)
            times["boto3 upload_file"].append(time.perf_counter() - t)
        peaks["boto3 upload_file"].append(m.above)
        with PeakRss() as m:
            t = time.perf_counter()
            client.download_file("bench", f"plain{rep}.bin", str(dst), Config=transfer)
            times["boto3 download_file"].append(time.perf_counter() - t)
        peaks["boto3 download_file"].append(m.above)
        dst.unlink()

    try:
        for rep in range(args.reps + 1):
            order = [ours, theirs] if rep % 2 == 0 else [theirs, ours]
            for fn in order:
                fn(rep)
                clear()
            if rep == 0:  # warm-up
                for v in times.values():
                    v.clear()
                for p in peaks.values():
                    p.clear()
            print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items() if v), flush=True)
    finally:
        src.unlink(missing_ok=True)
        dst.unlink(missing_ok=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: nbytes / v / 1e9 for k, v in med.items()}
    save_ratio = med["boto3 upload_file"] / med["ckptguard save"]
    load_ratio = med["boto3 download_file"] / med["ckptguard load"]
    print(
        f"\n{nbytes / 2**20:.0f} MiB in {n} tensors, part {args.part_mib} MiB, concurrency {args.concurrency}, "
        f"{args.reps} repetitions (medians), moto {server.url}"
    )
    peak = {k: max(v) for k, v in peaks.items()}
    print(f"{'':22} {'seconds':>8} {'GB/s':>6} {'peak RSS above start, MiB (max)':>32}")
    for k in times:
        print(f"{k:22} {med[k]:8.3f} {gbps[k]:6.3f} {peak[k] / 2**20:32.1f}")
    print(f"\nsave: ckptguard / upload_file throughput = {save_ratio:.2f}x")
    print(f"load: ckptguard / download_file throughput = {load_ratio:.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    (out / f"s3-{stamp}.json").write_text(
        json.dumps(
            {
                "bytes": nbytes,
                "tensors": n,
                "part_mib": args.part_mib,
                "concurrency": args.concurrency,
                "reps": args.reps,
                "seconds": times,
                "median_s": med,
                "peak_rss_above_bytes": peaks,
                "gbps": gbps,
                "save_ratio": save_ratio,
                "load_ratio": load_ratio,
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
