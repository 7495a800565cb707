"""Accelerate through ckptguard, against the real accelerate wheel.

Real 2-process training on CPU (torchrun, ``Accelerator(cpu=True)``, gloo), a model with dropout
(so the run depends on every process's RNG), ``ProjectConfiguration(automatic_checkpoint_naming=True,
total_limit=2)``, ``save_state()`` every 2 steps of 8:

- ``CkptguardAccelerator``, rank 0 killed inside the 3rd save (while Accelerate writes optimizer.bin,
  or inside ckptguard's commit): both earlier checkpoints are intact, ``load_state()`` loads the 2nd,
  the state right after it equals the state at that save, and steps 5-8 reproduce the uninterrupted
  run's losses on both processes;
- Accelerate's own ``save_state``, the same kill: it deleted ``checkpoint_0`` before writing
  ``checkpoint_2``, so one intact checkpoint is left, and its ``load_state()`` takes the torn
  ``checkpoint_2`` and dies in ``torch.load``;
- every committed checkpoint corrupt: ``load_state()`` raises ``CorruptCheckpointError`` on both
  processes (the main process finds it, the other learns it as the same class).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.workers import WORKERS

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'ckptguard[accelerate]')")

from tests.support.frameworks import losses, records, tail, torchrun

WORKER = WORKERS / "accelerate_job.py"


def run(project: Path, record: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return torchrun(WORKER, "--project", str(project), "--record", str(record), *args)


def intact(checkpoints: Path) -> list[str]:
    want = {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "random_states_1.pkl"}
    return sorted(p.name for p in checkpoints.iterdir() if {f.name for f in p.iterdir()} >= want)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("acc-ref")
    r = run(d / "p", d / "ref")
    assert r.returncode == 0, tail(r)
    done = next(x for x in records(d / "ref", 0) if x["kind"] == "done")
    assert done["files"] == ["checkpoint_2", "checkpoint_3"]  # total_limit=2, rotated after each commit
    from ckptguard import Checkpointer

    with Checkpointer(d / "p" / ".ckptguard-accelerate", read_only=True) as ck:
        assert ck.steps() == [2, 3]
    return {
        "project": d / "p",
        "losses": [losses(d / "ref", r) for r in (0, 1)],
        "saved": {x["step"]: x["digest"] for x in records(d / "ref", 0) if x["kind"] == "save"},
    }


def test_single_process_save_rotate_and_load_ignore_an_uncommitted_folder(tmp_path: Path) -> None:
    import torch
    from accelerate.utils import ProjectConfiguration

    from ckptguard import Checkpointer, CheckpointError
    from ckptguard.discover import FoundRoot, find_roots
    from ckptguard.integrations.accelerate import CkptguardAccelerator, load_state, save_state

    acc = CkptguardAccelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2),
    )
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.Adam(model.parameters())
    model, optim = acc.prepare(model, optim)
    assert acc.load_state() is None  # a fresh start: the same line a restart runs, nothing to load
    states = []
    for _ in range(3):
        model(torch.randn(4, 3)).sum().backward()
        optim.step()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
        acc.save_state()
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["checkpoint_1", "checkpoint_2"]
    (ckpts / "checkpoint_7").mkdir()  # what Accelerate's own load_state() would take
    with torch.no_grad():
        model.weight.zero_()
    assert acc.load_state() == 2 and acc.save_iteration == 3
    assert all(torch.equal(model.state_dict()[k], v) for k, v in states[2].items())
    assert acc.load_state(str(ckpts / "checkpoint_1")) == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in states[1].items())
    with pytest.raises(CheckpointError, match="step 7 is not a committed checkpoint"):
        acc.load_state(str(ckpts / "checkpoint_7"))
    # without automatic naming: the folder's parent holds the root, its number is the step
    acc.project_configuration.automatic_checkpoint_naming = False
    assert save_state(acc, tmp_path / "manual" / "ckpt_40") == str(tmp_path / "manual" / "ckpt_40")
    assert load_state(acc, tmp_path / "manual") == 40
    with Checkpointer(tmp_path / ".ckptguard-accelerate", read_only=True) as ck:
        assert ck.metadata(2) == {"framework": "accelerate", "folder": "checkpoint_2"}
    assert find_roots(tmp_path) == [
        FoundRoot(str(tmp_path / ".ckptguard-accelerate"), "accelerate"),
        FoundRoot(str(tmp_path / "manual" / ".ckptguard-accelerate"), "accelerate"),
    ]
    assert find_roots(ckpts) == [FoundRoot(str(tmp_path / ".ckptguard-accelerate"), "accelerate")]
    acc.end_training()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["--crash-at-save", "--crash-at-commit"])
def test_kill_inside_a_save_then_resume_reproduces_the_run(tmp_path: Path, reference: dict, fault: str) -> None:
    project = tmp_path / "p"
    crashed = run(project, tmp_path / "crash", fault, "3")
    assert crashed.returncode != 0
    # the kill left both earlier checkpoints, intact, visible and committed
    assert (
        intact(project / "checkpoints")
        == sorted(p.name for p in (project / "checkpoints").iterdir())
        == ["checkpoint_0", "checkpoint_1"]
    )
    resumed = run(project, tmp_path / "res", "--resume")
    assert resumed.returncode == 0, tail(resumed)
    for rank in (0, 1):
        loaded = [r for r in records(tmp_path / "res", rank) if r["kind"] == "loaded"]
        assert [(r["iteration"], r["step"]) for r in loaded] == [(1, 4)]
        assert loaded[0]["digest"] == reference["saved"][4]  # model, AdamW moments, scheduler as saved
        got = losses(tmp_path / "res", rank)
        assert sorted(got) == [5, 6, 7, 8] and all(got[s] == reference["losses"][rank][s] for s in got)
    assert sorted(p.name for p in (project / "checkpoints").iterdir()) == ["checkpoint_2", "checkpoint_3"]


@pytest.mark.slow
@pytest.mark.long  # the framework's own checkpointing failing: docs/integrations.md; CI keeps ckptguard's side
def test_accelerate_default_deletes_the_oldest_first_and_resumes_from_the_torn_one(tmp_path: Path) -> None:
    project = tmp_path / "p"
    crashed = run(project, tmp_path / "crash", "--default", "--crash-at-save", "3")
    assert crashed.returncode != 0
    # total_limit=2: checkpoint_0 was deleted to make room before checkpoint_2 was written
    assert sorted(p.name for p in (project / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
    assert intact(project / "checkpoints") == ["checkpoint_1"]  # one intact checkpoint left, not two
    resumed = run(project, tmp_path / "res", "--default", "--resume")
    # load_state() took the highest-numbered folder, the torn one
    assert resumed.returncode != 0
    assert "load_state" in resumed.stderr and "PytorchStreamReader failed" in resumed.stderr, tail(resumed)


def test_every_committed_checkpoint_corrupt_is_a_corrupt_checkpoint_error_on_both_processes(
    reference: dict, tmp_path: Path
) -> None:
    """The main process finds the corruption; the other one raises the same class, not a generic error,
    so that code catching CorruptCheckpointError takes the same branch on every process."""
    from ckptguard import Checkpointer

    project = tmp_path / "p"
    shutil.copytree(reference["project"], project)
    with Checkpointer(project / ".ckptguard-accelerate", read_only=True) as ck:
        for step in ck.steps():
            data = max((p for p in Path(ck.path(step)).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            data.write_bytes(bytes(raw))
    r = run(project, tmp_path / "rec", "--resume", "--record-load-error")
    assert r.returncode == 0, tail(r)
    got = [next(x for x in records(tmp_path / "rec", rank) if x["kind"] == "load_error") for rank in (0, 1)]
    assert [g["error"] for g in got] == ["CorruptCheckpointError", "CorruptCheckpointError"]
    assert "every committed checkpoint" in got[1]["message"] and "rank 0" in got[1]["message"]
