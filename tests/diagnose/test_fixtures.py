"""Every real fixture (produced by tools/diagnose_fixtures/generate.py) and the OLMo #894 seed.

Each case asserts the failure class, the initiating rank and the collateral ranks.
"""

from __future__ import annotations

import pytest

from ckptguard.diagnose.engine import diagnose

from .conftest import FIXTURES, SEED, cli_json

# fixture -> (class, initiating rank, collateral ranks, ranks that failed the same way on their own)
CASES: dict[str, tuple[str, int | None, list[int], list[int]]] = {
    "exception_keyerror.log": ("python_exception", 2, [0, 1, 3], []),
    "sigkill_rank1.log": ("host_oom_sigkill", 1, [0, 2, 3], []),
    "oom_cgroup.log": ("host_oom_sigkill", 1, [0, 2, 3], []),
    "segfault_rank3.log": ("segfault", 3, [0, 1, 2], []),
    "disk_full_rank0.log": ("disk_full_enospc", 0, [1, 2, 3], []),
    "dir_race_2nodes.log": ("checkpoint_write_race", 2, [0, 1, 3], []),
    "copytree_race.log": ("checkpoint_write_race", 3, [2], [0, 1]),
    "torch_save_same_path": ("checkpoint_write_race", 0, [], [1, 2, 3]),
    "corrupt_load.log": ("checkpoint_corrupt_load", 3, [], [0, 1, 2]),
    "permission_denied.log": ("permission_denied_checkpoint_dir", 0, [1, 2, 3], []),
    "port_in_use.log": ("rendezvous_failure", None, [], []),
    "rdzv_timeout.log": ("rendezvous_failure", None, [], []),
    "gloo_timeout.log": ("nccl_watchdog_timeout", 3, [0, 1, 2], []),
    "gloo_bad_ifname.log": ("nccl_network_error", 2, [], [0, 1, 3]),
    "dataloader_killed.log": ("dataloader_worker_killed", 2, [0, 1, 3], []),
    # /dev/shm exhaustion is its own class, whoever uses the segment
    "dataloader_shm_full.log": ("shm_exhausted", 1, [0, 2, 3], []),
    "loss_nan.log": ("loss_nan_divergence", 1, [0, 2, 3], []),
    # the users' class (family) is the generic exception; the KB's finer class stays the kind
    "import_error.log": ("python_exception", 3, [], [0, 1, 2]),
    "cuda_unavailable.log": ("python_exception", 0, [], [1, 2, 3]),
    # small inline jobs (tests/diagnose/make_small_job_fixtures.py)
    "empty_ckpt_load.log": ("checkpoint_corrupt_load", 0, [], [1]),
    "state_dict_size_mismatch.log": ("state_dict_mismatch", 0, [], [1]),
    "rename_not_empty.log": ("checkpoint_write_race", 1, [0], []),
    "dcp_size_mismatch.log": ("state_dict_mismatch", 0, [], [1]),
    "spawn_sigkill.log": ("host_oom_sigkill", 1, [], []),
    "demo_sigkill": ("host_oom_sigkill", 3, [0, 1, 2], []),
    # `ckptguard run` log directories of 4- and 2-rank torchrun jobs (tests/workers/run_target_job.py)
    "runner_raise_rank3": ("python_exception", 3, [0, 1, 2], []),
    "runner_storage_error_rank2": ("python_exception", 2, [0, 1, 3], []),
    "runner_sigkill_rank2": ("host_oom_sigkill", 2, [0, 1, 3], []),
    "runner_hang_rank1_of4": ("nccl_watchdog_timeout", 1, [0, 2, 3], []),
    "runner_hang_rank1_of2": ("nccl_watchdog_timeout", 1, [0], []),
}

# fixture -> the KB's finer class (``kind``) where it is a split of the answered family
KINDS = {"import_error.log": "import_error", "cuda_unavailable.log": "cuda_unavailable"}


def test_every_fixture_has_a_case() -> None:
    on_disk = {p.name for p in FIXTURES.iterdir() if p.name not in ("README.md", SEED.name)}
    assert on_disk == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fixture_engine(name: str) -> None:
    cls, init, collateral, also = CASES[name]
    d = diagnose([str(FIXTURES / name)])
    assert d.found
    assert (d.failure_class, d.kind) == (cls, KINDS.get(name, cls))
    assert d.initiating_rank == init
    assert d.collateral_ranks == collateral
    assert d.also_failed_ranks == also
    assert d.evidence, "a diagnosis always shows its evidence lines"
    assert all(e.line > 0 and e.file for e in d.evidence)


@pytest.mark.parametrize("name", ["dir_race_2nodes.log", "oom_cgroup.log", "gloo_timeout.log", "torch_save_same_path"])
def test_fixture_cli_json(runner, name: str) -> None:
    cls, init, collateral, _ = CASES[name]
    code, out = cli_json(runner, str(FIXTURES / name))
    assert code == 0
    assert (out["failure_class"], out["initiating_rank"], out["collateral_ranks"]) == (cls, init, collateral)
    for key in ("schema_version", "confidence", "evidence", "root_cause", "fix", "verify_command", "alternatives"):
        assert key in out


def test_seed_olmo_894(runner) -> None:
    """The real OLMo #894 log: rank 8 on the second node, ranks 9-15 SIGTERMed by torchrun."""
    code, out = cli_json(runner, str(SEED))
    assert code == 0
    assert out["failure_class"] == "checkpoint_write_race"
    assert out["initiating_rank"] == 8
    assert out["collateral_ranks"] == list(range(9, 16))
    texts = [e["text"] for e in out["evidence"] if e["role"] == "initiating"]
    assert any("FileNotFoundError" in t and "step0-tmp' -> '" in t and "/step0'" in t for t in texts)
    assert "one leader per filesystem" in out["fix"].lower()
    assert "OLMO_SHARED_FS=1" in out["fix"]
    assert out["checkpointer_switch"].splitlines()[0] == "from ckptguard import Checkpointer"
    assert out["initiating_host"].startswith("NH-DC-NM129")
    assert out["confidence"] >= 0.7


def test_seed_text_output_names_checkpointer(runner) -> None:
    from ckptguard.cli import app

    result = runner.invoke(app, ["diagnose", str(SEED)])
    assert result.exit_code == 0
    assert "rank 8" in result.stdout
    assert "Checkpointer(" in result.stdout


def test_multiple_inputs_merge(runner) -> None:
    """Two sources of one run (per-rank dir + console) read as one job."""
    d = diagnose([str(FIXTURES / "torch_save_same_path" / "0"), str(FIXTURES / "torch_save_same_path" / "console.log")])
    assert d.failure_class in ("checkpoint_write_race", "python_exception")
    assert d.initiating_rank == 0
