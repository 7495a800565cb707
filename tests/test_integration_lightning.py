"""Lightning through ckptguard's CheckpointIO (issue 14), against the real lightning wheel.

Real 2-rank DDP training on CPU (torchrun, gloo): train, checkpoint every epoch with
ModelCheckpoint(save_top_k=2, save_last=True), kill rank 0 inside a save at a chosen point,
resume with ckpt_path="last": the state right after the load equals the state at that save
(model and Adam moments), and the following steps reproduce the uninterrupted run's losses.
Lightning's own TorchCheckpointIO, killed at the same place (across filesystems, as on
NFS/Lustre), leaves a torn last.ckpt that the resume picks and fails on.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning", reason="lightning is not installed (pip install 'ckptguard[lightning]')")

from ckptguard import Checkpointer  # noqa: E402
from ckptguard.integrations.lightning import CkptguardCheckpointIO, read_pointer  # noqa: E402

from tests.support.frameworks import torchrun  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "lightning_job.py"


def run(root: Path, out: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return torchrun(WORKER, "--root", str(root), "--out", str(out), *args, env=env)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out) if r["kind"] == "loss"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    d = tmp_path_factory.mktemp("ref")
    r = run(d / "ck", d / "ref.jsonl")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    done = next(x for x in records(d / "ref.jsonl") if x["kind"] == "done")
    # top-k kept the 2 newest, save_last the pointer; removed ones are gone with their data
    assert done["files"] == [".ckptguard-lightning", "epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"]
    with Checkpointer(d / "ck" / ".ckptguard-lightning", read_only=True) as ck:
        assert sorted(ck.tags()) == ["epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"]
        assert len(ck.steps()) == 3
    return losses(d / "ref.jsonl")


def test_plugin_round_trip_of_a_lightning_checkpoint_dict(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optim.step()
    ckpt = {"epoch": 1, "global_step": 4, "pytorch-lightning_version": L.__version__,
            "state_dict": model.state_dict(), "optimizer_states": [optim.state_dict()],
            "lr_schedulers": [], "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 2}}}},
            "callbacks": {"ModelCheckpoint{'monitor': 'gstep', 'mode': 'max'}": {"best_k_models": {}}},
            "hyper_parameters": {"lr": 0.05, "sizes": (4, 8)}}
    io = CkptguardCheckpointIO()
    path = tmp_path / "epoch=1-step=4.ckpt"
    io.save_checkpoint(ckpt, path)
    assert read_pointer(str(path))["tag"] == "epoch=1-step=4.ckpt"
    got = io.load_checkpoint(path)
    st = got["optimizer_states"][0]["state"]
    assert set(st) == {0, 1} and torch.equal(st[0]["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])
    assert got["hyper_parameters"]["sizes"] == (4, 8) and got["loops"] == ckpt["loops"]
    assert got["callbacks"] == ckpt["callbacks"]
    io.save_checkpoint(got, tmp_path / "last.ckpt")  # what was read saves again
    io.save_checkpoint(got, tmp_path / "last.ckpt")  # replacing last.ckpt drops the old data
    io.remove_checkpoint(path)
    assert not path.exists()
    io.teardown()
    with Checkpointer(tmp_path / ".ckptguard-lightning", read_only=True) as ck:
        assert list(ck.tags()) == ["last.ckpt"] and len(ck.steps()) == 1


def test_a_crash_between_the_tag_and_the_pointer_leaves_the_old_checkpoint_loadable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pointer is the commit point Lightning sees: a save that moved the tag but died before
    replacing the pointer leaves the pointer's checkpoint, and the resume loads it."""
    import ckptguard.integrations.lightning as lt

    path = tmp_path / "last.ckpt"
    io = CkptguardCheckpointIO()
    io.save_checkpoint({"global_step": 2, "w": torch.ones(2)}, path)

    def die(*args: object) -> None:
        raise OSError("killed before the pointer was replaced")

    monkeypatch.setattr(lt, "replace_file", die)
    with pytest.raises(OSError, match="killed"):
        io.save_checkpoint({"global_step": 4, "w": torch.zeros(2)}, path)
    io.teardown()
    monkeypatch.undo()
    got = CkptguardCheckpointIO().load_checkpoint(path)
    assert got["global_step"] == 2 and torch.equal(got["w"], torch.ones(2))


def test_removing_a_link_to_a_checkpoint_keeps_the_checkpoint(tmp_path: Path) -> None:
    """ModelCheckpoint(save_last="link") makes last.ckpt a symlink to the newest top-k pointer."""
    io = CkptguardCheckpointIO()
    top = tmp_path / "epoch=0-step=2.ckpt"
    io.save_checkpoint({"global_step": 2}, top)
    (tmp_path / "last.ckpt").symlink_to(top.name)
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 2
    io.remove_checkpoint(tmp_path / "last.ckpt")
    assert not (tmp_path / "last.ckpt").exists() and io.load_checkpoint(top)["global_step"] == 2
    io.teardown()


@pytest.mark.slow
def test_ddp_kill_inside_a_save_then_resume_reproduces_the_run(tmp_path: Path, reference: dict[int, float]) -> None:
    root, out = tmp_path / "ck", tmp_path / "run.jsonl"
    # Saves: 2 per epoch (top-k, then last). The 5th is epoch 2's top-k checkpoint: rank 0 dies with its
    # data written, before the commit.
    crashed = run(root, out, "--crash-at-save", "5")
    assert crashed.returncode != 0
    saved = {r["step"]: r["digest"] for r in records(out) if r["kind"] == "save"}
    assert read_pointer(str(root / "last.ckpt"))["name"] == "last.ckpt"
    resumed = run(root, tmp_path / "resume.jsonl", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    after = records(tmp_path / "resume.jsonl")
    loaded = [r for r in after if r["kind"] == "loaded"]
    assert [r["step"] for r in loaded] == [4]  # the last committed checkpoint
    assert loaded[0]["digest"] == saved[4]  # model and optimizer moments exactly as saved
    got = losses(tmp_path / "resume.jsonl")
    assert sorted(got) == [5, 6, 7, 8] and all(got[s] == reference[s] for s in got), (got, reference)


@pytest.mark.slow
def test_lightning_default_io_resumes_from_a_torn_last_ckpt(tmp_path: Path) -> None:
    """The same kind of fault without ckptguard: TMPDIR on another filesystem (/dev/shm), rank 0 killed
    halfway through copying its 4th checkpoint (epoch 1's last.ckpt) into place."""
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's temporary directory")
    root, env = tmp_path / "ck", {"TMPDIR": "/dev/shm"}
    crashed = run(root, tmp_path / "run.jsonl", "--default-io", "--crash-at-save", "4", env=env)
    assert crashed.returncode != 0
    size = (root / "last.ckpt").stat().st_size
    resumed = run(root, tmp_path / "resume.jsonl", "--default-io", "--resume", env=env)
    # ckpt_path="last" picks the torn file: the resume dies in torch.load
    assert resumed.returncode != 0 and size > 0
    assert "torch_io.py" in resumed.stderr and "load_checkpoint" in resumed.stderr, resumed.stderr[-3000:]
    assert any(m in resumed.stderr for m in ("Invalid argument", "PytorchStreamReader failed",
                                             "failed finding central directory")), resumed.stderr[-3000:]
