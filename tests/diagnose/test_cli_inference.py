"""What the report says it knows and what it infers, through the CLI as a user runs it: a SIGKILL
with no out-of-memory message, and input that is not a text log at all."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckptguard.cli import app

from .conftest import FIXTURES, cli_json

DEMO = FIXTURES / "demo_sigkill"  # the project's own demo: rank 3 SIGKILLs itself mid-save


def test_sigkill_without_oom_evidence_says_who_is_unknown(runner: CliRunner) -> None:
    code, d = cli_json(runner, str(DEMO))
    assert code == 0
    assert (d["failure_class"], d["initiating_rank"]) == ("host_oom_sigkill", 3)
    assert "does not show who sent it" in d["title"]
    assert "out of memory (OOM killer)" not in d["title"]
    assert d["confidence"] < 0.5 and d["confidence_label"] == "low"
    assert "does not show who sent the signal" in d["root_cause"]
    confirm = " ".join(d["confirm"])
    for command in ("dmesg", "sacct", "memory.events"):
        assert command in confirm, command
    text = runner.invoke(app, ["diagnose", str(DEMO)]).stdout
    assert "does not show who sent it" in text and "host out of memory (OOM killer)" not in text


def test_sigkill_with_the_kernels_oom_line_states_it(runner: CliRunner, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    shutil.copytree(DEMO, logs)
    with (logs / "node1.log").open("a") as f:
        f.write("[Tue Dec  2 00:47:12 2026] Out of memory: Killed process 12781 (python) total-vm:812345kB\n")
    code, d = cli_json(runner, str(logs))
    assert (code, d["failure_class"], d["initiating_rank"]) == (0, "host_oom_sigkill", 3)
    assert d["title"] == "Killed by SIGKILL: host out of memory (OOM killer)"
    assert d["confidence"] >= 0.5


def test_binary_input_is_named_as_such(tmp_path: Path) -> None:
    """`ckptguard diagnose /bin/ls`: a usage error naming the file as binary, not 'no failure'."""
    binary = Path(sys.executable).resolve()
    proc = subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", "diagnose", str(binary)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{binary} is a binary file" in proc.stderr
    assert "No failure found" not in proc.stdout and "Traceback" not in proc.stderr
    # a directory that mixes logs and binaries: the logs are read, the binaries named and skipped
    (tmp_path / "rank0.log").write_text("[rank0]: torch.OutOfMemoryError: CUDA out of memory.\n")
    (tmp_path / "core").write_bytes(b"\x7fELF\x02\x01\x01" + bytes(4096))
    code, d = cli_json(CliRunner(), str(tmp_path))
    assert (code, d["failure_class"], d["initiating_rank"]) == (0, "cuda_oom", 0)
    assert any("Skipped" in n and "core" in n and "binary" in n for n in d["notes"])


NEGATIVES = Path(__file__).parent / "negatives"


@pytest.mark.parametrize(
    "path",
    [
        NEGATIVES / "finished_demo_run",
        NEGATIVES / "nginx_access.log",
        Path(__file__).parent / "variants" / "clean_hf_trainer.log",
        Path(__file__).parent / "variants" / "clean_warnings_retries.log",
        Path(__file__).parent / "variants" / "clean_nccl_init_warn_recovered.log",
    ],
    ids=lambda p: p.name,
)
def test_no_failure_in_a_clean_finished_or_foreign_log(runner: CliRunner, path: Path) -> None:
    code, d = cli_json(runner, str(path))
    assert (code, d["found"], d["failure_class"]) == (1, False, None), (d["failure_class"], d["evidence"])
