"""`ckptguard run --hang-timeout` on jobs of other shapes than a launcher's ranks: an async save in
flight, ranks forked without a launcher, a Python wrapper, a launcher that replaces PYTHONPATH,
a double-forked helper; and the restart options' edges (real processes, short timeouts)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.jobs import REPO, free_port
from tests.support.runcmd import RUN, read_report, run_env

JOB = REPO / "tests" / "workers" / "run_hang_shapes_job.py"


def _run(tmp_path: Path, opts: list[str], cmd: list[str], **env: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    """Run ``cmd`` under ``ckptguard run``; its output goes to files (a process left behind that
    holds a pipe would block a reader until it ends)."""
    logs = tmp_path / "logs"
    with open(tmp_path / "out.txt", "w+") as out, open(tmp_path / "err.txt", "w+") as err:
        status = subprocess.run(
            [*RUN, "--logs", str(logs), *opts, "--", *cmd], env=run_env(**env), stdout=out, stderr=err, timeout=120
        ).returncode
        out.seek(0)
        err.seek(0)
        res = subprocess.CompletedProcess(cmd, status, out.read(), err.read())
    assert res.returncode != 0, res.stderr
    return res, read_report(logs)


def test_a_rank_whose_async_save_waits_in_a_collective_is_not_the_stopped_one(tmp_path: Path) -> None:
    # Rank 0's main thread waits in close(), its save's thread in ckptguard's all_gather; rank 1
    # is in user code: rank 1 stopped.
    one = f"{sys.executable} {JOB} async {tmp_path / 'ck'}"
    launch = f"RANK=0 {one} & RANK=1 {one}; wait"
    res, report = _run(
        tmp_path,
        ["--hang-timeout", "3", "--grace", "2"],
        ["sh", "-c", launch],
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    assert report["initiating_rank"] == 1, res.stderr
    assert report["hang"]["state"] == "user" and "stuck_in_eval" in report["hang"]["detail"]
    rank0 = next(p for p in report["hang"]["processes"] if p["rank"] == 0)
    assert rank0["state"] == "collective" and report["collateral_ranks"] == [0]


def test_forked_ranks_without_a_launcher_are_named_by_the_rank_they_initialised(tmp_path: Path) -> None:
    res, report = _run(
        tmp_path,
        ["--hang-timeout", "3", "--grace", "2"],
        [sys.executable, str(JOB), "fork"],
        MASTER_PORT=str(free_port()),
    )
    assert report["initiating_rank"] == 1, res.stderr
    assert "stuck_in_eval" in report["hang"]["detail"]
    ranks = {p["rank"]: p for p in report["hang"]["processes"] if p["rank"] is not None}
    assert sorted(ranks) == [0, 1]  # each forked rank dumped its own stack, into its own file
    assert ranks[0]["detail"] == "all_reduce" and ranks[0]["stack_file"] != ranks[1]["stack_file"]


def test_a_python_wrapper_is_not_the_stopped_process_its_child_is(tmp_path: Path) -> None:
    child = "import time\\ndef hung():\\n  time.sleep(100)\\nhung()"
    wrapper = f"import subprocess, sys; subprocess.run([sys.executable, '-c', '{child}'])"
    res, report = _run(tmp_path, ["--hang-timeout", "2", "--grace", "1"], [sys.executable, "-c", wrapper])
    assert "no rank's stack could be captured" not in res.stderr
    child = next(p for p in report["hang"]["processes"] if "hung" in p["stack"] and "subprocess" not in p["stack"])
    assert report["hang"]["stopped_pid"] == child["pid"], res.stderr
    assert report["initiating_rank"] == 0 and f"process {child['pid']}" in report["root_cause"]


def test_a_launcher_that_replaces_pythonpath_is_reported_with_the_fix(tmp_path: Path) -> None:
    code = "import time; time.sleep(100)"
    res, report = _run(
        tmp_path,
        ["--hang-timeout", "2", "--grace", "1"],
        ["sh", "-c", f"RANK=0 PYTHONPATH={REPO / 'src'} exec {sys.executable} -c '{code}'"],
    )
    assert "PYTHONPATH=.:$PYTHONPATH" in report["fix"], res.stderr
    assert report["hang"]["hook_ran"] is False
    (proc,) = [p for p in report["hang"]["processes"] if p["rank"] == 0]
    assert proc["wchan"] or proc["syscall"]  # read from /proc without the hook
    assert "sleeping in" in report["root_cause"] or "blocked in" in report["root_cause"]


def test_a_double_forked_helper_is_stopped_with_the_job(tmp_path: Path) -> None:
    pid_file = tmp_path / "helper.pid"
    code = (
        "import os, time\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.close(r)\n"
        f"        open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "        time.sleep(100)\n"
        "    os._exit(0)\n"
        "os.close(w)\n"
        "os.read(r, 1)\n"
    )
    res, _ = _run(tmp_path, ["--hang-timeout", "2", "--grace", "1"], [sys.executable, "-c", code])
    helper = int(pid_file.read_text())
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and _alive(helper):
        time.sleep(0.1)
    if _alive(helper):
        os.kill(helper, signal.SIGKILL)
        raise AssertionError(f"the helper {helper} outlived the stop: {res.stderr}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


BACKOFF = ["--restart-backoff", "-1", "--", sys.executable, "-c", "pass"]


def test_a_negative_restart_backoff_is_refused(tmp_path: Path) -> None:
    res = subprocess.run(
        [
            *RUN,
            "--logs",
            str(tmp_path / "logs"),
            "--max-restarts",
            "1",
            "--checkpoints",
            str(tmp_path / "ck"),
            *BACKOFF,
        ],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 125 and "--restart-backoff" in res.stderr
    assert not (tmp_path / "logs").exists()


def test_a_job_stopped_by_a_forwarded_sigterm_says_it_is_not_restarted(tmp_path: Path) -> None:
    code = "import time\nprint('ready', flush=True)\nwhile True: time.sleep(0.1)"
    p = subprocess.Popen(
        [
            *RUN,
            "--logs",
            str(tmp_path / "logs"),
            "--max-restarts",
            "2",
            "--checkpoints",
            str(tmp_path / "ck"),
            "--",
            sys.executable,
            "-c",
            code,
        ],
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode != 0
    assert "not restarted: signal SIGTERM was forwarded to the job" in err, err
