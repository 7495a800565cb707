"""Every rank hint a log gives, with the hint that decided it in `rank_attribution`: logs written
in each shape (the launcher formats of the DeepSpeed and Slurm cases are in test_newcomer.py and
test_variants.py)."""

from __future__ import annotations

from pathlib import Path

from ckptguard.diagnose.engine import diagnose

LOGS = Path(__file__).parent / "rank_hints"


def test_host_n_prefix_gives_rank_and_host() -> None:
    d = diagnose([str(LOGS / "host_n_prefix.log")])
    assert (d.failure_class, d.initiating_rank, d.initiating_host) == ("cuda_illegal_memory_access", 3, "node-b")
    assert d.rank_attribution.startswith("from the rank prefix")


def test_desync_names_the_one_rank_in_another_collective() -> None:
    """SeqNum=100: ALLREDUCE on ranks 0, 1, 3 and BROADCAST on rank 2: rank 2 is out of step."""
    d = diagnose([str(LOGS / "desync_one_rank_other_op.log")])
    assert (d.failure_class, d.initiating_rank) == ("collective_mismatch_desync", 2)
    assert "same sequence number" in d.rank_attribution and "BROADCAST" in d.rank_attribution


def test_first_watchdog_by_timestamp() -> None:
    """Every rank of the job reports the timeout, none is missing: the first by its own timestamp."""
    d = diagnose([str(LOGS / "watchdog_first_by_time.log")])
    assert (d.failure_class, d.initiating_rank) == ("nccl_watchdog_timeout", 2)
    assert "timestamps" in d.rank_attribution


def test_same_timestamps_name_no_rank(tmp_path: Path) -> None:
    """Two ranks dated the same moment: no first rank is made up."""
    text = (LOGS / "watchdog_first_by_time.log").read_text().replace("10:30:01.", "10:30:05.")
    (tmp_path / "tie.log").write_text(text)
    d = diagnose([str(tmp_path / "tie.log")])
    assert (d.failure_class, d.initiating_rank) == ("nccl_watchdog_timeout", None)
