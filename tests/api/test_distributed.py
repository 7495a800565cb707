"""Multi-process and simulated multi-node behaviour of Checkpointer and save_file (real torchrun jobs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.jobs import JobResult
from tests.support.results import by_rank, job_results
from tests.support.workers import ckpt_job


def test_two_nodes_one_shared_directory_twenty_saves(tmp_path: Path) -> None:
    """OLMo #894's setup: 2 nodes x 2 ranks, one shared root, 20 consecutive saves, no failure."""
    root = tmp_path / "ckpt"
    job = ckpt_job("saves", "--count", "20", "--keep-last", "3", nnodes=2, nproc=2, env={"CKPT_ROOT": str(root)})
    topo = by_rank(job, "topology")
    assert all(t == [[0, 1, 2, 3]] for t in topo.values()), topo  # one storage domain, found by the probe
    saved = [r["saved"] for r in job_results(job) if "saved" in r]
    assert sorted(set(saved)) == list(range(20)) and len(saved) == 80
    assert all(v == 19 for v in by_rank(job, "loaded").values())
    assert sorted(p.name for p in root.iterdir()) == [
        ".ckptguard",
        "latest",
        "step-00000017",
        "step-00000018",
        "step-00000019",
    ]
    assert os.listdir(root / ".ckptguard" / "staging") == []


def test_node_local_disks_each_node_commits_its_own_copy(tmp_path: Path) -> None:
    """Each node has a private root (node-local disk): each leader commits a complete copy, each node loads."""
    roots = [tmp_path / "node0", tmp_path / "node1"]
    job = ckpt_job("saves", "--count", "3", nnodes=2, nproc=2, node_env=[{"CKPT_ROOT": str(r)} for r in roots])
    assert all(t == [[0, 1], [2, 3]] for t in by_rank(job, "topology").values())
    assert all(v == 2 for v in by_rank(job, "loaded").values())
    for i, root in enumerate(roots):
        data = sorted(os.listdir(root / "step-00000002" / "data"))
        writers = {int(n[4:9]) for n in data}
        assert writers <= {2 * i, 2 * i + 1}, data  # each node holds only what its own ranks wrote


def test_per_rank_files_round_trip(tmp_path: Path) -> None:
    root, scratch = tmp_path / "ckpt", tmp_path / "scratch"
    job = ckpt_job("artifacts", nproc=4, env={"CKPT_ROOT": str(root), "CKPT_SCRATCH": str(scratch)})
    assert by_rank(job, "restored") == {0: True, 1: True, 2: True, 3: True}
    stored = sorted(os.listdir(root / "step-00000007" / "files"))
    assert stored == ["rank00000", "rank00001", "rank00002", "rank00003"]


def test_a_value_only_one_rank_cannot_save_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    """Before, rank 1 raised alone while rank 0 went on into the save's collectives."""
    root = tmp_path / "ckpt"
    job = ckpt_job("refused_on_one_rank", nproc=2, env={"CKPT_ROOT": str(root)})
    errors = by_rank(job, "error")
    assert errors[1].startswith("UnsupportedValueError") and "rank 1" in errors[0], job.output()
    assert by_rank(job, "steps") == {0: [2], 1: [2]}


def test_per_rank_files_collision_fails_before_writing(tmp_path: Path) -> None:
    root, scratch = tmp_path / "ckpt", tmp_path / "scratch"
    job = ckpt_job("artifacts", "--collide", nproc=4, env={"CKPT_ROOT": str(root), "CKPT_SCRATCH": str(scratch)})
    errors = by_rank(job, "error")
    assert set(errors) == {0, 1, 2, 3}, job.output()  # every rank raised the same error
    assert len(set(errors.values())) == 1
    msg = errors[0]
    assert "rank 1" in msg and "rank 2" in msg and "offload/shared" in msg and "nothing was written" in msg
    assert all(s == [] for s in by_rank(job, "steps").values())
    assert all(s == [] for s in by_rank(job, "staging").values())  # no attempt directory was even created


def test_save_file_all_ranks_one_path_single_writer(tmp_path: Path) -> None:
    job = ckpt_job("save_file", "--count", "5", nproc=4, env={"CKPT_ROOT": str(tmp_path)})
    assert by_rank(job, "leftovers") == {0: [], 1: [], 2: [], 3: []}


def test_save_file_node_local_one_writer_per_node(tmp_path: Path) -> None:
    roots = [tmp_path / "n0", tmp_path / "n1"]
    ckpt_job(
        "save_file",
        "--count",
        "2",
        "--private-per-node",
        nnodes=2,
        nproc=2,
        node_env=[{"CKPT_ROOT": str(r)} for r in roots],
    )


# CI keeps one phase on each side of the commit point: a non-leader killed mid-write on 1 node x 2 ranks
# (half the processes of 2 x 2, the same path), the leader killed after publishing on 2 nodes x 2 ranks
# (the other node's ranks lose the leader). The campaign's CI slice kills a rank at every phase
# (tests/crash/test_campaign.py). The long run (`pytest -m long`) has the rest of the matrix.
@pytest.mark.parametrize(
    "phase,rank,nnodes",
    [
        pytest.param("before_write", "1", 2, marks=pytest.mark.long),
        ("mid_write", "1", 1),
        pytest.param("mid_write", "3", 2, marks=pytest.mark.long),
        pytest.param("after_write", "2", 2, marks=pytest.mark.long),
        pytest.param("before_publish", "0", 2, marks=pytest.mark.long),
        ("after_publish", "0", 2),
    ],
)
def test_sigkill_during_save_leaves_previous_or_new_checkpoint(
    tmp_path: Path, phase: str, rank: str, nnodes: int
) -> None:
    """SIGKILL one rank at each phase of the 4th save; the restarted job loads a committed step, bitwise."""
    root = tmp_path / "ckpt"
    env = {"CKPT_ROOT": str(root)}
    crashed = ckpt_job(
        "saves",
        "--count",
        "4",
        "--fault",
        f"{phase}:{rank}",
        "--fault-step",
        "3",
        nnodes=nnodes,
        nproc=2,
        env=env,
        check=False,
    )
    assert not crashed.ok
    assert sorted(r["saved"] for r in job_results(crashed) if "saved" in r and r["rank"] == 0) == [0, 1, 2]
    resumed = ckpt_job("resume", nnodes=nnodes, nproc=2, env=env)
    loaded = set(by_rank(resumed, "loaded").values())
    # Before the rename nothing of step 3 is committed; after it, step 3 is.
    assert loaded == ({3} if phase == "after_publish" else {2}), resumed.output()
    assert os.listdir(root / ".ckptguard" / "staging") == []  # the crashed attempt was cleaned up
    committed = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    assert committed == sorted({f"step-0000000{s}" for s in range(0, max(loaded) + 2)})


def test_fsdp2_save_at_world_4_load_at_world_2(tmp_path: Path) -> None:
    env = {"CKPT_ROOT": str(tmp_path / "ckpt"), "CKPT_SCRATCH": str(tmp_path)}
    ckpt_job("fsdp_save", nproc=4, env=env)
    job = ckpt_job("fsdp_load", nproc=2, env=env)
    assert by_rank(job, "loaded") == {0: 2, 1: 2}
    assert all(n == 18 for n in by_rank(job, "optim_tensors").values())  # step, exp_avg, exp_avg_sq x 6 params


def test_per_rank_values_refused_as_plain_and_round_trip_with_per_rank(tmp_path: Path) -> None:
    job = ckpt_job("per_rank", nproc=2, env={"CKPT_ROOT": str(tmp_path / "ckpt")})
    errors = by_rank(job, "plain_error")
    assert errors[0] == errors[1] and "'rng' differs between rank 0 and rank 1" in errors[0]
    assert "PerRank" in errors[0]
    assert by_rank(job, "per_rank_ok") == {0: True, 1: True}
    assert by_rank(job, "steps") == {0: [2], 1: [2]}


# 1 node x 2 ranks in CI (the background write's path does not depend on the node count); 2 x 2 in the long run.
@pytest.mark.parametrize(
    "phase,rank,nnodes",
    [
        ("mid_write", 1, 1),
        pytest.param("mid_write", 1, 2, marks=pytest.mark.long),
        pytest.param("before_publish", 0, 2, marks=pytest.mark.long),
    ],
)
def test_sigkill_during_background_save_keeps_previous_checkpoint(
    tmp_path: Path, phase: str, rank: int, nnodes: int
) -> None:
    """Async saves (blocking=False): a rank killed while the background write runs loses only that save."""
    root = tmp_path / "ckpt"
    env = {"CKPT_ROOT": str(root)}
    crashed = ckpt_job(
        "saves",
        "--count",
        "4",
        "--background",
        "--fault",
        f"{phase}:{rank}",
        "--fault-step",
        "3",
        nnodes=nnodes,
        nproc=2,
        env=env,
        check=False,
    )
    assert not crashed.ok
    resumed = ckpt_job("resume", nnodes=nnodes, nproc=2, env=env)
    assert set(by_rank(resumed, "loaded").values()) == {2}, resumed.output()
    assert os.listdir(root / ".ckptguard" / "staging") == []


def test_background_saves_round_trip_on_two_nodes(tmp_path: Path) -> None:
    job = ckpt_job(
        "saves",
        "--count",
        "5",
        "--background",
        "--keep-last",
        "2",
        nnodes=2,
        nproc=2,
        env={"CKPT_ROOT": str(tmp_path / "ckpt")},
    )
    assert all(v == 4 for v in by_rank(job, "loaded").values())
    assert all(s == [3, 4] for s in by_rank(job, "steps").values())


@pytest.fixture(scope="module")
def subgroups(tmp_path_factory: pytest.TempPathFactory) -> tuple[JobResult, Path]:
    """One 4-rank job, two pipeline stages of 2 ranks, each with a Checkpointer on its own subgroup
    (both tests below read it: a torchrun job of 4 ranks costs ~10 s)."""
    root = tmp_path_factory.mktemp("subgroups")
    return ckpt_job("subgroups", nproc=4, env={"CKPT_ROOT": str(root)}), root


def test_checkpointer_on_a_subgroup(subgroups: tuple[JobResult, Path]) -> None:
    job, root = subgroups
    assert by_rank(job, "stage") == {0: 0, 1: 0, 2: 1, 3: 1}
    assert set(map(tuple, (tuple(map(tuple, t)) for t in by_rank(job, "topology").values()))) == {((0, 1),)}
    assert (root / "stage0" / "step-00000001").is_dir() and (root / "stage1" / "step-00000001").is_dir()


def test_rank_with_nothing_to_write(subgroups: tuple[JobResult, Path]) -> None:
    """One replicated value: DCP gives it to one rank; the other writes no file and still commits."""
    job, root = subgroups
    files = sorted(os.listdir(root / "stage1" / "step-00000001" / "data"))
    assert len(files) == 1 and by_rank(job, "stage")[3] == 1
