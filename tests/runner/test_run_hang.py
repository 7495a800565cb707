"""`ckptguard run --hang-timeout` and `--max-restarts` with real processes (gloo ranks on the CPU).

Each hang test starts a job whose rank STOP stops at step 2 in a different way while the others
wait in all_reduce; the runner must capture every rank's stack, name the rank that stopped and
why, stop the job within the timeout plus a few seconds, and exit non-zero.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.jobs import REPO, free_port
from tests.support.runcmd import RUN, read_report, read_reports, run_env, torchrun

WORKERS = REPO / "tests" / "workers"
HANG_JOB = WORKERS / "run_hang_job.py"
RESTART_JOB = WORKERS / "run_restart_job.py"
TIMEOUT_S = 3


def _two_nodes(
    tmp_path: Path, logs: Path, run_opts: list[str], job: list[str]
) -> list[subprocess.CompletedProcess[str]]:
    """A 2-node x 2-rank torchrun job, each node's agent under its own `ckptguard run`, one --logs."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                *RUN,
                "--logs",
                str(logs),
                "--job-id",
                "hang-test",
                *run_opts,
                "--",
                *torchrun(2, n, port, *job),
            ],
            env=run_env(JOB_TMP=str(tmp_path)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    out = []
    for p in procs:
        o, e = p.communicate(timeout=180)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
    return out


@pytest.mark.parametrize(
    ("launcher", "world", "stop", "mode", "state", "detail"),
    [
        ("plain", 2, 0, "user", "user", "stop_here"),
        ("torchrun", 4, 2, "fifo", "io", "(the checkpoint path)"),
        ("plain", 2, 1, "dataloader", "dataloader", "__getitem__"),
        ("plain", 4, 3, "collective", "other_collective", "recv"),
    ],
)
def test_a_stopped_rank_is_caught_named_and_classified(
    tmp_path: Path, launcher: str, world: int, stop: int, mode: str, state: str, detail: str
) -> None:
    fifo = tmp_path / "ckpts" / "step-3.fifo"  # a stalled path under the checkpoint root
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    logs = tmp_path / "logs"
    opts = ["--grace", "5", "--checkpoints", str(fifo.parent), "--hang-timeout", str(TIMEOUT_S)]
    job = [str(HANG_JOB), str(world), str(stop), mode, str(fifo)]
    if launcher == "torchrun":  # 2 nodes: each node's runner captures its own ranks; each names rank `stop`
        results = _two_nodes(tmp_path, logs, opts, job)
    else:
        results = [
            subprocess.run(
                [*RUN, "--logs", str(logs), *opts, "--", sys.executable, *job],
                env=run_env(JOB_TMP=str(tmp_path)),
                capture_output=True,
                text=True,
                timeout=180,
            )
        ]
    for res in results:
        assert res.returncode != 0, res.stderr
        assert f"rank {stop}" in res.stderr and "stacks" in res.stderr
    # Stopped within the timeout plus a few seconds of the last progress.
    run_dirs = [p.parent for p in logs.glob("*/hang.json")]
    assert len(run_dirs) == len(results)
    for run_dir in run_dirs:
        hang = json.loads((run_dir / "hang.json").read_text())
        ended = json.loads((run_dir / "run.json").read_text())["ended_at"]
        assert hang["detected_at"] - hang["last_progress_at"] < TIMEOUT_S + 1.5
        assert ended - hang["detected_at"] < 8
    reports = read_reports(logs)
    assert len(reports) == len(results)
    for report in reports:
        _check_report(report, world, stop, mode, state, detail, fifo)


def _check_report(
    report: dict[str, Any], world: int, stop: int, mode: str, state: str, detail: str, fifo: Path
) -> None:
    assert report["initiating_rank"] == stop
    assert report["hang"]["stopped_rank"] == stop
    assert report["hang"]["state"] == state
    assert detail in report["hang"]["detail"] or detail in report["root_cause"]
    ranks = {p["rank"]: p for p in report["hang"]["processes"] if p["rank"] is not None}
    assert sorted(ranks) == list(range(world))
    for r, p in ranks.items():  # every rank's stack, all threads, in the report and in stacks/
        assert 'hang_job.py", line' in p["stack"], (r, p["stack"])
        assert Path(p["stack_file"]).parent.name == "stacks"
        if r != stop:
            assert p["state"] == "collective" and p["detail"] == "all_reduce"
    if mode == "fifo":
        assert report["hang"]["path"] == str(fifo)
    assert sorted(report["collateral_ranks"]) == [r for r in range(world) if r != stop]


def test_a_slow_job_that_keeps_making_progress_is_never_killed(tmp_path: Path) -> None:
    # Progress every half timeout, alternately output and a heartbeat (no output at all for a
    # whole timeout): never a hang, however long the job runs.
    code = (
        "import sys, time\n"
        "print('start', flush=True)\n"
        "from ckptguard.runner import heartbeat\n"
        "for i in range(3):\n"
        "    time.sleep(1.5); print('step', i, flush=True)\n"
        "    time.sleep(1.5); heartbeat()\n"
    )
    res = subprocess.run(
        [*RUN, "--logs", str(tmp_path / "logs"), "--hang-timeout", "3", "--", sys.executable, "-c", code],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == "start\n" + "".join(f"step {i}\n" for i in range(3))
    assert not list((tmp_path / "logs").glob("*/hang.json"))


@pytest.mark.parametrize(
    ("on_sigterm", "status"),
    [
        ("signal.SIG_IGN", 128 + 9),  # ignores SIGTERM: SIGKILL after the grace ends it
        ("lambda *a: sys.exit(0)", 128 + 15),  # exits 0 on SIGTERM: a hang is still a failure
    ],
)
def test_a_silent_plain_process_is_caught_as_rank_0_and_stopped(tmp_path: Path, on_sigterm: str, status: int) -> None:
    code = (
        f"import signal, sys, time\nsignal.signal(signal.SIGTERM, {on_sigterm})\nprint('started', flush=True)\n"
        "while True:\n    time.sleep(0.1)\n"
    )
    start = time.monotonic()
    res = subprocess.run(
        [
            *RUN,
            "--logs",
            str(tmp_path / "logs"),
            "--hang-timeout",
            "2",
            "--grace",
            "1",
            "--",
            sys.executable,
            "-c",
            code,
        ],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == status, res.stderr
    assert time.monotonic() - start < 2 + 1 + 10
    report = read_report(tmp_path / "logs")
    assert report["initiating_rank"] == 0
    assert report["hang"]["state"] == "user"


def test_a_transient_failure_is_restarted_from_its_committed_step_and_saves_are_progress(tmp_path: Path) -> None:
    # The job prints nothing for 6 s at a time (longer than --hang-timeout 5) but saves every
    # 3 s: never a hang. It is SIGKILLed once after committing step 1: restarted from there.
    root, logs = tmp_path / "ckpts", tmp_path / "logs"
    res = subprocess.run(
        [
            *RUN,
            "--logs",
            str(logs),
            "--grace",
            "0",
            "--checkpoints",
            str(root),
            "--max-restarts",
            "2",
            "--restart-backoff",
            "0.1",
            "--hang-timeout",
            "5",
            "--",
            sys.executable,
            str(RESTART_JOB),
            str(root),
            "kill_once",
            "4",
        ],
        env=run_env(JOB_STEP_S="3"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["resumed from None", "resumed from 1", "done"]
    assert not list(logs.glob("*/hang.json"))
    runs = sorted((json.loads(p.read_text()) for p in logs.glob("*/run.json")), key=lambda r: r["attempt"])
    assert [r["exit_status"] for r in runs] == [137, 0]
    attempts = runs[-1]["attempts"]
    assert [(a["resumed_from"], a["reached"], a["exit_status"]) for a in attempts] == [(None, 1, 137), (1, 3, 0)]
    assert "transient" in attempts[0]["decision"]
    first = json.loads(next(logs.glob("*/report.json")).read_text())  # the first attempt's diagnosis is kept
    assert first["kind"] == "host_oom_sigkill"


def test_a_deterministic_failure_runs_once_and_says_what_to_fix(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    res = subprocess.run(
        [
            *RUN,
            "--logs",
            str(logs),
            "--grace",
            "0",
            "--checkpoints",
            str(tmp_path / "ckpts"),
            "--max-restarts",
            "3",
            "--restart-backoff",
            "0.1",
            "--",
            sys.executable,
            "-c",
            "print('started', flush=True)\nraise ValueError('bad label at step 7')",
        ],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 1
    assert res.stdout == "started\n"
    assert len(list(logs.glob("*/run.json"))) == 1
    assert "not restarted: python_exception is deterministic" in res.stderr
    assert "Fix:" in res.stderr


def test_restart_on_overrides_the_class_and_the_same_failure_twice_stops(tmp_path: Path) -> None:
    root, logs = tmp_path / "ckpts", tmp_path / "logs"
    res = subprocess.run(
        [
            *RUN,
            "--logs",
            str(logs),
            "--grace",
            "0",
            "--checkpoints",
            str(root),
            "--max-restarts",
            "5",
            "--restart-backoff",
            "0.1",
            "--restart-on",
            "python_exception",
            "--",
            sys.executable,
            "-c",
            "raise ValueError('bad label')",
        ],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 1
    # Restarted once (named by --restart-on), then the same failure with no new step: stop.
    assert len(list(logs.glob("*/run.json"))) == 2
    assert "twice in a row with no new committed step" in res.stderr


def test_restart_options_are_checked_before_anything_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for opts in (
        ["--max-restarts", "1"],
        ["--max-restarts", "1", "--checkpoints", str(tmp_path), "--restart-on", "no_such_class"],
        ["--hang-timeout", "0"],
    ):
        res = subprocess.run(
            [*RUN, "--logs", str(tmp_path / "logs"), *opts, "--", "touch", str(marker)],
            env=run_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 125, (opts, res.stderr)
        assert not marker.exists()


def test_two_nodes_restart_together_on_one_decision(tmp_path: Path) -> None:
    # Each node's job drops its connection once; the first runner to decide writes the decision,
    # the other follows it: both restart, and the job succeeds on both.
    code = (
        "import os, sys\nm = sys.argv[1] + os.environ['NODE']\nif not os.path.exists(m):\n"
        "    open(m, 'w').close()\n    raise ConnectionResetError(104, 'Connection reset by peer')\nprint('ok')\n"
    )
    logs = tmp_path / "logs"
    procs = [
        subprocess.Popen(
            [
                *RUN,
                "--logs",
                str(logs),
                "--job-id",
                "J1",
                "--grace",
                "3",
                "--checkpoints",
                str(tmp_path / "ck"),
                "--max-restarts",
                "1",
                "--restart-backoff",
                "0.1",
                "--",
                sys.executable,
                "-c",
                code,
                str(tmp_path / "marker"),
            ],
            env=run_env(NODE=str(n)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert [out for out, _ in results] == ["ok\n", "ok\n"]
    assert len(list(logs.glob(".restart_J1_1.json"))) == 1
    assert sum("(decided by" in err for _, err in results) == 1
    assert len(list(logs.glob("*_attempt2/run.json"))) == 2
