"""Measure how often the baselines fail in each bed (the numbers in docs/testbeds.md).

Run from the repo root, e.g.::

    python tests/baselines/measure.py olmo_style --bed local --jobs 10 --saves 20
    python tests/baselines/measure.py global_rank0 --bed sshfs --cache-timeout 15 --jobs 10
    python tests/baselines/measure.py staleness --cache-timeout 5 --samples 5
    python tests/baselines/measure.py same_path --jobs 3 --saves 20 [--ragged]

Each job is a separate 2-node x 2-process torchrun job on a fresh directory (same_path:
one node x 4 processes, ``--saves`` rounds of 4 x 32 MiB per job).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Run as a script: put the repository root on sys.path once, for tests.support.
sys.path.insert(0, str(HERE.parents[1]))

from tests.support.beds.sshfs import stale_shared_storage  # noqa: E402
from tests.support.jobs import run_job  # noqa: E402

_FAILED = re.compile(r"BASELINE FAILED \S+ save=(\d+) step=\d+ rank=(\d+): (\w+): (.*)")


def primary_failure(output: str) -> tuple[int, str, str] | None:
    """(save index, exception type, message) of the first non-collateral failure."""
    found = []
    for save, rank, etype, msg in _FAILED.findall(output):
        if "Connection closed by peer" in msg or "Connection reset by peer" in msg:
            continue  # collateral: a peer died first
        found.append((int(save), int(rank), etype, msg))
    if not found:
        return None
    save, _, etype, msg = min(found)
    return save, etype, msg


def measure_baseline(a: argparse.Namespace) -> None:
    script = HERE / f"{a.baseline}.py"
    jobs_failed = saves_done = saves_failed = 0
    kinds: dict[str, int] = {}
    with ExitStack() as stack:
        bed = None
        if a.bed == "sshfs":
            bed = stack.enter_context(stale_shared_storage(2, cache_timeout=a.cache_timeout))
        base = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for j in range(a.jobs):
            args = ["--saves", str(a.saves), *(["--same-step"] if a.same_step else [])]
            args += ["--mitigations", a.mitigations]
            if bed is None:
                (base / f"job{j}").mkdir()
                env, node_env = {"CKPT_ROOT": str(base / f"job{j}")}, None
            else:
                (bed.server_dir / f"job{j}").mkdir()
                env, node_env = {}, bed.node_env(subdir=f"job{j}")
            t = time.monotonic()
            r = run_job(
                script,
                args,
                nnodes=2,
                nproc_per_node=2,
                env=env,
                node_env=node_env,
                timeout=a.timeout,
            )
            dt = time.monotonic() - t
            fail = primary_failure(r.output() + "".join(r.rank_output(k) for k in range(4)))
            if r.ok:
                saves_done += a.saves
                print(f"job {j}: ok, {a.saves} saves, {dt:.1f} s", flush=True)
            else:
                jobs_failed += 1
                save = fail[0] if fail else -1
                saves_done += save + 1
                saves_failed += 1
                kind = f"{fail[1]}: {fail[2][:90]}" if fail else "unknown (see output)"
                kinds[fail[1] if fail else "unknown"] = kinds.get(fail[1] if fail else "unknown", 0) + 1
                print(f"job {j}: FAILED at save {save}, {dt:.1f} s: {kind}", flush=True)
                if not fail:
                    print(r.output()[-3000:])
    print(
        f"SUMMARY {a.baseline} bed={a.bed} cache_timeout={a.cache_timeout} "
        f"same_step={a.same_step} mitigations={a.mitigations}: "
        f"{jobs_failed}/{a.jobs} jobs failed, {saves_failed}/{saves_done} saves failed, "
        f"failures by type {kinds}",
        flush=True,
    )


def measure_staleness(a: argparse.Namespace) -> None:
    import os

    def wait_until(pred, limit: float = 60.0) -> float:
        t0 = time.monotonic()
        while not pred() and time.monotonic() - t0 < limit:
            time.sleep(0.02)
        return time.monotonic() - t0

    with stale_shared_storage(2, cache_timeout=a.cache_timeout) as bed:
        A, B = bed.mounts
        for i in range(a.samples):
            d = f"d{i}"
            os.path.exists(B / d)  # B looks the name up: a cached miss
            os.mkdir(A / d)
            created = wait_until(lambda d=d: os.path.exists(B / d))
            os.rmdir(A / d)
            removed = wait_until(lambda d=d: not os.path.exists(B / d))
            print(
                f"cache_timeout={a.cache_timeout}: created via A, visible via B after "
                f"{created:.2f} s; removed via A, gone via B after {removed:.2f} s",
                flush=True,
            )


def measure_same_path(a: argparse.Namespace) -> None:
    totals = {"clean": 0, "mixed": 0, "torn": 0}
    for j in range(a.jobs):
        with tempfile.TemporaryDirectory() as d:
            args = ["--root", d, "--rounds", str(a.saves), "--all-rounds", "--mib", "4"]
            args += ["--tensors", "8", *(["--ragged"] if a.ragged else [])]
            r = run_job(HERE / "same_path_torch_save.py", args, nproc_per_node=4, timeout=a.timeout)
        m = re.search(r"SAMEPATH SUMMARY rounds=\d+ clean=(\d+) mixed=(\d+) torn=(\d+)", r.rank_output(0))
        if not m:
            print(r.output()[-3000:])
            continue
        for k, v in zip(("clean", "mixed", "torn"), m.groups(), strict=True):
            totals[k] += int(v)
        print(f"job {j}: {m.group(0)}", flush=True)
    n = sum(totals.values())
    print(f"SUMMARY same_path ragged={a.ragged}: {n} files, {totals}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("olmo_style", "global_rank0", "staleness", "same_path"))
    p.add_argument("--bed", choices=("local", "sshfs"), default="local")
    p.add_argument("--cache-timeout", type=float, default=5)
    p.add_argument("--jobs", type=int, default=10)
    p.add_argument("--saves", type=int, default=20)
    p.add_argument("--same-step", action="store_true")
    p.add_argument("--mitigations", choices=("olmo", "none"), default="olmo")
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--ragged", action="store_true", help="same_path: ranks' sizes differ")
    p.add_argument("--timeout", type=float, default=300)
    a = p.parse_args()
    a.baseline = a.what
    if a.what == "staleness":
        measure_staleness(a)
    elif a.what == "same_path":
        measure_same_path(a)
    else:
        measure_baseline(a)


if __name__ == "__main__":
    main()
