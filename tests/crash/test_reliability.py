"""Committed checkpoints are never lost, loads never tear the caller's
state, a stalled job cannot touch a root another job took over, and a reader is never told that a
retired checkpoint is corrupt. Each test failed before its fix."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import ckptguard
from ckptguard import Checkpointer, CorruptCheckpointError
from ckptguard.protocol.manifest import Manifest
from ckptguard.verify import list_root

from tests.support.jobs import REPO, process_state, run_job
from tests.support.manifests import flip_last_byte
from tests.support.results import job_results
from tests.support.workers import WORKERS

WORKER = WORKERS / "reliability_job.py"


def job(scenario: str, *args: str, nnodes: int, nproc: int, node_env: list[dict], check: bool = True):
    out = run_job(WORKER, [scenario, *args], nnodes=nnodes, nproc_per_node=nproc, node_env=node_env, timeout=240)
    if check:
        assert out.ok, out.output()
    return out


def dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


# -- an overwrite that crashed in one storage domain -----------------------------------------------


def test_overwrite_killed_in_one_domain_keeps_the_committed_step(tmp_path: Path) -> None:
    """Node-local roots (two storage domains), committed {90, 100}; save(100, overwrite=True) and the
    second domain's leader is SIGKILLed before its publishing rename. The restart must load step 100
    (its old version: the new one is not in every domain), and the next save must clean the leftover
    v2 of the first domain without losing anything committed."""
    roots = [tmp_path / "node0", tmp_path / "node1"]
    node_env = [{"CKPT_ROOT": str(r)} for r in roots]
    crashed = job(
        "overwrite_crash", "--fault", "before_publish:1:kill", nnodes=2, nproc=1, node_env=node_env, check=False
    )
    assert not crashed.ok
    # The situation of the issue: the first domain published v2, the second did not.
    assert dirs(roots[0]) == ["step-00000090", "step-00000100", "step-00000100.v2"], crashed.output()
    assert dirs(roots[1]) == ["step-00000090", "step-00000100"]
    resumed = job("overwrite_resume", nnodes=2, nproc=1, node_env=node_env)
    for r in job_results(resumed):
        assert r["steps_at_start"] == [90, 100], resumed.output()
        assert r["loaded"] == 100 and r["version"] == 1, r
        assert r["steps_after"] == [90, 100, 110], r
        assert r["dirs"] == ["step-00000090", "step-00000100", "step-00000110"], r  # the v2 leftover is gone
    for root in roots:
        assert os.listdir(root / ".ckptguard" / "staging") == []


# -- commit order, not step order ------------------------------------------------------------------


def _w(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((16,), float(step))}


def test_rollback_then_save_resumes_the_checkpoint_committed_last(tmp_path: Path) -> None:
    """{100, 200, 300} with keep_last=3; load(step=100), then save 110, 120, 130. A restart resumes
    130 (committed last), retention counted in commit order, `latest` names 130."""
    root = tmp_path / "ckpt"
    with Checkpointer(root, keep_last=3) as ck:
        for s in (100, 200, 300):
            ck.save(s, _w(s))
        out = {"w": torch.zeros(16)}
        assert ck.load(out, step=100) == 100
        ck.save(110, _w(110))
        # The abandoned branch (200, 300: rolled back past) is retired before the checkpoint the run
        # resumed from: 100 stays, the older of the abandoned ones goes.
        assert ck.steps() == [100, 300, 110] or ck.steps() == [300, 100, 110], ck.steps()
        assert set(ck.steps()) == {100, 300, 110}
        ck.save(120, _w(120))
        assert set(ck.steps()) == {100, 110, 120}
        ck.save(130, _w(130))
        assert ck.steps() == [110, 120, 130] and ck.latest() == 130
    with Checkpointer(root, keep_last=3) as ck:
        out = {"w": torch.zeros(16)}
        assert ck.load(out) == 130 and torch.equal(out["w"], _w(130)["w"])
        assert ck.latest() == 130
    assert json.loads((root / "latest").read_text())["dir"] == "step-00000130"


def test_commit_order_survives_a_restart_and_ls_shows_the_abandoned_branch(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with Checkpointer(root) as ck:
        for s in (100, 200, 300):
            ck.save(s, _w(s))
        ck.load({"w": torch.zeros(16)}, step=100)
        ck.save(110, _w(110))
        assert ck.steps() == [100, 200, 300, 110] and ck.latest() == 110
    with Checkpointer(root) as ck:
        assert ck.steps() == [100, 200, 300, 110] and ck.latest() == 110
        out = {"w": torch.zeros(16)}
        assert ck.load(out) == 110 and torch.equal(out["w"], _w(110)["w"])
    listing = list_root(str(root))
    assert [(c.step, c.abandoned) for c in listing.checkpoints] == [
        (100, False),
        (200, True),
        (300, True),
        (110, False),
    ]
    assert [c.seq for c in listing.checkpoints] == [1, 2, 3, 4]
    out = subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", "ls", str(root)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "abandoned" in out.stdout, out.stdout + out.stderr


def _strip_commit_seq(step_dir: Path) -> None:
    """Rewrite a manifest (resealed, so only the field is wrong) without its commit sequence number."""
    path = step_dir / "MANIFEST.json"
    path.write_bytes(dataclasses.replace(Manifest.from_json(path.read_bytes(), str(path)), commit_seq=None).to_json())


def test_a_manifest_without_a_commit_sequence_number_is_corrupt_and_the_load_falls_back(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with Checkpointer(root) as ck:
        for s in (5, 7):
            ck.save(s, _w(s))
    _strip_commit_seq(root / "step-00000007")
    with Checkpointer(root, read_only=True) as ck:
        out = {"w": torch.zeros(16)}
        assert ck.load(out) == 5 and torch.equal(out["w"], _w(5)["w"])
    report = subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", "verify", str(root), "--step", "7"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode != 0 and "commit sequence number" in report.stdout + report.stderr


def test_latest_never_moves_backwards_in_commit_order(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with Checkpointer(root) as ck:
        ck.save(300, _w(300))
        ck.save(100, _w(100))  # committed after 300: the pointer follows commit order
        assert json.loads((root / "latest").read_text())["dir"] == "step-00000100"
        assert ck.latest() == 100


# -- a failed load leaves the caller's state as it was ----------------------------------------------


def _snapshot(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, nn.Module):
            out[k] = {n: t.detach().clone() for n, t in v.state_dict().items()}
        elif isinstance(v, torch.Tensor):
            out[k] = v.clone()
        else:
            out[k] = json.loads(json.dumps(v))
    return out


def _same_bits(a: object, b: object) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bytes(a.contiguous().view(torch.uint8).numpy()) == bytes(b.contiguous().view(torch.uint8).numpy())
        )
    return a == b


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def test_a_corrupt_load_leaves_the_callers_state_untouched(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with Checkpointer(root) as ck:
        ck.save(1, {"model": _model(1), "a": torch.arange(1000.0), "b": torch.ones(3000), "meta": {"n": 1}})
        flip_last_byte(root, 1, "b")  # every other item of the checkpoint is intact and read first or alongside
        state = {"model": _model(7), "a": torch.full((1000,), -1.0), "b": torch.full((3000,), -2.0), "meta": {"n": -1}}
        before = _snapshot(state)
        with pytest.raises(CorruptCheckpointError):
            ck.load(state, step=1)
        assert _same_bits(_snapshot(state), before)


def test_a_fallback_load_leaves_no_byte_of_the_rejected_checkpoint(tmp_path: Path) -> None:
    """strict=False and the fallback to an older step: a key that only the rejected (newer) checkpoint
    holds keeps the caller's own value, not the rejected checkpoint's bytes."""
    root = tmp_path / "ckpt"
    with Checkpointer(root) as ck:
        ck.save(1, {"a": torch.full((4000,), 1.0)})
        ck.save(2, {"a": torch.full((4000,), 2.0), "b": torch.full((5000,), 2.0), "c": torch.full((100,), 2.0)})
        flip_last_byte(root, 2, "a")
        state = {"a": torch.zeros(4000), "b": torch.full((5000,), -7.0), "c": torch.full((100,), -7.0)}
        with pytest.warns(UserWarning, match=r"step 2 .* is corrupt"):
            assert ck.load(state, strict=False) == 1
        assert torch.equal(state["a"], torch.full((4000,), 1.0))
        assert torch.equal(state["b"], torch.full((5000,), -7.0)) and torch.equal(state["c"], torch.full((100,), -7.0))


def test_a_load_larger_than_the_memory_cap_still_verifies_before_it_writes(tmp_path: Path) -> None:
    """Beyond load_memory_bytes the checkpoint is verified in a first pass and read into place in a
    second: a corrupt item still leaves the state untouched."""
    root = tmp_path / "ckpt"
    with Checkpointer(root, load_memory_bytes=4096) as ck:
        ck.save(1, {"a": torch.arange(20_000.0), "b": torch.ones(20_000)})
        state = {"a": torch.zeros(20_000), "b": torch.zeros(20_000)}
        assert ck.load(state) == 1 and torch.equal(state["a"], torch.arange(20_000.0))
        flip_last_byte(root, 1, "b")
        state = {"a": torch.zeros(20_000), "b": torch.zeros(20_000)}
        with pytest.raises(CorruptCheckpointError):
            ck.load(state, step=1)
        assert not state["a"].any() and not state["b"].any()


# -- retention under a concurrent reader -------------------------------------------------------------


def _retire_while_reading(
    monkeypatch: pytest.MonkeyPatch, reader: Checkpointer, writer: Checkpointer, step: int
) -> None:
    """The first data file the reader opens triggers the writer's next save (keep_last=1 retires
    what the reader is reading)."""
    storage = reader._session.storage
    original = storage.open_read
    fired = []

    def open_read(path: str):  # type: ignore[no-untyped-def]
        if not fired and "/data/" in path:
            fired.append(path)
            writer.save(step, _w(step))
        return original(path)

    monkeypatch.setattr(storage, "open_read", open_read)


def test_a_reader_whose_checkpoint_is_retired_loads_the_newest(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "ckpt"
    writer = Checkpointer(root, keep_last=1)
    writer.save(1, _w(1))
    reader = Checkpointer(root, read_only=True)
    _retire_while_reading(monkeypatch, reader, writer, 2)
    out = {"w": torch.zeros(16)}
    assert reader.load(out) == 2 and torch.equal(out["w"], _w(2)["w"])
    monkeypatch.undo()
    _retire_while_reading(monkeypatch, reader, writer, 3)
    out = {"w": torch.zeros(16)}
    with pytest.raises(ckptguard.StepRetiredError, match=r"step 2 .*retired"):
        reader.load(out, step=2)
    assert not out["w"].any()  # nothing of the retired checkpoint reached the caller
    writer.close()
    reader.close()


def test_a_reader_whose_step_is_deleted_and_saved_again_loads_the_new_one(tmp_path: Path, monkeypatch) -> None:
    """The reader holds step 2's manifest when the writer deletes step 2 and saves it again (the Lightning
    plugin does): the reader loads the new step 2; it does not call it corrupt and fall back to step 1."""
    root = tmp_path / "ckpt"
    writer = Checkpointer(root)
    writer.save(1, _w(1))
    writer.save(2, _w(2))
    reader = Checkpointer(root, read_only=True)
    storage = reader._session.storage
    original = storage.open_read
    again = {"w": _w(2)["w"] * 3}

    def open_read(path: str):  # type: ignore[no-untyped-def]
        if "/data/" in path and "step-00000002" in path and not fired:
            fired.append(path)
            writer.delete(2)
            writer.save(2, again)
        return original(path)

    fired: list[str] = []
    monkeypatch.setattr(storage, "open_read", open_read)
    out = {"w": torch.zeros(16)}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a "corrupt, falling back" warning fails the test
        assert reader.load(out) == 2
    assert fired and torch.equal(out["w"], again["w"])
    writer.close()
    reader.close()


# -- a stalled job cannot touch a root another job took over ----------------------------------------


def _start(scenario: str, root: Path, *args: str) -> subprocess.Popen[str]:
    repo = str(REPO)  # the worker imports tests.support
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH", "")])),
    }
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        env.pop(k, None)
    return subprocess.Popen(
        [sys.executable, str(WORKER), scenario, "--root", str(root), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def _wait_stopped(p: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert p.poll() is None, p.communicate()[0]
        if process_state(p.pid) == "T":
            return
        time.sleep(0.05)
    p.kill()
    raise AssertionError("the job never reached its stop point:\n" + p.communicate()[0])


def _results(text: str) -> dict:
    out: dict = {}
    for line in text.splitlines():
        if line.startswith("RESULT "):
            out.update(json.loads(line[len("RESULT ") :]))
    return out


def _tree(root: Path) -> dict[str, str]:
    """Every name under the root (but trash, which only holds what is being deleted) and the small files."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        dirnames[:] = [d for d in dirnames if not (rel == ".ckptguard" and d in ("trash", "locks"))]
        for d in dirnames:
            out[os.path.join(rel, d)] = "dir"
        for f in filenames:
            if ".tmp-" in f:  # a write in flight (the stopped job's lease renewal may still be finishing one)
                continue
            p = Path(dirpath) / f
            out[os.path.join(rel, f)] = p.read_text() if f in ("latest", "lease.json") else str(p.stat().st_size)
    return out


@pytest.mark.parametrize("phase", ["after_publish", "after_commit"])
def test_a_job_stalled_after_its_commit_cannot_touch_the_new_holders_root(tmp_path: Path, phase: str) -> None:
    """Job A commits step 3 and stalls (SIGSTOP) before `latest`/retention/clean-up; job B takes the root
    over, commits step 10 and stalls inside its save of step 11 (an attempt in staging). A resumes: it
    must stop with LeaseLostError and change nothing of B's; B then finishes its save."""
    root = tmp_path / "ckpt"
    a = _start("stall_holder", root, "--fault", f"{phase}:0:stop")
    b = None
    try:
        _wait_stopped(a)
        b = _start("taker", root, "--fault", "before_publish:0:stop")
        _wait_stopped(b)
        before = _tree(root)
        assert any(k.startswith(".ckptguard/staging/step-00000011.") for k in before), before
        os.kill(a.pid, signal.SIGCONT)
        out_a = a.communicate(timeout=120)[0]
        res_a = _results(out_a)
        assert res_a.get("save3") == "LeaseLostError" or res_a.get("save4") == "LeaseLostError", out_a
        assert res_a.get("save4") == "LeaseLostError", out_a
        assert _tree(root) == before, out_a  # nothing of B's deleted, hidden or overwritten; latest unmoved
        os.kill(b.pid, signal.SIGCONT)
        out_b = b.communicate(timeout=120)[0]
        assert b.returncode == 0, out_b
        res_b = _results(out_b)
        assert res_b["loaded"] == 3 and res_b["saved"] == 11 and res_b["steps"] == [10, 11], out_b
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()


def test_takeover_shortcuts_only_where_the_holder_is_certainly_gone(tmp_path: Path, monkeypatch) -> None:
    """Concurrent srun steps share SLURM_JOB_ID: different jobs. A dead pid proves nothing in another pid
    namespace (containers sharing hostname and boot id), nor in a record that names none."""
    from ckptguard.protocol import lease as lease_mod
    from ckptguard.storage import open_storage

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    first = lease_mod.job_identity()
    monkeypatch.setenv("SLURM_STEP_ID", "1")
    assert first != lease_mod.job_identity() and first == "slurm:77.0"
    # The batch step (no SLURM_STEP_ID): two processes started side by side by one batch script share
    # SLURM_JOB_ID and are not each other's incarnations; a requeue (higher SLURM_RESTART_COUNT) is.
    monkeypatch.delenv("SLURM_STEP_ID")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    batch0 = lease_mod.job_identity()
    holder = lease_mod.Lease(open_storage(tmp_path), "first", batch0, ttl_s=30)._record(1)
    holder.pid = os.getpid()  # alive: only the job identity could let a newcomer in
    assert lease_mod.Lease(open_storage(tmp_path), "beside", batch0, ttl_s=30)._holder_gone(holder) is None
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    requeued = lease_mod.Lease(open_storage(tmp_path), "requeued", lease_mod.job_identity(), ttl_s=30)
    assert requeued._holder_gone(holder) is not None
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    assert lease_mod.Lease(open_storage(tmp_path), "x", lease_mod.job_identity(), ttl_s=30)._holder_gone(holder) is None
    monkeypatch.delenv("SLURM_JOB_ID")
    lease = lease_mod.Lease(open_storage(tmp_path), "me", None, ttl_s=30)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    rec = lease._record(1)
    rec.holder, rec.pid = "other", dead.pid
    assert lease._holder_gone(rec) is not None  # same host, boot and pid namespace: the pid is certainly dead
    rec.pid_ns = "other-namespace"
    assert lease._holder_gone(rec) is None
    rec.pid_ns = ""  # a record of an older ckptguard
    assert lease._holder_gone(rec) is None


def test_release_never_deletes_a_lease_taken_over_meanwhile(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ckpt", lease_ttl_s=30)
    lease = ck._session.lease
    path = Path(lease.path)
    storage = lease.storage
    versioned = storage.read_versioned(str(path))
    newer = json.loads(path.read_text())
    newer.update(holder="someone-else", epoch=newer["epoch"] + 1)
    assert storage.compare_and_swap(str(path), json.dumps(newer).encode(), versioned[1])  # a takeover
    # The release's compare-and-delete on the version it read: a takeover between its read and its delete wins.
    assert not storage.delete_if_version(str(path), versioned[1])
    ck.close()
    assert json.loads(path.read_text())["holder"] == "someone-else"


# -- an integration's job that lost the root removes nothing the new holder can see -----------------


def _start_script(script: str, *args: str) -> subprocess.Popen[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
    }
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )


def _resume(p: subprocess.Popen[str]) -> str:
    os.kill(p.pid, signal.SIGCONT)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 0, out
    return out


def _stop_all(*procs: subprocess.Popen[str] | None) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()


_LIGHTNING_A = """
import json, os, signal, sys, torch
from ckptguard.integrations.lightning import CkptguardCheckpointIO
d = sys.argv[1]
io = CkptguardCheckpointIO(lease_ttl_s=1.0)
io.save_checkpoint({"w": torch.ones(4)}, os.path.join(d, "a.ckpt"))
os.kill(os.getpid(), signal.SIGSTOP)  # a frozen job: another job takes the root over meanwhile
try:
    io.remove_checkpoint(os.path.join(d, "a.ckpt"))
    result = {"remove": "ok"}
except Exception as e:
    result = {"remove": type(e).__name__, "message": str(e)}
print("RESULT " + json.dumps(result), flush=True)
io.teardown()
"""


def test_lightning_remove_by_a_job_that_lost_the_root_deletes_nothing_of_the_new_holder(tmp_path: Path) -> None:
    """Job A saved ``a.ckpt`` and froze; job B took the root over and saved its own ``a.ckpt``. A resumes
    and Lightning's top-k asks it to remove ``a.ckpt``: it must raise LeaseLostError, and B's pointer and
    data stay (before the fix A unlinked B's pointer, then failed at the fenced untag)."""
    pytest.importorskip("lightning")
    from ckptguard.integrations.lightning import CkptguardCheckpointIO

    a = _start_script(_LIGHTNING_A, str(tmp_path))
    io_b = None
    try:
        _wait_stopped(a)
        io_b = CkptguardCheckpointIO(lease_ttl_s=1.0, lease_wait_s=60)
        io_b.save_checkpoint({"w": torch.full((4,), 2.0)}, str(tmp_path / "a.ckpt"))
        pointer = (tmp_path / "a.ckpt").read_bytes()
        res = _results(_resume(a))
        assert res["remove"] == "LeaseLostError", res
        assert (tmp_path / "a.ckpt").read_bytes() == pointer
        assert torch.equal(io_b.load_checkpoint(str(tmp_path / "a.ckpt"))["w"], torch.full((4,), 2.0))
    finally:
        _stop_all(a)
        if io_b is not None:
            io_b.teardown()


_ACCELERATE_A = """
import json, os, signal, sys, torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from ckptguard import Checkpointer
from ckptguard.integrations.accelerate import save_state
acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
    project_dir=sys.argv[1], automatic_checkpoint_naming=True, total_limit=1))
model = acc.prepare(torch.nn.Linear(3, 2))
save_state(acc, checkpointer_options={"lease_ttl_s": 1.0})
commit = Checkpointer.save

def commit_then_freeze(self, *args, **kwargs):
    # The window between the commit and the visible folder, the rotation and the staging clean-up.
    commit(self, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGSTOP)

Checkpointer.save = commit_then_freeze
try:
    save_state(acc, checkpointer_options={"lease_ttl_s": 1.0})
    result = {"save": "ok"}
except Exception as e:
    result = {"save": type(e).__name__, "message": str(e)}
print("RESULT " + json.dumps(result), flush=True)
"""


def _visible(project: Path) -> list[str]:
    """What is under the project directory but the root's control files (the lease, which B renews)."""
    return sorted(
        str(p.relative_to(project)) for p in project.rglob("*") if ".ckptguard-accelerate/.ckptguard" not in str(p)
    )


def test_accelerate_rotation_by_a_job_that_lost_the_root_deletes_nothing_visible(tmp_path: Path) -> None:
    """Job A (total_limit=1) committed step 1 and froze before publishing it and rotating step 0 out;
    job B took the root over (and resumes from what it sees). A resumes: it must raise LeaseLostError
    and leave ``checkpoints/checkpoint_0`` and the root as B sees them (before the fix A published its
    folder and removed B's ``checkpoint_0``)."""
    pytest.importorskip("accelerate")
    a = _start_script(_ACCELERATE_A, str(tmp_path))
    b = None
    try:
        _wait_stopped(a, timeout=300)
        b = Checkpointer(tmp_path / ".ckptguard-accelerate", lease_ttl_s=1.0, lease_wait_s=60)
        before = _visible(tmp_path)
        assert "checkpoints/checkpoint_0/model.safetensors" in before, before
        res = _results(_resume(a))
        assert res["save"] == "LeaseLostError", res
        assert _visible(tmp_path) == before
        assert b.steps(refresh=True) == [0, 1]
    finally:
        _stop_all(a)
        if b is not None:
            b.close()


def test_a_save_fenced_after_its_commit_point_says_the_step_is_committed(tmp_path: Path, monkeypatch) -> None:
    """The leader's rename lands, then (a stall) another job takes the root over before the leader looks
    at the lease again: the save raises LeaseLostError, and its message must say what is true (the step
    is listed: committed, the new holder keeps it), never "Nothing was committed"."""
    from ckptguard.protocol.posixroot import PosixRoot

    ck = Checkpointer(tmp_path / "ckpt", lease_ttl_s=30)
    ck.save(1, {"w": torch.ones(4)})
    lease_path = Path(ck._session.lease.path)
    storage = ck._session.lease.storage
    publish = PosixRoot.commit

    def publish_then_taken_over(self, *args, **kwargs):  # a takeover right after the commit point
        name = publish(self, *args, **kwargs)
        versioned = storage.read_versioned(str(lease_path))
        record = json.loads(versioned[0])
        record.update(holder="another-job", epoch=record["epoch"] + 1)
        assert storage.compare_and_swap(str(lease_path), json.dumps(record).encode(), versioned[1])
        return name

    monkeypatch.setattr(PosixRoot, "commit", publish_then_taken_over)
    with pytest.raises(ckptguard.LeaseLostError) as raised:
        ck.save(2, {"w": torch.full((4,), 2.0)})
    monkeypatch.undo()
    message = str(raised.value)
    assert "Nothing was committed" not in message and "nothing of this save" not in message, message
    assert "is listed" in message and "it is committed" in message, message
    with Checkpointer(tmp_path / "ckpt", read_only=True) as reader:
        assert reader.steps() == [1, 2]
        got = {"w": torch.zeros(4)}
        assert reader.load(got, step=2) == 2 and torch.equal(got["w"], torch.full((4,), 2.0))
    ck.close()


@pytest.mark.parametrize("existing", [None, 1], ids=["new-tag", "moved-tag"])
def test_a_tag_whose_holder_is_taken_over_while_it_stages_the_tag_file_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: int | None
) -> None:
    """The holder passed its fence check for tag('best', 2) and stalls while it writes and syncs the new
    tag file (an fsync is the slow part); another job takes the root over meanwhile. When it resumes it
    must raise LeaseLostError and leave the tag as the new holder sees it (it created or moved the tag
    when the fence was checked only before the file was staged)."""
    import ckptguard.storage.posix as posix_storage

    ck = Checkpointer(tmp_path / "ckpt", lease_ttl_s=30)
    ck.save(1, {"w": torch.ones(4)})
    ck.save(2, {"w": torch.full((4,), 2.0)})
    if existing is not None:
        ck.tag("best", existing)
    lease_path = Path(ck._session.lease.path)
    storage = ck._session.lease.storage
    write_new_file = posix_storage.write_new_file

    def staged_then_taken_over(path: str, data: bytes) -> None:  # a takeover while the tag file is staged
        write_new_file(path, data)
        if "best" in os.path.basename(path):
            versioned = storage.read_versioned(str(lease_path))
            record = json.loads(versioned[0])
            record.update(holder="another-job", epoch=record["epoch"] + 1)
            assert storage.compare_and_swap(str(lease_path), json.dumps(record).encode(), versioned[1])

    monkeypatch.setattr(posix_storage, "write_new_file", staged_then_taken_over)
    with pytest.raises(ckptguard.LeaseLostError):
        ck.tag("best", 2)
    monkeypatch.undo()
    with Checkpointer(tmp_path / "ckpt", read_only=True) as reader:
        assert reader.tags() == ({} if existing is None else {"best": existing})
    ck.close()


@pytest.mark.parametrize("existing", [None, 1], ids=["new-tag", "moved-tag"])
def test_a_tag_whose_holder_is_taken_over_after_its_last_fence_check_writes_nothing(
    tmp_path: Path, existing: int | None
) -> None:
    """The holder's last fence check for tag('best', 2) passed, the tag file is staged; the job stalls
    before the link or rename, and another job takes the root over (for real: the lease expires). When
    it resumes it must raise LeaseLostError and leave the tags as the new holder sees them."""
    ck = Checkpointer(tmp_path / "ckpt", lease_ttl_s=1.0)
    ck.save(1, {"w": torch.ones(4)})
    ck.save(2, {"w": torch.full((4,), 2.0)})
    if existing is not None:
        ck.tag("best", existing)
    root = ck._session.root
    guard = root.guard
    taken_over: list[Checkpointer] = []

    def guard_then_taken_over(acting: str) -> None:  # the stall right after the last check passed
        guard(acting)
        if not taken_over:
            ck._session.lease._stop.set()  # a stalled job renews nothing
            taken_over.append(Checkpointer(tmp_path / "ckpt", lease_ttl_s=30, lease_wait_s=20))

    root.guard = guard_then_taken_over  # type: ignore[method-assign]
    try:
        with pytest.raises(ckptguard.LeaseLostError):
            ck.tag("best", 2)
        assert taken_over, "the tag never reached its fence"
        assert taken_over[0].tags(refresh=True) == ({} if existing is None else {"best": existing})
    finally:
        for other in taken_over:
            other.close()
        ck.close()


def test_check_lease_passes_for_the_holder_and_refuses_a_reader_a_closed_one_and_a_fenced_one(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ckpt", lease_ttl_s=30)
    ck.check_lease("remove a folder")  # the holder: nothing raised
    with (
        Checkpointer(tmp_path / "ckpt", read_only=True) as reader,
        pytest.raises(ckptguard.CheckpointError, match="read_only"),
    ):
        reader.check_lease()
    lease = Path(ck.root) / ".ckptguard" / "lease.json"
    record = json.loads(lease.read_text())
    record.update(holder="another-job", epoch=record["epoch"] + 1)
    lease.write_text(json.dumps(record))
    with pytest.raises(ckptguard.LeaseLostError, match="refusing to remove a folder"):
        ck.check_lease("remove a folder")
    ck.close()
    with pytest.raises(ckptguard.CheckpointError, match="closed"):
        ck.check_lease()
