"""`ckptguard run`: real commands and real torchrun jobs under the runner, and `diagnose --checkpoints`.

The torchrun tests (a 2-node x 2-rank job with each agent in its own UTS namespace, a SIGKILLed
rank, a hang ended by ``collective_timeout_s``) start real agents; the others run a small Python
child (``tests/workers/run_child.py``) or build a checkpoint root in this process.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.jobs import REPO, free_port, kill_job
from tests.support.runcmd import RUN, read_reports, run_env, torchrun

WORKERS = REPO / "tests" / "workers"
CHILD = WORKERS / "run_child.py"
JOB = WORKERS / "run_target_job.py"
MARKER = "CKPTGUARD_BED_JOB"


@pytest.fixture
def job_marker() -> Iterator[str]:
    """Tags every process a test starts; whatever is left afterwards is killed."""
    marker = uuid.uuid4().hex
    yield marker
    kill_job(marker)


# ---- torchrun jobs ---------------------------------------------------------------------------


def _can_unshare_uts() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare_uts(), reason="needs unshare --uts (root) for a hostname per node")
def test_two_node_job_failure_is_diagnosed_on_each_node_with_the_step_to_resume(
    tmp_path: Path, job_marker: str
) -> None:
    logs, root = tmp_path / "logs", tmp_path / "ckpt"
    port = free_port()
    env = run_env(**{MARKER: job_marker})
    procs = []
    for node in (0, 1):
        cmd = [
            *RUN,
            "--logs",
            str(logs),
            "--checkpoints",
            str(root),
            "--",
            *torchrun(
                2, node, port, str(JOB), "--root", str(root), "--fail", "raise", "--fail-rank", "3", "--fail-step", "3"
            ),
        ]
        script = f'hostname node{node} && exec "$@"'
        procs.append(
            subprocess.Popen(
                ["unshare", "--uts", "sh", "-c", script, "sh", *cmd],
                env=env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    outs = [p.communicate(timeout=240) for p in procs]
    stderr = [e.decode(errors="replace") for _, e in outs]
    # Each node's runner exits with its torchrun's status: both agents saw a worker fail.
    assert [p.returncode for p in procs] == [1, 1], stderr
    reports = read_reports(logs)
    assert len(reports) == 2, list(logs.iterdir())
    for rep, text in zip(reports, stderr, strict=True):
        assert rep["initiating_rank"] == 3 and rep["initiating_host"] == "node1", rep["root_cause"]
        assert 3 not in rep["collateral_ranks"] and rep["collateral_ranks"]
        assert set(rep["collateral_ranks"]) | set(rep["also_failed_ranks"]) == {0, 1, 2}
        assert {r["host"] for r in rep["runs"]} == {"node0", "node1"}
        assert rep["resume"] == {
            "step": 2,
            "root": str(root),
            "unsafe": [],
            "resume_hint": f'Checkpointer("{root}").load(state, step=2)',
        }
        assert "first        rank 3 on node1" in text and "resume from  step 2" in text, text
    # torchrun's agent recorded the failing worker's error file (the entry point has @record).
    assert any("sampler state of rank 3" in p.read_text() for p in logs.glob("*node1*/torchelastic_error.json"))
    # The same whole-job answer afterwards, from the log directory.
    after = subprocess.run(
        [sys.executable, "-m", "ckptguard", "diagnose", str(logs), "--json", "--checkpoints", str(root)],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    got = json.loads(after.stdout)
    assert (got["initiating_rank"], got["initiating_host"], got["failure_class"]) == (
        3,
        "node1",
        reports[0]["failure_class"],
    )
    assert got["resume"]["step"] == 2
    # The step named loads.
    import torch

    import ckptguard

    state = ckptguard.Checkpointer(str(root), process_group="local", read_only=True).read(step=2)
    assert torch.equal(state["w"], torch.full((64,), 2.0))


def _single_node(
    tmp_path: Path, marker: str, *job_args: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    logs = tmp_path / "logs"
    cmd = [
        *RUN,
        "--logs",
        str(logs),
        "--checkpoints",
        str(tmp_path / "ckpt"),
        "--grace",
        "0",
        "--",
        *torchrun(1, 0, free_port(), str(JOB), "--root", str(tmp_path / "ckpt"), *job_args),
    ]
    res = subprocess.run(
        cmd, env=run_env(**{MARKER: marker}), cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    reports = read_reports(logs)
    assert len(reports) == 1, res.stderr
    return res, reports[0]


def test_sigkilled_rank_is_named(tmp_path: Path, job_marker: str) -> None:
    res, rep = _single_node(tmp_path, job_marker, "--fail", "kill", "--fail-rank", "1", "--fail-step", "2")
    assert res.returncode == 1, res.stderr
    assert rep["initiating_rank"] == 1, rep
    assert "-9" in json.dumps(rep["evidence"]) or "SIGKILL" in json.dumps(rep["evidence"])
    assert rep["resume"]["step"] == 1
    assert "ckptguard run: the command failed (exit status 1)" in res.stderr


def test_hang_ended_by_the_collective_timeout(tmp_path: Path, job_marker: str) -> None:
    started = time.monotonic()
    res, rep = _single_node(
        tmp_path, job_marker, "--fail", "hang", "--fail-rank", "1", "--fail-step", "2", "--timeout", "3"
    )
    assert res.returncode == 1, res.stderr
    assert time.monotonic() - started < 200
    # A collective that timed out: rank 1 hung and printed nothing; rank 0 waited for it.
    assert rep["failure_class"] in {"nccl_watchdog_timeout", "nccl_network_error"}, rep
    assert rep["initiating_rank"] == 1 and rep["collateral_ranks"] == [0], rep
    assert "PeerError" in json.dumps(rep["evidence"]) or "PeerError" in json.dumps(rep["timeline"])
    assert rep["resume"]["step"] == 1
    # The unfinished save of step 2 is no checkpoint: at most an attempt named unsafe.
    assert all(u["step"] == 2 for u in rep["resume"]["unsafe"])


# ---- pass-through, status, signals -------------------------------------------------------------


def test_success_passes_both_streams_through_pipes_byte_for_byte(tmp_path: Path) -> None:
    direct = subprocess.run([sys.executable, str(CHILD), "output"], env=run_env(), capture_output=True, timeout=60)
    logs = tmp_path / "logs"
    under = subprocess.run(
        [*RUN, "--logs", str(logs), "--", sys.executable, str(CHILD), "output"],
        env=run_env(),
        capture_output=True,
        timeout=60,
    )
    assert under.returncode == 0
    assert under.stdout == direct.stdout and b"isatty=False" in direct.stdout
    assert under.stderr == direct.stderr
    (run_dir,) = logs.iterdir()
    assert (run_dir / "stdout.log").read_bytes() == direct.stdout
    assert (run_dir / "stderr.log").read_bytes() == direct.stderr
    assert not (run_dir / "report.json").exists()
    times = (run_dir / ".stdout.times").read_text().split()
    assert times[0] == "0" and float(times[1]) > 0


def test_capture_keeps_head_and_tail_under_the_cap_and_passes_everything_through(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    code = "import sys\nfor i in range(20000): sys.stdout.write(f'line {i:05d}\\n')"
    res = subprocess.run(
        [*RUN, "--logs", str(logs), "--max-log-bytes", "4096", "--", sys.executable, "-c", code],
        env=run_env(),
        capture_output=True,
        timeout=60,
    )
    assert res.returncode == 0
    assert res.stdout == b"".join(b"line %05d\n" % i for i in range(20000))
    kept = next(logs.glob("*/stdout.log")).read_bytes()
    assert kept.startswith(res.stdout[:2048])
    assert kept.endswith(res.stdout[-1024:])
    assert b"bytes left out here" in kept and len(kept) < 4096 + 200
    assert not list(logs.glob("*/.stdout.tail*"))


def _through_ptys(cmd: list[str], env: dict[str, str]) -> tuple[int, bytes, bytes]:
    """Run ``cmd`` with stdout and stderr each on its own pseudo-terminal; what each terminal got."""
    masters, slaves = zip(*(os.openpty() for _ in range(2)), strict=True)
    got = [bytearray(), bytearray()]

    def drain(i: int) -> None:
        while True:
            try:
                data = os.read(masters[i], 65536)
            except OSError as e:
                assert e.errno == errno.EIO
                return
            if not data:
                return
            got[i] += data

    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=slaves[0], stderr=slaves[1])
    for s in slaves:
        os.close(s)
    readers = [threading.Thread(target=drain, args=(i,)) for i in (0, 1)]
    for t in readers:
        t.start()
    rc = proc.wait(timeout=60)
    for t in readers:
        t.join(timeout=30)
    for m in masters:
        os.close(m)
    return rc, bytes(got[0]), bytes(got[1])


def test_success_through_a_terminal_child_sees_a_terminal_and_bytes_are_identical(tmp_path: Path) -> None:
    rc_d, out_d, err_d = _through_ptys([sys.executable, str(CHILD), "output"], run_env())
    rc_u, out_u, err_u = _through_ptys(
        [*RUN, "--logs", str(tmp_path / "logs"), "--", sys.executable, str(CHILD), "output"], run_env()
    )
    assert (rc_d, rc_u) == (0, 0)
    assert b"stdout isatty=True stderr isatty=True" in out_d
    assert out_u == out_d
    assert err_u == err_d


def test_signals_reach_the_child_and_the_status_is_the_childs(tmp_path: Path) -> None:
    for sig, status, said in (
        (signal.SIGTERM, 7, "child got signal 15"),
        (signal.SIGINT, 128 + signal.SIGINT, "cleanup ran"),
    ):
        logs = tmp_path / f"logs-{sig.name}"
        proc = subprocess.Popen(
            [*RUN, "--logs", str(logs), "--grace", "0", "--", sys.executable, str(CHILD), "signals"],
            env=run_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == status, err
        assert said in out.decode()
        record = json.loads(next(logs.glob("*/run.json")).read_text())
        assert record["signals_forwarded"] == [int(sig)] and record["exit_status"] == status


def test_on_failure_runs_once_with_the_report_paths(tmp_path: Path) -> None:
    hook = tmp_path / "hook.txt"
    logs = tmp_path / "logs"
    res = subprocess.run(
        [
            *RUN,
            "--logs",
            str(logs),
            "--grace",
            "0",
            "--on-failure",
            f'echo "$CKPTGUARD_EXIT_STATUS $CKPTGUARD_REPORT_JSON $CKPTGUARD_REPORT_HTML" >> {hook}',
            "--",
            sys.executable,
            "-c",
            "raise RuntimeError('training diverged')",
        ],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1
    lines = hook.read_text().splitlines()
    assert len(lines) == 1
    status, json_path, html_path = lines[0].split()
    assert status == "1"
    assert json.loads(Path(json_path).read_text())["failure_class"]
    assert "<html" in Path(html_path).read_text()


def test_s3_checkpoint_root(tmp_path: Path) -> None:
    from tests.support.beds.s3 import s3_bed

    with s3_bed(seed=24) as bed:
        bucket = bed.make_bucket(f"run-{uuid.uuid4().hex[:10]}")
        root = f"s3://{bucket}/job"
        logs = tmp_path / "logs"
        env = run_env(**bed.env())
        res = subprocess.run(
            [
                *RUN,
                "--logs",
                str(logs),
                "--grace",
                "0",
                "--checkpoints",
                root,
                "--",
                sys.executable,
                str(CHILD),
                "save-and-fail",
                root,
                "2",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert res.returncode == 1, res.stderr
        (rep,) = read_reports(logs)
        assert rep["resume"] == {
            "step": 2,
            "root": root,
            "unsafe": [],
            "resume_hint": f'Checkpointer("{root}").load(state, step=2)',
        }
        assert "resume from  step 2 of " + root in res.stderr


# ---- bad input ---------------------------------------------------------------------------------


def test_missing_command_exits_127(tmp_path: Path) -> None:
    res = subprocess.run(
        [*RUN, "--logs", str(tmp_path / "logs"), "--", "no-such-command-ckptguard"],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 127
    assert "no-such-command-ckptguard: command not found" in res.stderr


def test_unwritable_logs_refused_before_the_child_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    ran = tmp_path / "ran"
    res = subprocess.run(
        [*RUN, "--logs", str(blocker / "logs"), "--", sys.executable, str(CHILD), "touch", str(ran)],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 125
    assert f"cannot write the log directory {blocker / 'logs'}" in res.stderr
    assert not ran.exists()


@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_missing_or_empty_checkpoint_root_still_prints_the_diagnosis(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "ckpt"
    if kind == "empty":
        root.mkdir()
    res = subprocess.run(
        [
            *RUN,
            "--logs",
            str(tmp_path / "logs"),
            "--grace",
            "0",
            "--checkpoints",
            str(root),
            "--",
            sys.executable,
            "-c",
            "raise MemoryError('out of host memory')",
        ],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    assert "failure      " in res.stderr and "MemoryError" in res.stderr
    (rep,) = read_reports(tmp_path / "logs")
    assert rep["resume"]["step"] is None
    why = "does not exist" if kind == "missing" else "holds no committed checkpoint"
    assert why in rep["resume"]["resume_hint"] and why in res.stderr


# ---- the resume section on its own (diagnose --checkpoints) ----------------------------------


def _root_with_steps(root: Path, steps: int) -> None:
    import torch

    import ckptguard

    with ckptguard.Checkpointer(str(root), process_group="local") as ck:
        for s in range(1, steps + 1):
            ck.save(s, {"w": torch.full((1024,), float(s))})


def _diagnose_resume(log: Path, root: Path | str, *flags: str) -> dict[str, Any]:
    res = subprocess.run(
        [sys.executable, "-m", "ckptguard", "diagnose", str(log), "--json", "--checkpoints", str(root), *flags],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(res.stdout)["resume"]


def _data_file(root: Path, step: int) -> Path:
    return max((p for p in (root / f"step-{step:08d}").rglob("*.bin")), key=lambda p: p.stat().st_size)


def test_resume_skips_a_corrupt_last_step_quick_by_size_and_deep_by_checksum(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text('Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nValueError: boom\n')
    root = tmp_path / "ckpt"
    _root_with_steps(root, 3)
    assert _diagnose_resume(log, root)["step"] == 3
    data = _data_file(root, 3)
    blob = bytearray(data.read_bytes())
    blob[10] ^= 0xFF  # same size: only the checksums see it
    data.write_bytes(bytes(blob))
    assert _diagnose_resume(log, root)["step"] == 3
    deep = _diagnose_resume(log, root, "--deep")
    assert deep["step"] == 2
    assert [u["step"] for u in deep["unsafe"]] == [3] and "checksum" in deep["unsafe"][0]["reason"]
    with data.open("ab") as f:
        f.write(b"x")
    quick = _diagnose_resume(log, root)
    assert quick["step"] == 2 and "corrupt file" in quick["unsafe"][0]["reason"]
    assert quick["resume_hint"] == f'Checkpointer("{root}").load(state, step=2)'


def test_framework_root_gets_the_frameworks_resume_call(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    out = tmp_path / "hf-output"
    _root_with_steps(out / ".ckptguard-hf", 2)
    got = _diagnose_resume(log, out)
    assert got["step"] == 2
    assert got["resume_hint"] == f'trainer.train(resume_from_checkpoint="{out / "checkpoint-2"}")'


def test_a_file_url_root_gets_an_answer_and_a_hint_naming_it(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text("ValueError: boom\n")
    root = tmp_path / "ckpt"
    _root_with_steps(root, 2)
    got = _diagnose_resume(log, f"file://{root}")
    assert got["step"] == 2, got
    assert got["resume_hint"] == f'Checkpointer("{root}").load(state, step=2)'


def test_the_hint_names_the_root_found_under_the_directory_given_and_loads_the_step(tmp_path: Path) -> None:
    """A directory of runs: the hint is a line that loads the step, so it names the root inside."""
    log = tmp_path / "job.log"
    log.write_text("ValueError: boom\n")
    root = tmp_path / "runs" / "run"
    _root_with_steps(root, 2)
    got = _diagnose_resume(log, tmp_path / "runs")
    assert got["step"] == 2, got
    assert got["resume_hint"] == f'Checkpointer("{root}").load(state, step=2)'
    prog = (
        "import torch, ckptguard\nstate = {'w': torch.zeros(1024)}\n"
        f"ckptguard.{got['resume_hint']}\nassert float(state['w'][0]) == 2.0\n"
    )
    subprocess.run([sys.executable, "-c", prog], env=run_env(), check=True, timeout=60)
    res = subprocess.run(
        [
            *RUN,
            "--logs",
            str(tmp_path / "logs"),
            "--grace",
            "0",
            "--checkpoints",
            str(tmp_path / "runs"),
            "--",
            sys.executable,
            "-c",
            "raise ValueError('boom')",
        ],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    assert f'Checkpointer("{root}").load(state, step=2)' in res.stderr, res.stderr


def test_a_directory_of_several_roots_gets_no_guess(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text("ValueError: boom\n")
    for run in ("a", "b"):
        _root_with_steps(tmp_path / "runs" / run, 1)
    got = _diagnose_resume(log, tmp_path / "runs")
    assert got["step"] is None
    assert "holds 2 checkpoint roots" in got["resume_hint"] and str(tmp_path / "runs" / "b") in got["resume_hint"]


# ---- the runner never changes the job's fate -----------------------------------------------------


def _limit_file_size() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))  # run's capture fails with EFBIG past it


def test_capture_failing_midway_leaves_child_output_and_status_alone(tmp_path: Path) -> None:
    prog = "import os, sys\nfor i in range(20000): os.write(1, b'out line %08d\\n' % i)\nsys.exit(5)\n"
    res = subprocess.run(
        [*RUN, "--logs", str(tmp_path / "logs"), "--grace", "0", "--", sys.executable, "-c", prog],
        env=run_env(),
        capture_output=True,
        timeout=120,
        preexec_fn=_limit_file_size,
    )
    assert res.returncode == 5, res.stderr
    assert res.stdout == b"".join(b"out line %08d\n" % i for i in range(20000))
    err = res.stderr.decode()
    assert "Traceback" not in err
    assert err.count("stopped keeping stdout.log") == 1, err


def test_reader_of_stdout_gone_ends_the_child_with_sigpipe(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*RUN, "--logs", str(tmp_path / "logs"), "--grace", "0", "--", "yes"],
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"y\n"
    proc.stdout.close()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGPIPE, err
    assert b"diagnosis" not in err  # `| head` ending a pipeline is not a failure to explain


def test_leftover_background_process_keeps_its_output_after_run_returns(tmp_path: Path) -> None:
    alive = tmp_path / "alive.txt"
    script = f"( sleep 6; echo late-line >&2; echo alive > {alive} ) & echo child-done"
    with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err:
        t0 = time.monotonic()
        rc = subprocess.run(
            [*RUN, "--logs", str(tmp_path / "logs"), "--", "sh", "-c", script],
            env=run_env(),
            stdout=out,
            stderr=err,
            timeout=60,
        ).returncode
        took = time.monotonic() - t0
    assert rc == 0 and took < 4.5  # returned without waiting out the leftover process (6 s)
    deadline = time.monotonic() + 20
    while not alive.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive.exists()  # its late write did not kill it
    time.sleep(0.3)
    assert (tmp_path / "out").read_bytes() == b"child-done\n"
    assert (tmp_path / "err").read_bytes() == b"late-line\n"


def test_signal_during_on_failure_ends_the_hook_and_keeps_the_childs_status(tmp_path: Path) -> None:
    started, finished = tmp_path / "hook-started", tmp_path / "hook-finished"
    proc = subprocess.Popen(
        [
            *RUN,
            "--logs",
            str(tmp_path / "logs"),
            "--grace",
            "0",
            "--on-failure",
            f"touch {started}; sleep 20; touch {finished}",
            "--",
            "sh",
            "-c",
            "exit 3",
        ],
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started.exists()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 3, err
    time.sleep(0.5)
    assert not finished.exists()  # the hook was sent the signal, not left running


def test_unreachable_s3_root_still_gives_diagnosis_reports_and_hook(tmp_path: Path) -> None:
    hook = tmp_path / "hook.txt"
    logs = tmp_path / "logs"
    env = run_env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}", AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y")
    t0 = time.monotonic()
    res = subprocess.run(
        [
            *RUN,
            "--logs",
            str(logs),
            "--grace",
            "0",
            "--checkpoints",
            "s3://bkt/p",
            "--on-failure",
            f'echo "$CKPTGUARD_REPORT_JSON" >> {hook}',
            "--",
            sys.executable,
            "-c",
            "raise RuntimeError('boom')",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert time.monotonic() - t0 < 30, res.stderr
    assert res.returncode == 1
    assert "python_exception" in res.stderr and "resume from  no answer: cannot read s3://bkt/p" in res.stderr
    (rep,) = read_reports(logs)
    assert rep["resume"]["step"] is None
    assert Path(hook.read_text().strip()).is_file()


def test_non_utf8_argument_still_gives_valid_reports(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    res = subprocess.run(
        [
            *RUN,
            "--logs",
            str(logs),
            "--grace",
            "0",
            "--",
            "sh",
            "-c",
            'echo "RuntimeError: boom" >&2; exit 2',
            b"caf\xe9-\xff",
        ],
        env=run_env(),
        capture_output=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    assert b"could not" not in res.stderr and b"python_exception" in res.stderr
    (rep,) = read_reports(logs)
    assert rep["runs"][0]["command"][-1] == "caf\\xe9-\\xff"
    assert next(logs.glob("*/report.html")).read_text(encoding="utf-8").rstrip().endswith("</html>")
    assert not list(logs.glob("*/*.tmp*"))


def test_all_nodes_hint_reads_this_job_when_jobs_share_the_log_dir(tmp_path: Path) -> None:
    logs = tmp_path / "my logs"
    b = subprocess.Popen(
        [
            *RUN,
            "--logs",
            str(logs),
            "--grace",
            "0",
            "--job-id",
            "B",
            "--",
            "sh",
            "-c",
            'sleep 2; echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" >&2; exit 1',
        ],
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)
    a = subprocess.run(
        [
            *RUN,
            "--logs",
            str(logs),
            "--grace",
            "0",
            "--job-id",
            "A",
            "--",
            "sh",
            "-c",
            'echo "RuntimeError: job A broke" >&2; exit 1',
        ],
        env=run_env(),
        capture_output=True,
        timeout=120,
    )
    assert a.returncode == 1
    _, err = b.communicate(timeout=120)
    hint = next(line for line in err.splitlines() if "all nodes" in line).split("$ ", 1)[1]
    import shlex

    argv = shlex.split(hint)
    assert argv[:2] == ["ckptguard", "diagnose"]
    out = subprocess.run(
        [*RUN[:-1], "diagnose", "--json", *argv[2:]], env=run_env(), capture_output=True, text=True, timeout=120
    )
    assert json.loads(out.stdout)["failure_class"] == "cuda_oom", out.stderr


def test_empty_logs_refused_and_empty_command_is_not_found(tmp_path: Path) -> None:
    res = subprocess.run(
        [*RUN, "--logs", "", "--", "true"], env=run_env(), cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 125 and "--logs" in res.stderr
    assert list(tmp_path.iterdir()) == []
    res = subprocess.run(
        [*RUN, "--logs", str(tmp_path / "logs"), "--", ""], env=run_env(), capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 127 and "command not found" in res.stderr


def test_resume_lists_rolled_back_and_bad_manifest_steps_like_ls(tmp_path: Path) -> None:
    import torch

    import ckptguard
    from ckptguard.resume import resume_info

    rolled = tmp_path / "rolled"
    with ckptguard.Checkpointer(str(rolled), process_group="local") as ck:
        for s in (10, 20, 30):
            ck.save(s, {"w": torch.full((16,), float(s))})
        ck.load({"w": torch.zeros(16)}, step=10)
        ck.save(15, {"w": torch.full((16,), 15.0)})
    bads = []
    for garbage in ("garbage{", "", None):
        bad = tmp_path / f"bad-{len(garbage) if garbage is not None else 'dir'}"
        _root_with_steps(bad, 3)
        manifest = bad / "step-00000003" / "MANIFEST.json"
        manifest.unlink()
        if garbage is None:
            manifest.mkdir()
        else:
            manifest.write_text(garbage)
        bads.append(bad)
    for deep in (False, True):
        got = resume_info(str(rolled), deep=deep)
        assert got.step == 15
        assert [(u.step, u.reason.split(":")[0]) for u in got.unsafe] == [(20, "rolled back"), (30, "rolled back")]
        for bad in bads:
            got = resume_info(str(bad), deep=deep)
            assert got.step == 2, got
            assert [u.step for u in got.unsafe] == [3] and got.unsafe[0].reason.startswith("bad manifest"), got


def test_what_run_saw_of_the_end_is_evidence_kill9_and_forwarded_sigint(tmp_path: Path) -> None:
    res = subprocess.run(
        [*RUN, "--logs", str(tmp_path / "l1"), "--grace", "0", "--", "sh", "-c", "kill -9 $$"],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 137
    assert "host_oom_sigkill" in res.stderr and "the log does not show who sent it" in res.stderr, res.stderr
    proc = subprocess.Popen(
        [*RUN, "--logs", str(tmp_path / "l2"), "--grace", "0", "--", sys.executable, str(CHILD), "signals"],
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT
    assert "Interrupted: ckptguard run on" in err and "forwarded SIGINT" in err, err
    assert "python_exception" not in err.split("failure", 1)[1].splitlines()[0]
    # Ctrl-C is a stop on purpose: `interrupted`, never the scheduler's time limit (the hooks get it)
    assert "failure      interrupted: Interrupted" in err and "scheduler_time_limit" not in err, err
