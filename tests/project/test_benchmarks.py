"""The benchmarks under bench/ still run against the library (smallest sizes; figures not checked).

A benchmark that breaks when an internal signature changes reports nothing; this found
bench_protocol_scale.py calling build_manifests with its old arguments.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.jobs import REPO


def _run(args: list[str], timeout: float) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_protocol_scale_benchmark_runs(tmp_path: Path) -> None:
    out = _run(
        ["bench/bench_protocol_scale.py", "--ranks", "64", "--items", "2", "--json", str(tmp_path / "r.json")],
        timeout=120,
    )
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [(r["ranks"], r["items_per_rank"]) for r in rows] == [(64, 2)], out
    assert rows[0]["manifest_mb"] > 0 and rows[0]["total_s"] > 0


def test_diagnose_benchmark_runs_the_cli_and_finds_the_buried_failure() -> None:
    out = _run(["bench/bench_diagnose.py", "--size-mb", "8", "--ranks", "64", "--anchored-mb", "4"], timeout=300)
    rows = [line for line in out.splitlines() if line.startswith("ckptguard diagnose")]
    # the job log, an eighth of it, and the log whose every line holds an anchor word
    assert len(rows) == 3 and all("cuda_oom, rank 37, 63 collateral" in r for r in rows), out


def test_gpu_benchmark_runs_its_code_paths_on_the_cpu(tmp_path: Path) -> None:
    out = _run(
        [
            "bench/bench_gpu.py",
            "--device",
            "cpu",
            "--size-gib",
            "0.002",
            "--tensors",
            "4",
            "--reps",
            "1",
            "--dir",
            str(tmp_path / "w"),
            "--json",
            str(tmp_path / "r.json"),
        ],
        timeout=180,
    )
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["device"] == "cpu" and result["tensors"] == 4, out
    assert set(result["figures"]) >= {"async blocked vs device-to-host copy", "async total vs dcp.async_save total"}
