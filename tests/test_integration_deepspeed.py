"""DeepSpeed through ckptguard's checkpoint engine (issue 14), against the real deepspeed 0.19.8 wheel.

A real 2-rank ZeRO-2 job on CPU (DS_ACCELERATOR=cpu, gloo, torch Adam), a model with dropout, a
checkpoint every 2 steps of 8. Rank 1 is killed inside the 3rd save, before writing its ZeRO
optimizer shard:

- DeepSpeed's own engine: rank 0 has already pointed ``latest`` at global_step6 (it writes
  ``latest`` without waiting for the other ranks' files; the kill waits for that, so the point is
  chosen, not timed); ``load_checkpoint()`` follows ``latest`` into the incomplete tag and dies;
- ckptguard's engine (``install(engine)``): global_step6 never committed, never appeared, and
  ``latest`` still names global_step4; ``load_checkpoint()`` loads it, the state right after the
  load equals the state at that save, and steps 5-8 reproduce the uninterrupted run's losses.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install --no-build-isolation "
                                        "'ckptguard[deepspeed]')")

from tests.support.frameworks import losses, records, tail, torchrun

WORKER = Path(__file__).parent / "workers" / "deepspeed_job.py"


def run(d: Path, record: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return torchrun(WORKER, "--dir", str(d), "--record", str(record), *args, env={"DS_ACCELERATOR": "cpu"})


SHARDS = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
          "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("ds-ref")
    r = run(d / "ck", d / "ref")
    assert r.returncode == 0, tail(r)
    assert (d / "ck" / "latest").read_text() == "global_step8"
    assert sorted(p.name for p in (d / "ck" / "global_step8").iterdir()) == SHARDS
    from ckptguard import Checkpointer

    with Checkpointer(d / "ck" / ".ckptguard-deepspeed", read_only=True) as ck:
        assert ck.steps() == [2, 4, 6, 8]
    return {"losses": [losses(d / "ref", r) for r in (0, 1)],
            "saved": [{x["step"]: x["digest"] for x in records(d / "ref", r) if x["kind"] == "save"} for r in (0, 1)]}


@pytest.mark.slow
def test_zero2_kill_inside_a_save_then_resume_reproduces_the_run(tmp_path: Path, reference: dict) -> None:
    d = tmp_path / "ck"
    crashed = run(d, tmp_path / "crash", "--crash-at-save", "3")
    assert crashed.returncode != 0
    assert sorted(p.name for p in d.glob("global_step*")) == ["global_step2", "global_step4"]
    assert (d / "latest").read_text() == "global_step4"
    resumed = run(d, tmp_path / "res", "--resume")
    assert resumed.returncode == 0, tail(resumed)
    for rank in (0, 1):
        loaded = [r for r in records(tmp_path / "res", rank) if r["kind"] == "loaded"]
        assert [(r["step"], r["path"]) for r in loaded] == [(4, "global_step4/mp_rank_00_model_states.pt")]
        assert loaded[0]["digest"] == reference["saved"][rank][4]  # model and this rank's Adam partition
        got = losses(tmp_path / "res", rank)
        assert sorted(got) == [5, 6, 7, 8] and all(got[s] == reference["losses"][rank][s] for s in got)
    assert (d / "latest").read_text() == "global_step8"


@pytest.mark.slow
def test_deepspeed_default_latest_names_an_incomplete_tag(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    crashed = run(d, tmp_path / "crash", "--default", "--crash-at-save", "3")
    assert crashed.returncode != 0
    assert (d / "latest").read_text() == "global_step6"  # rank 0 moved it before rank 1's shard existed
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" not in {p.name for p in (d / "global_step6").iterdir()}
    resumed = run(d, tmp_path / "res", "--default", "--resume")
    assert resumed.returncode != 0
    assert "FileNotFoundError" in resumed.stderr and "global_step6/zero_pp_rank_1" in resumed.stderr, tail(resumed)


def test_engine_refuses_two_ranks_writing_one_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-rank isolation check, in-process: a second write of one path in one save is refused."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    from ckptguard import Checkpointer, PathCollisionError
    from ckptguard.integrations.deepspeed import CkptguardCheckpointEngine

    ce = CkptguardCheckpointEngine()
    info = CheckpointCommitInfo(tag="global_step3", save_dir=str(tmp_path), save_latest=True)
    ce.create(info)
    ce.makedirs(str(tmp_path / "global_step3"), exist_ok=True)
    ce.save({"w": 1}, str(tmp_path / "global_step3" / "mp_rank_00_model_states.pt"))
    assert not (tmp_path / "global_step3").exists()  # nothing visible before the commit
    with pytest.raises(PathCollisionError, match="already written by another rank"):
        ce.save({"w": 2}, str(tmp_path / "global_step3" / "mp_rank_00_model_states.pt"))
    assert ce.commit(info)
    assert (tmp_path / "latest").read_text() == "global_step3"
    assert ce.load(str(tmp_path / "global_step3" / "mp_rank_00_model_states.pt")) == {"w": 1}
    ce.cleanup()
    with Checkpointer(tmp_path / ".ckptguard-deepspeed", read_only=True) as ck:
        assert ck.steps() == [3] and ck.read()["deepspeed"]["tag"] == "global_step3"
