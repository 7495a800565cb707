"""Saves in flight are never lost without a word.

- a process that exits without wait() while its background save fails exits non-zero;
- destroy_process_group() right after save(blocking=False) finishes the save first;
- when a rank dies, the survivors get a CheckpointError, not a raw gloo RuntimeError;
- when a rank stalls, the survivors fail within the control group's timeout;
- a Ctrl-C in wait() leaves the save in flight, and the next save commits after it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptguard import Checkpointer
from ckptguard.protocol import save as save_protocol

from tests.support.jobs import JobTimeout, run_job
from tests.support.results import by_rank, job_results
from tests.support.workers import WORKERS

WORKER = WORKERS / "exit_job.py"


def test_exit_without_wait_after_a_failed_background_save_is_non_zero(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import torch, ckptguard
        ck = ckptguard.Checkpointer({str(tmp_path / "ck")!r})
        ck.save(1, {{"w": torch.ones(8)}}, blocking=False)
        print("returned", flush=True)
    """)
    env = {**os.environ, "CKPTGUARD_FAULT": "after_write:0:raise"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert "returned" in proc.stdout
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "never waited for" in proc.stderr and "injected fault" in proc.stderr


def test_exit_without_wait_after_a_good_background_save_commits_it(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import torch, ckptguard
        ck = ckptguard.Checkpointer({str(tmp_path / "ck")!r})
        ck.save(1, {{"w": torch.ones(1 << 20)}}, blocking=False)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with Checkpointer(tmp_path / "ck", read_only=True) as ck:
        assert ck.steps() == [1]


def test_destroy_process_group_finishes_the_save_in_flight(tmp_path: Path) -> None:
    job = run_job(WORKER, ["destroy", str(tmp_path / "ck")], nproc_per_node=2, timeout=180)
    assert job.ok, job.output()
    assert all(by_rank(job, "done").values())
    with Checkpointer(tmp_path / "ck", read_only=True) as ck:
        assert ck.steps() == [1, 2]
        loaded = {"w": torch.zeros(1 << 16)}
        assert ck.load(loaded) == 2 and bool((loaded["w"] == 2).all())


def test_a_dead_rank_is_a_checkpoint_error_for_the_survivors(tmp_path: Path) -> None:
    job = run_job(WORKER, ["dead_rank", str(tmp_path / "ck")], nproc_per_node=2, timeout=240)
    survivors = [r for r in job_results(job) if r["rank"] == 0]
    assert survivors, job.output()
    assert survivors[0]["error"] == "PeerError" and survivors[0]["checkpoint_error"], survivors


def test_a_stalled_rank_makes_the_others_fail_within_the_timeout(tmp_path: Path) -> None:
    try:  # rank 0 kills the stopped rank once it has reported; else the job ends by the runner's timeout
        job = run_job(
            WORKER,
            ["stalled_rank", str(tmp_path / "ck"), "--timeout", "8"],
            nproc_per_node=2,
            timeout=30,
            straggler_grace=5,
        )
    except JobTimeout as e:
        job = e.result
    survivors = [r for r in job_results(job) if r["rank"] == 0]
    assert survivors, job.output()
    assert survivors[0]["checkpoint_error"] and survivors[0]["seconds"] < 60, survivors


def test_a_rank_interrupted_outside_an_agreement_refuses_its_next_collective_call(tmp_path: Path) -> None:
    """Rank 1 catches a Ctrl-C that ended save() before its first collective; rank 0 is inside the
    save. Rank 1's next call (a load) is refused at once with CheckpointError, instead of pairing its
    collectives with rank 0's save (two ranks in different collectives: a hang);
    rank 0 raises PeerError within the control group's timeout."""
    job = run_job(WORKER, ["out_of_step", str(tmp_path / "ck"), "--timeout", "8"], nproc_per_node=2, timeout=90)
    out = {r["rank"]: r for r in job_results(job)}
    assert out[1]["save"] == "KeyboardInterrupt", job.output()
    assert out[1]["load"] == "CheckpointError" and "out of step" in out[1]["message"], out[1]
    assert out[0]["save"] == "PeerError" and out[0]["seconds"] < 60, out[0]


def test_a_ctrl_c_every_rank_agreed_on_leaves_the_checkpointer_usable(tmp_path: Path) -> None:
    """The counterpart: a Ctrl-C inside a step every rank agrees on (rank 1's, right after it placed a
    load's bytes) is raised on every rank at that point, so the ranks stay in step: the next save and
    load work on both."""
    job = run_job(WORKER, ["agreed_interrupt", str(tmp_path / "ck"), "--timeout", "30"], nproc_per_node=2, timeout=90)
    out = {r["rank"]: r for r in job_results(job)}
    assert out[1]["load"] == "KeyboardInterrupt" and out[0]["load"] != 1, job.output()
    assert all(out[r]["next_load"] == 2 and out[r]["value"] == 2.0 for r in (0, 1)), out


def test_a_script_that_never_destroys_its_gloo_group_exits_cleanly(tmp_path: Path) -> None:
    """PyTorch aborts now and then at exit with a gloo group alive (5 of 16 bare-torch runs here);
    after its saves are done, ckptguard destroys a gloo default group the script left alive."""
    for mode in ("blocking", "background"):
        job = run_job(
            WORKERS / "exit_plain_job.py",
            [str(tmp_path / mode), mode],
            nproc_per_node=2,
            timeout=180,
        )
        assert job.ok, job.output()
        assert by_rank(job, "initialized_after_exit_handlers") == {0: False, 1: False}
        with Checkpointer(tmp_path / mode, read_only=True) as ck:
            assert ck.steps() == [1]


_GROUP_THREADS = textwrap.dedent("""
    import gc, os, sys
    import torch, torch.distributed as dist
    from ckptguard import Checkpointer

    def native_threads():
        return len(os.listdir("/proc/self/task"))

    gc.disable()  # a closed Checkpointer is cyclic garbage: no collection may hide what it still holds
    before = native_threads()
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/store", rank=0, world_size=1)
    ck = Checkpointer(sys.argv[1] + "/ckpt")
    ck.save(1, {"w": torch.ones(4)})
    ck.close()
    del ck
    dist.destroy_process_group()
    print("threads", before, native_threads(), flush=True)
""")


def test_a_closed_checkpointer_keeps_no_gloo_group_alive_after_destroy_process_group(tmp_path: Path) -> None:
    """ckptguard's own gloo group must go with destroy_process_group() once the Checkpointer is closed: a
    closed Checkpointer lives on as garbage until a collection, and a gloo group it kept alive was destroyed
    at interpreter shutdown, where PyTorch aborts now and then ("terminate called without an active
    exception") although the job's saves were done. Its native threads are what shows it alive."""
    out = subprocess.run(
        [sys.executable, "-c", _GROUP_THREADS, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = map(int, out.stdout.split("threads", 1)[1].split())
    assert after == before, out.stdout


def test_exit_while_a_load_and_a_background_save_run_in_unclosed_checkpointers(tmp_path: Path) -> None:
    """The main thread returns while another thread loads (then saves with blocking=False) and a background
    save writes (neither Checkpointer closed): all finish, the process exits 0 without a traceback. Before,
    the background save and the load's read pool died with "cannot schedule new futures after interpreter
    shutdown" (the save lost, exit status 1; an "Exception in thread" traceback)."""
    script = textwrap.dedent(f"""
        import threading, torch, ckptguard
        big = {{f"w{{i}}": torch.full((5 << 20,), float(i)) for i in range(2)}}  # two data files: a write pool
        reader = ckptguard.Checkpointer({str(tmp_path / "a")!r})
        reader.save(1, big)
        into = {{k: torch.zeros_like(v) for k, v in big.items()}}

        def load():
            print("loaded", reader.load(into), all(torch.equal(into[k], v) for k, v in big.items()), flush=True)
            reader.save(3, into, blocking=False)  # the main thread is gone: the interpreter is exiting
            reader.wait()
            print("saved", reader.steps(), flush=True)

        threading.Thread(target=load).start()
        ckptguard.Checkpointer({str(tmp_path / "b")!r}).save(2, big, blocking=False)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Exception" not in proc.stderr, proc.stderr[-3000:]
    assert "loaded 1 True" in proc.stdout and "saved [1, 3]" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    with Checkpointer(tmp_path / "b", read_only=True) as ck:
        assert ck.steps() == [2]


def test_a_ctrl_c_in_wait_leaves_the_background_save_in_flight_and_the_next_save_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C interrupts wait() while step 2 is saved in the background. The save goes on; the next
    save waits for it and commits after it: a save forgotten by wait() would run beside the next one,
    both get the same commit number and `latest` go back to the older step."""
    gate = threading.Event()
    real_save = save_protocol.save

    def gated_save(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            gate.wait(30)  # the background save is held until the test lets it go
        return real_save(*args, **kwargs)

    monkeypatch.setattr(save_protocol, "save", gated_save)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with Checkpointer(tmp_path / "ck") as ck:
            ck.save(1, {"w": torch.full((4,), 1.0)})
            ck.save(2, {"w": torch.full((4,), 2.0)}, blocking=False)
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
            with pytest.raises(KeyboardInterrupt):
                ck.wait()
            assert ck.pending_save() is not None and not ck.pending_save().done()  # type: ignore[union-attr]
            threading.Timer(0.5, gate.set).start()
            ck.save(3, {"w": torch.full((4,), 3.0)})
            assert ck.latest() == 3 and ck.steps(refresh=True) == [1, 2, 3]
            template = {"w": torch.zeros(4)}
            assert ck.load(template) == 3 and torch.equal(template["w"], torch.full((4,), 3.0))
    finally:
        gate.set()
        signal.signal(signal.SIGINT, previous)
    with Checkpointer(tmp_path / "ck", read_only=True) as ck:
        assert ck.latest() == 3


@pytest.mark.parametrize("in_flight", [True, False])
def test_a_forked_child_that_exits_leaves_the_parents_lease_and_save_alone(tmp_path: Path, in_flight: bool) -> None:
    """A child forked while the parent's Checkpointer is open (a save in flight or not) inherits its atexit
    hooks: at its exit it must neither wait for the parent's background save (forever) nor delete the
    parent's lease (the save in flight and every later one would fail with LeaseLostError)."""
    root = tmp_path / "ck"
    script = textwrap.dedent(f"""
        import json, os, sys, time, torch, ckptguard
        ck = ckptguard.Checkpointer({str(root)!r})
        ck.save(1, {{"w": torch.ones(8)}})
        if {in_flight!r}:
            ck.save(2, {{"w": torch.full((1 << 22,), 2.0)}}, blocking=False)
        pid = os.fork()
        if pid == 0:
            # The child may not use the parent's Checkpointer: its calls rewrote the lease with its own pid
            # (another job took the root once it exited) and its waits never ended. Each is refused at once.
            for call in (lambda: ck.tag("best", 1), lambda: ck.save(9, {{"w": torch.ones(2)}}), ck.wait,
                         lambda: ck.read(step=1), lambda: ck.delete(1)):
                try:
                    call()
                    print("child call went through", flush=True)
                except ckptguard.CheckpointError as e:
                    assert "forked from it" in str(e), e
            ck.close()  # nothing: the lease is the parent's
            sys.exit(0)  # atexit hooks run in the child
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            print("child hung", flush=True)
        lease = os.path.join({str(root)!r}, ".ckptguard", "lease.json")
        assert os.path.exists(lease), "the child released the parent's lease"
        assert json.load(open(lease))["pid"] == os.getpid(), "the child wrote its pid into the parent's lease"
        ck.wait()
        ck.save(3, {{"w": torch.full((8,), 3.0)}})
        print("steps", ck.steps(), flush=True)
        ck.close()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "child hung" not in proc.stdout and "child call went through" not in proc.stdout
    assert f"steps {[1, 2, 3] if in_flight else [1, 3]}" in proc.stdout, proc.stdout + proc.stderr[-3000:]
