"""Hugging Face Trainer through ckptguard's CkptguardTrainer, against the real transformers wheel.

Real 2-rank DDP training on CPU (torchrun, gloo), a tiny PreTrainedModel built from code (with dropout,
so the run depends on every rank's RNG), a checkpoint every 2 steps, save_total_limit=2:

- killed inside a commit (rank 0, its data written), the resume loads the previous committed checkpoint,
  the state right after the load equals the state at that save, and the remaining steps reproduce the
  uninterrupted run's losses bit for bit, on both ranks;
- rank 1 killed inside a save before writing its rng_state_1.pth, after rank 0 wrote all of its part:
  Trainer's own get_last_checkpoint takes that checkpoint-6 and its _load_rng_state skips the missing
  file with an info log, so the run silently diverges; CkptguardTrainer never committed step 6 and
  resumes from step 4, reproducing the run.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.workers import WORKERS

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'ckptguard[transformers]')")

from tests.support.frameworks import losses, records, tail, torchrun

WORKER = WORKERS / "hf_job.py"


def run(out: Path, record: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return torchrun(WORKER, "--out", str(out), "--record", str(record), *args)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("hf-ref")
    r = run(d / "out", d / "ref")
    assert r.returncode == 0, tail(r)
    done = next(x for x in records(d / "ref", 0) if x["kind"] == "done")
    # save_total_limit=2: the two newest, visible and committed; nothing else
    assert done["files"] == [".ckptguard-hf", ".ckptguard-hf-staging", "checkpoint-6", "checkpoint-8"]
    from ckptguard import Checkpointer

    with Checkpointer(d / "out" / ".ckptguard-hf", read_only=True) as ck:
        assert ck.steps() == [6, 8]
    return {
        "losses": [losses(d / "ref", r) for r in (0, 1)],
        "saved": {x["step"]: x["digest"] for x in records(d / "ref", 0) if x["kind"] == "save"},
    }


def assert_reproduces(prefix: Path, reference: dict, first: int) -> None:
    for rank in (0, 1):
        got = losses(prefix, rank)
        assert sorted(got) == list(range(first, 9)), got
        assert all(got[s] == reference["losses"][rank][s] for s in got), (rank, got, reference["losses"][rank])


def test_trainer_single_process_resume_ignores_an_uncommitted_checkpoint_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """In-process (world size 1): ``train(resume_from_checkpoint=True)`` on a fresh start trains from
    scratch with one log line; a torn checkpoint-N directory (what Trainer's get_last_checkpoint would
    take) is never resumed from; naming it explicitly is refused; the committed one resumes; ``ckptguard
    ls`` on output_dir shows the root and Trainer's global step."""
    sys.path.insert(0, str(WORKER.parent))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    import hf_job
    from transformers import TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    from ckptguard import CheckpointError

    def trainer(max_steps: int) -> hf_job.RecordingCkptguardTrainer:
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"),
            max_steps=max_steps,
            per_device_train_batch_size=4,
            learning_rate=0.05,
            save_strategy="steps",
            save_steps=2,
            save_total_limit=1,
            report_to=[],
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
        )
        hf_job.RecordingCkptguardTrainer.log_prefix = str(tmp_path / "rec")
        return hf_job.RecordingCkptguardTrainer(
            model=hf_job.TinyModel(hf_job.TinyConfig()), args=args, train_dataset=hf_job.Data()
        )

    with caplog.at_level(logging.INFO, logger="ckptguard"):
        trainer(4).train(resume_from_checkpoint=True)  # the same line a restart runs
    fresh = [r.getMessage() for r in caplog.records if "no committed checkpoint" in r.getMessage()]
    assert len(fresh) == 1 and "training from scratch" in fresh[0]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]  # limit 1: the newest
    torn = out / "checkpoint-6"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"torn")
    assert get_last_checkpoint(str(out)) == str(torn)  # Trainer's own choice
    with pytest.raises(CheckpointError, match="step 6 is not a committed checkpoint"):
        trainer(6).train(resume_from_checkpoint=str(torn))
    t = trainer(6)
    t.train(resume_from_checkpoint=True)
    loaded = [r for r in records(tmp_path / "rec", 0) if r["kind"] == "loaded"]
    assert [(r["step"], r["path"]) for r in loaded] == [(4, "checkpoint-4")]
    saved4 = [r["digest"] for r in records(tmp_path / "rec", 0) if r["kind"] == "save" and r["step"] == 4]
    assert loaded[0]["digest"] == saved4[0]
    # the torn directory was replaced by the committed checkpoint-6, and the limit rotated checkpoint-4 out
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6"]
    assert (out / "checkpoint-6" / "optimizer.pt").exists()
    listed = subprocess.run(
        [sys.executable, "-m", "ckptguard", "ls", str(out), "--json"], capture_output=True, text=True, timeout=120
    )
    assert listed.returncode == 0, listed.stderr
    (doc,) = json.loads(listed.stdout)["roots"]  # output_dir holds the root: one entry per root found
    assert doc["framework"] == "transformers" and doc["root"] == str(out / ".ckptguard-hf")
    meta = doc["checkpoints"][-1]["user_metadata"]
    assert meta["global_step"] == 6 and meta["framework"] == "transformers" and meta["epoch"] > 0


@pytest.mark.slow
def test_ddp_kill_inside_a_commit_then_resume_reproduces_the_run(tmp_path: Path, reference: dict) -> None:
    out = tmp_path / "out"
    # saves at steps 2, 4, 6, 8: rank 0 dies inside the 3rd (step 6), data written, before the commit
    crashed = run(out, tmp_path / "crash", "--crash-at-save", "3")
    assert crashed.returncode != 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    resumed = run(out, tmp_path / "res", "--resume")
    assert resumed.returncode == 0, tail(resumed)
    for rank in (0, 1):
        loaded = [r for r in records(tmp_path / "res", rank) if r["kind"] == "loaded"]
        assert [r["step"] for r in loaded] == [4]
        assert loaded[0]["digest"] == reference["saved"][4]  # model, Adam moments, scheduler as saved
    assert_reproduces(tmp_path / "res", reference, 5)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]


@pytest.mark.slow
@pytest.mark.long  # the framework's own checkpointing failing: docs/integrations.md; CI keeps ckptguard's side
def test_trainer_default_resumes_from_a_checkpoint_missing_a_rank_file(tmp_path: Path, reference: dict) -> None:
    # Trainer's own checkpointing: rank 1 dies in the 3rd save (step 6) before writing rng_state_1.pth.
    out = tmp_path / "default"
    crashed = run(out, tmp_path / "dcrash", "--default", "--default-crash-at-save", "3")
    assert crashed.returncode != 0
    files = sorted(p.name for p in (out / "checkpoint-6").iterdir())
    assert "rng_state_1.pth" not in files and "trainer_state.json" in files, files
    resumed = run(out, tmp_path / "dres", "--default", "--resume")
    assert resumed.returncode == 0, tail(resumed)  # no error at all
    loaded = [r for r in records(tmp_path / "dres", 1) if r["kind"] == "loaded"]
    assert [r["step"] for r in loaded] == [6]  # get_last_checkpoint took the incomplete checkpoint
    got = losses(tmp_path / "dres", 1)
    # rank 1's dropout RNG was not restored: its losses leave the uninterrupted run's at once
    assert got[7] != reference["losses"][1][7], (got, reference["losses"][1])
    assert losses(tmp_path / "dres", 0)[8] != reference["losses"][0][8]


@pytest.mark.slow
def test_a_rank_killed_before_its_rng_file_leaves_the_checkpoint_uncommitted_and_the_resume_reproduces_the_run(
    tmp_path: Path, reference: dict
) -> None:
    # CkptguardTrainer, the fault that makes Trainer's own checkpointing resume from a checkpoint missing
    # rank 1's rng_state_1.pth (the long test above): step 6 never committed, the resume takes step 4 and
    # reproduces the run.
    out = tmp_path / "ckptguard"
    crashed = run(out, tmp_path / "crash", "--default-crash-at-save", "3")
    assert crashed.returncode != 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    resumed = run(out, tmp_path / "res", "--resume")
    assert resumed.returncode == 0, tail(resumed)
    assert [r["step"] for r in records(tmp_path / "res", 1) if r["kind"] == "loaded"] == [4]
    assert_reproduces(tmp_path / "res", reference, 5)


def test_switching_a_plain_trainer_run_to_ckptguard_resumes_it_and_keeps_its_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run saved by plain ``Trainer`` and restarted as ``CkptguardTrainer`` with ``resume_from_checkpoint=True``
    continues from its newest plain checkpoint (not from scratch), and ckptguard's rotation never deletes the
    plain ``checkpoint-N`` directories it did not write."""
    sys.path.insert(0, str(WORKER.parent))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    import hf_job
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ckptguard import Checkpointer
    from ckptguard.integrations.hf import CkptguardTrainer

    out = tmp_path / "out"

    class Steps(TrainerCallback):
        ran = 0

        def on_step_end(self, *args: object, **kwargs: object) -> None:
            Steps.ran += 1

    def make(cls: type, max_steps: int) -> Trainer:
        args = TrainingArguments(
            output_dir=str(out),
            max_steps=max_steps,
            per_device_train_batch_size=4,
            save_strategy="steps",
            save_steps=2,
            save_total_limit=2,
            report_to=[],
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
        )
        return cls(
            model=hf_job.TinyModel(hf_job.TinyConfig()), args=args, train_dataset=hf_job.Data(), callbacks=[Steps()]
        )

    make(Trainer, 4).train()
    plain = {p.name: (p / "trainer_state.json").read_bytes() for p in out.glob("checkpoint-*")}
    assert sorted(plain) == ["checkpoint-2", "checkpoint-4"]
    Steps.ran = 0
    t = make(CkptguardTrainer, 8)
    t.train(resume_from_checkpoint=True)
    assert Steps.ran == 4 and t.state.global_step == 8  # continued from step 4, not from scratch
    assert {n: (out / n / "trainer_state.json").read_bytes() for n in plain} == plain  # untouched
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
        "checkpoint-8",
    ]
    with Checkpointer(out / ".ckptguard-hf", read_only=True) as ck:
        assert ck.steps() == [6, 8]


def test_resume_from_checkpoint_through_another_spelling_of_output_dir_is_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A symlink to output_dir, ``..`` components or a trailing slash name the same directory: a torn
    checkpoint-N named through any of them is refused like the canonical path, never handed to Trainer."""
    sys.path.insert(0, str(WORKER.parent))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    import hf_job
    from transformers import TrainingArguments

    from ckptguard import CheckpointError

    out = tmp_path / "out"

    def trainer(max_steps: int) -> hf_job.RecordingCkptguardTrainer:
        args = TrainingArguments(
            output_dir=str(out),
            max_steps=max_steps,
            per_device_train_batch_size=4,
            learning_rate=0.05,
            save_strategy="steps",
            save_steps=2,
            save_total_limit=1,
            report_to=[],
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
        )
        hf_job.RecordingCkptguardTrainer.log_prefix = str(tmp_path / "rec")
        return hf_job.RecordingCkptguardTrainer(
            model=hf_job.TinyModel(hf_job.TinyConfig()), args=args, train_dataset=hf_job.Data()
        )

    trainer(2).train()
    torn = out / "checkpoint-4"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"torn")
    (tmp_path / "link").symlink_to(out)
    (tmp_path / "sub").mkdir()
    for spelling in (
        tmp_path / "link" / "checkpoint-4",
        f"{tmp_path}/sub/../out/checkpoint-4/",
        f"{tmp_path}/link/../out/checkpoint-4",
    ):
        with pytest.raises(CheckpointError, match="step 4 is not a committed checkpoint"):
            trainer(6).train(resume_from_checkpoint=str(spelling))
    trainer(4).train(resume_from_checkpoint=str(tmp_path / "link" / "checkpoint-2"))
    loaded = [r for r in records(tmp_path / "rec", 0) if r["kind"] == "loaded"]
    assert [r["step"] for r in loaded] == [2]
