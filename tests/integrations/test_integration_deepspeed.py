"""DeepSpeed through ckptguard's checkpoint engine, against the real deepspeed 0.19.8 wheel.

A real 2-rank ZeRO-2 job on CPU (DS_ACCELERATOR=cpu, gloo, torch Adam), a model with dropout, a
checkpoint every 2 steps of 8. Rank 1 is killed inside the 3rd save, before writing its ZeRO
optimizer shard:

- DeepSpeed's own engine: rank 0 has already pointed ``latest`` at global_step6 (it writes
  ``latest`` without waiting for the other ranks' files; the kill waits for that, so the point is
  chosen, not timed); ``load_checkpoint()`` follows ``latest`` into the incomplete tag and dies;
- ckptguard's engine (``install(engine)``): global_step6 never committed, never appeared, and
  ``latest`` still names global_step4; ``load_checkpoint()`` loads it, the state right after the
  load equals the state at that save, and steps 5-8 reproduce the uninterrupted run's losses.

NVMe offload (``tests/workers/deepspeed_nvme_job.py``): DeepSpeed copies each rank's optimizer swap folder into
``<tag>/offloaded_tensors/rank<NN>`` itself (``shutil.copytree``, not through the checkpoint engine) and, on load,
copies it back and calls ``optimizer.reset_swap_buffers()``. A real ``"offload_optimizer": {"device": "nvme"}``
needs DeepSpeed's ``async_io`` op. On this machine as set up (deepspeed 0.19.8, ``DS_BUILD_OPS=0``, no
libaio-dev), ZeRO-3 fails in ``deepspeed.initialize`` on both ranks with::

    RuntimeError: Unable to JIT load the async_io op due to it not being compatible due to hardware/software issue. None

(from ``PartitionedOptimizerSwapper.__init__`` -> ``AsyncIOBuilder().load()``); ZeRO-2 accepts the config and
runs without swapping (``engine.zero_nvme_offload_optimizer()`` is False: ZeRO-2 has no NVMe optimizer
offload). After ``apt-get install libaio-dev`` the op JIT-builds (12 min on 2 cores, cached in
``~/.cache/torch_extensions``) and ZeRO-3 swaps to NVMe for real on CPU; the ``[real]`` tests run then, with
``CKPTGUARD_DEEPSPEED_NVME=1`` (opt-in: torch's JIT loader rebuilds the op wherever its build command differs,
e.g. from a venv at another path, as in CI's fresh clone), and skip otherwise (``aio_op_missing``). The
``[emulated]`` ones emulate only the failing stage, the swapper: a real ZeRO-2 engine gets a stand-in (the worker's
``StandInSwapper``) and DeepSpeed's own save/load code runs unchanged.

- ``test_nvme_offload_kill_after_the_copy_then_resume[emulated|real]``: rank 1 SIGKILLed inside the 3rd save,
  right after DeepSpeed copied its swap folder (when it calls the engine's ``commit``). ``global_step6`` never
  appears; the committed step 4 holds ``offloaded_tensors/rank00`` and ``rank01`` with each rank's exact swap bytes
  of step 4; the resume loads it, each swap folder then holds exactly those bytes (not step 6's) and
  ``reset_swap_buffers`` ran once; step 5's loss reproduces the run, and step 6's too with the stand-in. (DeepSpeed's
  real ZeRO-3 swapper does not keep Adam's ``step`` on NVMe, and its NVMe load skips the ZeRO shards that hold it,
  so after any NVMe resume, with DeepSpeed's own engine too, Adam restarts its step count: step 6 differs.) Before
  the fix, DeepSpeed's copy went into the visible ``save_dir/global_step6`` (left there by the kill) and the
  resume's new save of global_step6 died with ``FileExistsError: ... global_step6/offloaded_tensors/rank01``.
- ``..._node_local_storage_on_a_shared_dir_*`` (2 torchrun agents x 1 process, ``use_node_local_storage``, one
  shared save_dir): DeepSpeed's own engine has both nodes copy into ``offloaded_tensors/rank00``; the second
  ``copytree`` fails with ``FileExistsError`` and the tag holds the first node's bytes only (in ZeRO-2 both nodes
  also write ``mp_rank_00_model_states.pt``, one replacing the other). ckptguard's ``install`` refuses it on every
  rank with ``PathCollisionError`` before anything is written (without that check: ``FileExistsError`` on one
  node with ZeRO-3, ``PathCollisionError`` for ``mp_rank_00_model_states.pt`` on one node with ZeRO-2). DeepSpeed's own
  engine is run with the stand-in only (real ZeRO-3 did the same by hand, FileExistsError on node 1 or node 0).
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.workers import WORKERS

pytest.importorskip(
    "deepspeed",
    reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install --no-build-isolation 'ckptguard[deepspeed]')",
)

from tests.support.frameworks import REPO, losses, records, tail, torchrun
from tests.support.jobs import JobResult, run_job

WORKER = WORKERS / "deepspeed_job.py"


def run(d: Path, record: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return torchrun(WORKER, "--dir", str(d), "--record", str(record), *args, env={"DS_ACCELERATOR": "cpu"})


SHARDS = [
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "zero_pp_rank_1_mp_rank_00_optim_states.pt",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("ds-ref")
    r = run(d / "ck", d / "ref", "--export16")
    assert r.returncode == 0, tail(r)
    # save_16bit_model at step 8 (DeepSpeed wraps it in the engine's create/commit with tag global_step8)
    # once committed an empty global_step8 over the real one; now its file is written beside the tags.
    assert (d / "ck" / "latest").read_text() == "global_step8"
    assert sorted(p.name for p in (d / "ck" / "global_step8").iterdir()) == SHARDS
    exported = torch.load(d / "ck" / "pytorch_model.bin", weights_only=True)
    assert sorted(exported) == ["0.bias", "0.weight", "3.bias", "3.weight"]
    from ckptguard import Checkpointer

    with Checkpointer(d / "ck" / ".ckptguard-deepspeed", read_only=True) as ck:
        assert ck.steps() == [2, 4, 6, 8]
        assert ck.read(step=8)["deepspeed"]["tag"] == "global_step8"
    return {
        "losses": [losses(d / "ref", r) for r in (0, 1)],
        "saved": [{x["step"]: x["digest"] for x in records(d / "ref", r) if x["kind"] == "save"} for r in (0, 1)],
    }


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
@pytest.mark.long  # the framework's own checkpointing failing: docs/integrations.md; CI keeps ckptguard's side
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


# -- NVMe offload: DeepSpeed's offloaded_tensors/rank<NN> copy -----------------------------------------------------

NVME_WORKER = WORKERS / "deepspeed_nvme_job.py"


@functools.cache
def aio_op_missing() -> str | None:
    """Why DeepSpeed's async_io op (its NVMe swapper's I/O) cannot be loaded without building it; None if it can."""
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder.cpu.async_io import AsyncIOBuilder
    from torch.utils.cpp_extension import _get_build_directory

    if installed_ops.get("async_io"):
        return None
    if not AsyncIOBuilder().is_compatible():
        return (
            "DeepSpeed's async_io op cannot be built: 'RuntimeError: Unable to JIT load the async_io op due to it "
            "not being compatible due to hardware/software issue. None' (libaio-dev is not installed)"
        )
    for op in ("async_io", "pin_memory"):
        if not (Path(_get_build_directory(op, verbose=False)) / f"{op}.so").exists():
            return (
                f"DeepSpeed's {op} op is not built (build it once, 12 min on 2 cores: DS_ACCELERATOR=cpu python -c "
                "'from deepspeed.ops.op_builder.cpu.async_io import AsyncIOBuilder; AsyncIOBuilder().load()')"
            )
    return None


@pytest.fixture(params=["emulated", "real"])
def nvme(request: pytest.FixtureRequest) -> list[str]:
    """The worker's arguments for one way of offloading the optimizer to NVMe (module docstring)."""
    if request.param == "real":
        # Opt-in: torch's JIT loader rebuilds the op (12 min on 2 cores) wherever its build command differs,
        # e.g. from a venv at another path than the one it was built from, as in CI's fresh clone.
        if os.environ.get("CKPTGUARD_DEEPSPEED_NVME") != "1":
            pytest.skip(
                "real NVMe offload runs only with CKPTGUARD_DEEPSPEED_NVME=1 (it needs libaio-dev and "
                "DeepSpeed's async_io op built for this venv)"
            )
        if (why := aio_op_missing()) is not None:
            pytest.skip(why)
    return ["--real"] if request.param == "real" else []


def run_nvme(d: Path, record: Path, nvme: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return torchrun(
        NVME_WORKER,
        "--dir",
        str(d / "ck"),
        "--record",
        str(record),
        "--swap",
        str(d / "swap"),
        *nvme,
        *args,
        env={"DS_ACCELERATOR": "cpu"},
    )


def swap_bytes(files: dict[str, str]) -> dict[str, str]:
    """A swap folder's files as DeepSpeed's checkpoint copies them (it skips its '*gradient*' scratch files)."""
    return {k: v for k, v in files.items() if "gradient" not in k}


def digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
def test_nvme_offload_kill_after_the_copy_then_resume(tmp_path: Path, nvme: list[str]) -> None:
    ck = tmp_path / "ck"
    crashed = run_nvme(tmp_path, tmp_path / "crash", nvme, "--steps", "6", "--kill-at-save", "3", "--kill-rank", "1")
    assert crashed.returncode != 0
    assert [r["kind"] for r in records(tmp_path / "crash", 1)][-1] == "swap"  # rank 1 died inside save 3
    assert sorted(p.name for p in ck.glob("global_step*")) == ["global_step2", "global_step4"], tail(crashed)
    assert (ck / "latest").read_text() == "global_step4"
    assert (ck / "zero_to_fp32.py").is_file()  # DeepSpeed's recovery script, moved from the attempt directory
    swapped = [
        {r["step"]: swap_bytes(r["files"]) for r in records(tmp_path / "crash", rank) if r["kind"] == "swap"}
        for rank in (0, 1)
    ]
    from ckptguard import Checkpointer

    with Checkpointer(ck / ".ckptguard-deepspeed", read_only=True) as c:
        assert c.steps() == [2, 4]
        c.load({}, step=4, files={"checkpoint": tmp_path / "step4"})
    for rank in (0, 1):  # the committed step holds each rank's swap folder as it was at that step
        assert digests(tmp_path / "step4" / "offloaded_tensors" / f"rank0{rank}") == swapped[rank][4]
        assert swapped[rank][4] != swapped[rank][6]

    resumed = run_nvme(tmp_path, tmp_path / "res", nvme, "--steps", "6", "--resume")
    assert resumed.returncode == 0, tail(resumed)
    for rank in (0, 1):
        loaded = [r for r in records(tmp_path / "res", rank) if r["kind"] == "loaded"]
        assert [(r["step"], r["resets"]) for r in loaded] == [(4, 1)]  # reset_swap_buffers ran once
        # DeepSpeed copied the loaded tag's bytes into the swap folder, not those of the killed save
        assert swap_bytes(loaded[0]["at_reset"]) == swap_bytes(loaded[0]["after"]) == swapped[rank][4]
        before, after = losses(tmp_path / "crash", rank), losses(tmp_path / "res", rank)
        assert sorted(after) == [5, 6] and after[5] == before[5]
        if not nvme:  # the stand-in swaps Adam's step too; DeepSpeed's ZeRO-3 swapper does not (module docstring)
            assert after[6] == before[6]
    with Checkpointer(ck / ".ckptguard-deepspeed", read_only=True) as c:
        assert c.steps() == [2, 4, 6]  # global_step6 saved again, over the killed save's copy
    assert sorted(p.name for p in (ck / "global_step6" / "offloaded_tensors").iterdir()) == ["rank00", "rank01"]


def two_nodes(d: Path, record: str, *args: str) -> JobResult:
    """2 agents x 1 process (both local rank 0), use_node_local_storage, one shared save_dir, a save at step 2."""
    return run_job(
        NVME_WORKER,
        [
            "--dir",
            str(d / "ck"),
            "--record",
            str(d / record),
            "--swap",
            str(d / "swap"),
            "--node-local",
            "--steps",
            "2",
            *args,
        ],
        nnodes=2,
        nproc_per_node=1,
        timeout=240,
        straggler_grace=30,
        env={"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO / "src")},
    )


def save_errors(d: Path, record: str) -> list[str | None]:
    return [next((r["error"] for r in records(d / record, rank) if r["kind"] == "save_error"), None) for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.long  # the framework's own checkpointing failing: docs/integrations.md; CI keeps ckptguard's side
def test_nvme_offload_node_local_storage_on_a_shared_dir_with_deepspeeds_engine(tmp_path: Path) -> None:
    """Both nodes copy into global_step2/offloaded_tensors/rank00; the second copytree (dirs_exist_ok=False)
    fails, and the tag holds the other node's bytes under that name."""
    assert not two_nodes(tmp_path, "rec", "--default").ok
    errors = save_errors(tmp_path, "rec")
    copied = [rank for rank in (0, 1) if errors[rank] is None or not errors[rank].startswith("FileExistsError")]
    assert len(copied) == 1, errors
    offloaded = tmp_path / "ck" / "global_step2" / "offloaded_tensors"
    assert errors[1 - copied[0]] == f"FileExistsError: [Errno 17] File exists: '{offloaded / 'rank00'}'"
    swapped = [
        swap_bytes(next(r["files"] for r in records(tmp_path / "rec", rank) if r["kind"] == "swap")) for rank in (0, 1)
    ]
    assert [p.name for p in offloaded.iterdir()] == ["rank00"]
    assert digests(offloaded / "rank00") == swapped[copied[0]]


@pytest.mark.slow
def test_nvme_offload_node_local_storage_on_a_shared_dir_is_refused(tmp_path: Path, nvme: list[str]) -> None:
    """ckptguard's engine: every rank refuses before anything is written."""
    job = two_nodes(tmp_path, "rec", *nvme)
    assert not job.ok
    for error in save_errors(tmp_path, "rec"):
        assert error is not None and error.startswith("PathCollisionError: ranks [0, 1] would all copy"), job.output()
        assert "global_step2/offloaded_tensors/rank00" in error
    assert not (tmp_path / "ck" / "global_step2").exists()
    assert not list((tmp_path / "ck").rglob("offloaded_tensors")) and not list((tmp_path / "ck").rglob("*.pt"))
