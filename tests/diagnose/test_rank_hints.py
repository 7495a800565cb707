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


def _capture(directory: Path, name: str, lines: list[tuple[float, str]]) -> None:
    """A stream as `ckptguard run` keeps it: the bytes, and the arrival time of each read."""
    data, stamps = b"", []
    for t, text in lines:
        stamps.append(f"{len(data)} {t:.6f}\n")
        data += text.encode() + b"\n"
    (directory / f"{name}.log").write_bytes(data)
    (directory / f".{name}.times").write_text("".join(stamps))


def test_run_capture_orders_ranks_by_arrival_time(tmp_path: Path) -> None:
    """Two nodes' captures, no timestamps in the lines: rank 1's error reached the runner 40 s
    before rank 0's, so rank 1 failed first, whatever the order of the files."""
    t0 = 1_750_000_000.0
    tb = "[rank{r}]: Traceback (most recent call last):", '[rank{r}]:   File "t.py", line 3, in <module>'
    _capture(
        tmp_path,
        "node0",
        [
            (t0, "[rank0]: step 10 loss 2.0"),
            *((t0 + 50, x.format(r=0)) for x in tb),
            (t0 + 50, "[rank0]: OSError: [Errno 28] No space left on device: '/ckpt/x'"),
        ],
    )
    _capture(
        tmp_path,
        "node1",
        [
            (t0, "[rank1]: step 10 loss 2.0"),
            *((t0 + 10, x.format(r=1)) for x in tb),
            (t0 + 10, "[rank1]: torch.OutOfMemoryError: CUDA out of memory."),
        ],
    )
    d = diagnose([str(tmp_path)])
    assert (d.failure_class, d.initiating_rank) == ("cuda_oom", 1)
    assert d.ordering_basis == "timestamps of the failure lines"
