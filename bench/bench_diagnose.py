"""Benchmark `ckptguard diagnose` on a generated log of a 1,024-rank job with one buried failure.

    python bench/bench_diagnose.py [--size-mb 1024] [--ranks 1024] [--anchored-mb 200] [--keep]

Writes the log into a temporary directory (never into the repository), then in one run measures
`grep -c` of a simple pattern over the same file (the read-speed limit), and the diagnosis on one
core (taskset) for the full log and for a log one eighth of the size, with the peak RSS of each,
so that the table shows both the throughput and that memory does not grow with the log; and the
diagnosis of a log whose every line holds an anchor word (every line is a candidate of the
prefilter). Start-up (interpreter, imports, knowledge base) is timed on a one-line log and left out
of the figures the targets are about, printed last: the anchored log's MB/s, and the ratio of the
engine's MB/s to that of `grep -c` run over the same file just before it (the absolute MB/s of a
shared machine swing with its load; that ratio much less). ``--baseline SRC`` adds another engine,
e.g. an older commit's ``src/``, timed in the same run.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def fail_rank(ranks: int) -> int:
    """The rank that fails: 517 of 1,024, somewhere in the middle for other sizes."""
    return ranks // 2 + 5 if ranks > 10 else 0


def _noise_block(rng: random.Random, ranks: int, step0: int, nlines: int) -> bytes:
    """Ordinary lines of a healthy run: step logs, NCCL INFO, warnings, dataloader chatter."""
    out = []
    for i in range(nlines):
        r = rng.randrange(ranks)
        step = step0 + i // ranks
        k = rng.random()
        ts = f"2024-05-01 10:{(step // 60) % 60:02d}:{step % 60:02d},{rng.randrange(1000):03d}"
        if k < 0.86:
            out.append(
                f"[rank{r}]:{ts} INFO trainer: step {step} loss {2 + rng.random():.4f} "
                f"lr 3.0e-04 grad_norm {rng.random():.3f} tok/s {rng.randrange(90000, 120000)} "
                f"mfu 41.{r % 10}%\n"
            )
        elif k < 0.93:
            out.append(
                f"gpu-{r // 8:03d}:{100000 + r}:{200000 + r} [{r % 8}] NCCL INFO Channel {i % 32:02d}/32 : "
                f"{r}[{r % 8}] -> {(r + 1) % ranks}[{(r + 1) % 8}] via P2P/CUMEM/read\n"
            )
        elif k < 0.97:
            out.append(
                f"[rank{r}]:{ts} INFO data: shard {rng.randrange(4096)} opened, "
                f"{rng.randrange(10**6)} samples, prefetch 4\n"
            )
        else:
            out.append(
                f"[rank{r}]:/opt/conda/lib/python3.11/site-packages/torch/utils/data/dataloader.py:558: "
                f"UserWarning: This DataLoader will create 8 worker processes in total.\n"
            )
    return "".join(out).encode()


def _init_lines(ranks: int) -> bytes:
    out = []
    for r in range(ranks):
        h, pid = f"gpu-{r // 8:03d}", 100000 + r
        out.append(
            f"{h}:{pid}:{pid + 50} [{r % 8}] NCCL INFO comm 0x7f{r:04x} rank {r} nranks {ranks} "
            f"cudaDev {r % 8} nvmlDev {r % 8} busId {r % 8}0000 commId 0xabc - Init COMPLETE\n"
        )
        out.append(
            f"{h}:{pid}:{pid + 50} [{r % 8}] NCCL INFO Trees [0] {(r + 1) % ranks}/-1/-1->{r}->{(r - 1) % ranks}\n"
        )
    return "".join(out).encode()


def _failure(ranks: int) -> bytes:
    r = fail_rank(ranks)
    lines = [
        f"[rank{r}]:2024-05-01 11:59:58,101 ERROR trainer: step 99990 failed\n",
        f"[rank{r}]: Traceback (most recent call last):\n",
        f'[rank{r}]:   File "/workspace/train.py", line 412, in <module>\n',
        f"[rank{r}]:     loss.backward()\n",
        f"[rank{r}]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB. GPU {r % 8} has a total "
        f"capacity of 79.15 GiB of which 2.1 GiB is free.\n",
    ]
    for q in range(ranks):
        if q != r:
            lines.append(
                f"[rank{q}]:[E0501 12:09:58.{q:06d} ProcessGroupNCCL.cpp:616] [Rank {q}] Watchdog caught "
                f"collective operation timeout: WorkNCCL(SeqNum=880213, OpType=ALLREDUCE, NumelIn=1, "
                f"NumelOut=1, Timeout(ms)=600000) ran for 600031 milliseconds before timing out.\n"
            )
    return "".join(lines).encode()


def generate(path: Path, size: int, ranks: int, seed: int = 0) -> None:
    """Write ``size`` bytes: init lines, noise, the failure at ~85%, its cascade, then noise."""
    rng = random.Random(seed)
    blocks = [_noise_block(rng, ranks, i * 40, 40_000) for i in range(16)]
    written = 0
    failed = False
    with path.open("wb") as f:
        written += f.write(_init_lines(ranks))
        i = 0
        while written < size:
            if not failed and written >= size * 0.85:
                written += f.write(_failure(ranks))
                failed = True
            written += f.write(blocks[i % len(blocks)])
            i += 1
        if not failed:  # a log smaller than a few noise blocks
            f.write(_failure(ranks))


def generate_anchored(path: Path, size: int, ranks: int, seed: int = 0) -> None:
    """Write ``size`` bytes of which every line holds an anchor word (retried errors, warnings
    with "Exception" and "exit" in them, NCCL WARN lines): all of them reach the line handler."""
    rng = random.Random(seed)
    shapes = [
        "[rank{r}]:2024-05-01 10:{m:02d}:{s:02d},{ms:03d} WARNING io: read of shard {n} failed with error "
        "ECONNRESET, retrying (attempt {a} of 5)\n",
        "[rank{r}]:2024-05-01 10:{m:02d}:{s:02d},{ms:03d} INFO trainer: caught Exception in metrics hook, "
        "skipped step {n}\n",
        "gpu-{h:03d}:{pid}:{pid} [{d}] NCCL WARN NET/IB : Got async event : port error, retrying in {a} ms\n",
        "[rank{r}]:2024-05-01 10:{m:02d}:{s:02d},{ms:03d} INFO data: worker {a} exited cleanly after {n} batches\n",
    ]
    block = []
    for i in range(40_000):
        r = rng.randrange(ranks)
        block.append(
            shapes[i % len(shapes)].format(
                r=r,
                m=(i // 60) % 60,
                s=i % 60,
                ms=rng.randrange(1000),
                n=rng.randrange(10**6),
                a=rng.randrange(1, 5),
                h=r // 8,
                pid=100000 + r,
                d=r % 8,
            )
        )
    data = "".join(block).encode()
    written = 0
    with path.open("wb") as f:
        while written < size * 0.9:
            written += f.write(data)
        f.write(_failure(ranks))
        while written < size:
            written += f.write(data)


def _run_measured(cmd: list[str]) -> tuple[float, float, int, str]:
    """Wall time, CPU time (user + system, the child's own children included: grep) and peak
    RSS (bytes) and stdout of one child, measured by a fresh wrapper process so that each figure
    is that child's own. On a loaded machine the CPU time is the steadier of the two."""
    wrapper = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "p = subprocess.run(sys.argv[1:]); dt = time.perf_counter() - t; "
        "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
        "sys.stderr.write(f'@@{dt} {u.ru_utime + u.ru_stime} {u.ru_maxrss} {p.returncode}')"
    )
    proc = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, check=False)
    tail = proc.stderr.rsplit("@@", 1)[-1].split()
    dt, cpu, rss_kib, rc = float(tail[0]), float(tail[1]), int(tail[2]), int(tail[3])
    if rc not in (0, 1):
        raise SystemExit(f"{cmd} failed: {proc.stderr[-2000:]}")
    return dt, cpu, rss_kib * 1024, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument(
        "--anchored-mb",
        type=int,
        default=200,
        help="size of the log whose every line holds an anchor word (0: skip that case)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the generated logs")
    ap.add_argument(
        "--baseline",
        metavar="SRC",
        help="also time the engine importable from SRC (e.g. an older commit's src/), in the same run",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ckptguard-bench-"))
    one_core = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    try:
        big, small = tmp / "job.log", tmp / "job_small.log"
        t0 = time.perf_counter()
        generate(big, args.size_mb * 1_000_000, args.ranks)
        generate(small, args.size_mb * 1_000_000 // 8, args.ranks, seed=1)
        print(
            f"generated {big.stat().st_size / 1e6:.0f} MB + {small.stat().st_size / 1e6:.0f} MB "
            f"in {time.perf_counter() - t0:.1f} s ({args.ranks} ranks, failure on rank {fail_rank(args.ranks)})"
        )
        anchored = tmp / "anchored.log"
        if args.anchored_mb:
            generate_anchored(anchored, args.anchored_mb * 1_000_000, args.ranks, seed=2)
            print(f"generated {anchored.stat().st_size / 1e6:.0f} MB whose every line holds an anchor word")
        subprocess.run(["cat", str(big), str(small)], stdout=subprocess.DEVNULL, check=True)  # warm cache
        # The command users run, end to end: start-up, ingest, diagnosis and the JSON report.
        cli = [sys.executable, "-m", "ckptguard.cli", "diagnose", "--json"]
        runs = [
            ("grep -c 'loss'", big, None),
            ("ckptguard diagnose", big, None),
            ("ckptguard diagnose (1/8 size)", small, None),
        ]
        if args.anchored_mb:
            runs.append(("ckptguard diagnose (every line anchored)", anchored, None))
        if args.baseline:
            runs += [("baseline diagnose", big, args.baseline), ("baseline diagnose (1/8 size)", small, args.baseline)]
            if args.anchored_mb:
                runs.append(("baseline diagnose (every line anchored)", anchored, args.baseline))
        # Start-up (interpreter, imports, knowledge base; the same whatever the log) is timed
        # on a one-line log and left out of the figures the targets are about.
        tiny = tmp / "one_line.log"
        tiny.write_bytes(b"INFO: nothing to see\n")
        startup: dict[str | None, tuple[float, float]] = {}  # wall, CPU
        for pythonpath in {None, args.baseline} if args.baseline else {None}:
            env = ["env", f"PYTHONPATH={pythonpath}"] if pythonpath else []
            times = [_run_measured([*one_core, *env, *cli, str(tiny)])[:2] for _ in range(3)]
            startup[pythonpath] = (min(t[0] for t in times), min(t[1] for t in times))
        rows = []
        ratios = []
        for label, path, pythonpath in runs:
            mb = path.stat().st_size / 1e6
            # grep -c over the same file right before each engine run: the load of a shared
            # machine drifts within minutes, the ratio of two neighbouring runs much less
            gdt, gcpu, grss, gout = _run_measured([*one_core, "grep", "-c", "loss", str(path)])
            if label.startswith("grep"):
                rows.append((label, mb, gdt, gcpu, mb / gdt, grss / 2**20, f"{gout.strip()} matching lines"))
                continue
            env = ["env", f"PYTHONPATH={pythonpath}"] if pythonpath else []
            dt, cpu, rss, out = _run_measured([*one_core, *env, *cli, str(path)])
            d = json.loads(out)
            result = f"{d['failure_class']}, rank {d['initiating_rank']}, {len(d['collateral_ranks'])} collateral"
            rows.append((label, mb, dt, cpu, mb / dt, rss / 2**20, result))
            wall0, cpu0 = startup[pythonpath]
            net, net_cpu = max(dt - wall0, 1e-3), max(cpu - cpu0, 1e-3)
            ratios.append((label, mb / net, gdt / net, mb / net_cpu, gcpu / net_cpu, gdt / dt))
        print(f"\n{'tool':42s} {'MB':>7s} {'seconds':>8s} {'CPU s':>7s} {'MB/s':>6s} {'peak RSS MiB':>13s}  result")
        for label, mb, dt, cpu, rate, rss, result in rows:
            print(f"{label:42s} {mb:7.0f} {dt:8.2f} {cpu:7.2f} {rate:6.0f} {rss:13.0f}  {result}")
        for pythonpath, (wall0, cpu0) in startup.items():
            who = "baseline" if pythonpath else "ckptguard"
            print(f"start-up ({who} diagnose of a one-line log): {wall0:.2f} s, {cpu0:.2f} CPU s")
        print("\nwithout start-up (ratio: to grep -c over the same file, run just before it):")
        print(f"  {'':42s} {'MB/s':>6s} {'ratio':>6s} {'CPU MB/s':>9s} {'CPU ratio':>9s} {'ratio w/ start-up':>17s}")
        for label, rate, ratio, cpu_rate, cpu_ratio, raw_ratio in ratios:
            print(f"  {label:42s} {rate:6.1f} {ratio:6.3f} {cpu_rate:9.1f} {cpu_ratio:9.3f} {raw_ratio:17.3f}")
        print(
            "targets (start-up not counted): >= 0.2x grep -c on the job log; "
            ">= 20 MB/s on the log whose every line is anchored"
        )
        print(
            f"\n(one core via {'taskset -c 0' if one_core else 'no taskset: unpinned'}; "
            f"python {sys.version.split()[0]}; "
            f"page cache warm; peak RSS is each process's own ru_maxrss, Python interpreter included)"
        )
    finally:
        if args.keep:
            print(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
