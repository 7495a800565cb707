"""Exceptions that a process survived do not hide, or outrank, the one it died of.

Two shapes: Python's ``Exception ignored in: ...`` report (only the exception printed right after
it is ignored), and a record logged at warning level that names an exception it handled. Each is
checked in the launchers' line styles (``[rankN]:``, ``srun --label``'s ``N: ``, per-rank files
with no prefix), with and without a timestamp on every line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptguard.diagnose.engine import diagnose

STYLES = ("rank", "label", "files")
STAMPS = (False, True)


def oom_traceback(gpu: int) -> list[str]:
    return [
        "Traceback (most recent call last):",
        '  File "/workspace/train.py", line 377, in main',
        "    loss = model(batch).loss",
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU {gpu} has a total "
        "capacity of 79.15 GiB of which 1.21 GiB is free.",
    ]


WATCHDOG = (
    "[E0501 10:17:12.219151 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=81234, OpType=ALLREDUCE, NumelIn=262144, NumelOut=262144, Timeout(ms)=600000) ran for "
    "600713 milliseconds before timing out."
)
IGNORED = "Exception ignored in: <function _MultiProcessingDataLoaderIter.__del__ at 0x7f3f6455c757>"
RENAME_TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/workspace/train.py", line 301, in save_checkpoint',
    "    os.rename(tmp_dir, final_dir)",
    "FileNotFoundError: [Errno 2] No such file or directory: '/ckpt/run7/step12000-tmp' -> '/ckpt/run7/step12000'",
]


def write_log(tmp_path: Path, style: str, stamped: bool, records: list[tuple[int, str]]) -> str:
    """The records ``(rank, text)`` as one job's log in ``style``; returns the path to diagnose.

    Stamped: the progress records (``step ...``) are logging records with their time, and in the
    ``[rankN]:`` style a log collector also stamps every line in front of the prefix."""
    lines: dict[int, list[str]] = {}
    merged: list[str] = []
    for i, (rank, text) in enumerate(records):
        clock = f"10:17:{i % 60:02d}"
        if stamped and text.startswith("step "):
            text = f"2024-05-01 {clock},000 INFO {text}"
        lead = f"2024-05-01T{clock}.000000Z " if stamped and style == "rank" else ""
        if style == "rank":
            merged.append(f"{lead}[rank{rank}]:{text}")
        elif style == "label":
            merged.append(f"{lead}{rank}: {text}")
        else:
            lines.setdefault(rank, []).append(f"{lead}{text}")
    if style != "files":
        (tmp_path / "job.log").write_text("\n".join(merged) + "\n")
        return str(tmp_path / "job.log")
    for rank, own in lines.items():
        (tmp_path / f"rank_{rank}.log").write_text("\n".join(own) + "\n")
    return str(tmp_path)


def world(records: list[tuple[int, str]], size: int) -> list[tuple[int, str]]:
    """Every rank of the job shows a line (as every rank prints its progress)."""
    return [(r, f"step 810 | rank {r} ready") for r in range(size)] + records


@pytest.mark.parametrize("stamped", STAMPS)
@pytest.mark.parametrize("style", STYLES)
def test_only_the_traceback_right_after_an_ignored_report_is_ignored(tmp_path: Path, style: str, stamped: bool) -> None:
    records = [(1, IGNORED), (1, "step 812 | loss 2.31"), *((1, t) for t in oom_traceback(1)), (0, WATCHDOG)]
    d = diagnose([write_log(tmp_path, style, stamped, records)])
    assert (d.kind, d.initiating_rank) == ("cuda_oom", 1), d.notes


@pytest.mark.parametrize("stamped", STAMPS)
@pytest.mark.parametrize("style", STYLES)
def test_ignored_exception_line_without_traceback_stays_ignored(tmp_path: Path, style: str, stamped: bool) -> None:
    # Python prints an exception raised without Python frames as its exception line alone
    records = world(
        [
            (2, IGNORED),
            (2, "OSError: [Errno 28] No space left on device"),
            (2, "step 813 | loss 2.30"),
            *((0, t) for t in oom_traceback(0)),
        ],
        3,
    )
    d = diagnose([write_log(tmp_path, style, stamped, records)])
    assert (d.kind, d.initiating_rank) == ("cuda_oom", 0), d.notes
    assert 2 not in d.also_failed_ranks


@pytest.mark.parametrize("stamped", STAMPS)
@pytest.mark.parametrize("style", STYLES)
def test_ignored_chained_exception_is_ignored_whole(tmp_path: Path, style: str, stamped: bool) -> None:
    records = world(
        [
            (2, IGNORED),
            (2, "Traceback (most recent call last):"),
            (2, '  File "/workspace/data.py", line 88, in __del__'),
            (2, "    self._shutdown_workers()"),
            (2, "KeyError: 'workers'"),
            (2, ""),
            (2, "During handling of the above exception, another exception occurred:"),
            (2, ""),
            (2, "Traceback (most recent call last):"),
            (2, '  File "/workspace/data.py", line 91, in __del__'),
            (2, "    self._log.flush()"),
            (2, "OSError: [Errno 28] No space left on device"),
            (2, "step 813 | loss 2.30"),
            *((0, t) for t in oom_traceback(0)),
        ],
        3,
    )
    d = diagnose([write_log(tmp_path, style, stamped, records)])
    assert (d.kind, d.initiating_rank) == ("cuda_oom", 0), d.notes
    assert 2 not in d.also_failed_ranks


@pytest.mark.parametrize("style", STYLES)
def test_ignored_report_alone_is_still_not_a_failure(tmp_path: Path, style: str) -> None:
    records = world([(1, IGNORED), *((1, t) for t in RENAME_TRACEBACK), (1, "step 813 | loss 2.30")], 2)
    d = diagnose([write_log(tmp_path, style, False, records)])
    assert not d.found, (d.kind, d.initiating_rank)


WARNINGS = {
    "logging": "WARNING:root:Error decoding sample 118 of shard s3://data/shard-00012.tar, skipping "
    "(PIL.UnidentifiedImageError: cannot identify image file)",
    "formatter": "2024-05-01 10:16:59,120 - data.loader - WARNING - skipping sample 118 after "
    "OSError: image file is truncated (3 bytes not processed)",
    "bracketed": "[2024-05-01 10:16:59,120] [WARNING] [loader.py:88:__next__] sample 118 skipped after "
    "ConnectionResetError: [Errno 104] Connection reset by peer",
    "loguru": "2024-05-01 10:16:59.120 | WARNING  | data.loader:next:88 - retrying shard after "
    "botocore.exceptions.ReadTimeoutError: Read timeout on endpoint URL",
    "warnings": "/workspace/data.py:88: UserWarning: could not decode sample 118 "
    "(PIL.UnidentifiedImageError: cannot identify image file), skipped",
}


@pytest.mark.parametrize("stamped", STAMPS)
@pytest.mark.parametrize("form", sorted(WARNINGS))
@pytest.mark.parametrize("style", STYLES)
def test_handled_exception_in_a_warning_does_not_outrank_a_failure(
    tmp_path: Path, style: str, form: str, stamped: bool
) -> None:
    records = world([(7, WARNINGS[form]), *((3, t) for t in RENAME_TRACEBACK)], 8)
    d = diagnose([write_log(tmp_path, style, stamped, records)])
    assert (d.kind, d.initiating_rank) == ("checkpoint_write_race", 3), d.notes
    assert 7 not in d.also_failed_ranks


@pytest.mark.parametrize("stamped", STAMPS)
@pytest.mark.parametrize("style", STYLES)
def test_warnings_on_every_rank_do_not_mark_ranks_failed(tmp_path: Path, style: str, stamped: bool) -> None:
    warned = [(r, WARNINGS[form]) for r in range(8) for form in sorted(WARNINGS) if r != 5]
    records = world([*warned, (5, "ValueError: shape mismatch in batch 118: expected 4096, got 4095")], 8)
    d = diagnose([write_log(tmp_path, style, stamped, records)])
    assert (d.kind, d.initiating_rank) == ("python_exception", 5), d.notes
    assert d.also_failed_ranks == []


@pytest.mark.parametrize("form", ["bracketed", "formatter", "logging"])  # not a retry, not a Python warning
@pytest.mark.parametrize("style", STYLES)
def test_a_warning_alone_is_still_the_answer_with_low_confidence(tmp_path: Path, style: str, form: str) -> None:
    d = diagnose([write_log(tmp_path, style, False, world([(7, WARNINGS[form])], 8))])
    assert d.found and d.initiating_rank == 7
    assert d.confidence < 0.5
