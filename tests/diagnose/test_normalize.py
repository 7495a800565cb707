"""Normalisation before recognition: a log damaged the way pastes damage it gets the diagnosis of
the log as printed (class and first rank), on every fixture and every labelled corpus log."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptguard.diagnose.engine import diagnose

from .corpus_score import CORPORA

FIXTURES = Path(__file__).parent / "fixtures"
LOGS = sorted(p for p in FIXTURES.glob("*.log"))
CORPUS_LOGS = sorted(p for c in CORPORA if (c / "logs").is_dir() for p in (c / "logs").iterdir())
# Where a process's record begins: the only places a paste's joined lines can be split again.
_JOINABLE = re.compile(
    r"^\s*(?:\[(?:rank|default)\d+\]:\s*)?(?:Traceback \(most|\[(?:rank|default)\d+\]:"
    r"|[IWEF]\d{4} \d\d:\d\d|File \"|Root Cause|Failures:|time\s+:|host\s+:|rank\s+:"
    r"|exitcode\s+:|error_file:|traceback\s+:|\[\d+\]:$)"
)


def _answer(path: Path) -> tuple[str | None, int | None]:
    d = diagnose([str(path)])
    return d.failure_class, d.initiating_rank


def _join(lines: list[str], picks: list[bool], sep: str) -> list[str]:
    """Join a line to the one before it where the paste lost that break (at a record start)."""
    out: list[str] = []
    for i, ln in enumerate(lines):
        if out and picks[i % len(picks)] and _JOINABLE.match(ln) and out[-1].strip():
            out[-1] += sep + ln.lstrip() if "File" not in ln[:12] else sep + ln.strip()
        else:
            out.append(ln)
    return out


def _wrap(lines: list[str], width: int) -> list[str]:
    """A terminal that wraps every line at ``width`` columns (where two lines or more are
    longer: a single wrapped line cannot be told from one printed at that length)."""
    if sum(len(ln) > width for ln in lines) < 2:
        return lines
    out: list[str] = []
    for ln in lines:
        while len(ln) > width:
            out.append(ln[:width])
            ln = ln[width:]
        out.append(ln)
    return out


def damage(text: str, kinds: set[str], picks: list[bool], width: int) -> bytes:
    """The log as a paste may reach us: each kind of damage in ``kinds``."""
    lines = text.split("\n")
    if "join" in kinds:
        lines = _join(lines, picks, "  " if picks[0] else " ")
    if "wrap" in kinds:
        lines = _wrap(lines, width)
    if "ansi" in kinds:
        lines = [f"\x1b[31m{ln}\x1b[0m" if picks[i % len(picks)] and ln else ln for i, ln in enumerate(lines)]
    out = "\n".join(lines)
    if "entities" in kinds:
        out = html.escape(out, quote=True)
    if "fence" in kinds:
        out = "<details><summary>log</summary>\n\n```text\n" + out + "\n```\n</details>\n"
    if "crlf" in kinds:
        out = out.replace("\n", "\r\n")
    return out.encode("utf-8")


DAMAGE = st.tuples(
    st.sets(st.sampled_from(["join", "wrap", "ansi", "entities", "fence", "crlf"]), min_size=1),
    st.lists(st.booleans(), min_size=1, max_size=8),
    st.sampled_from([80, 120]),
)


def _check(path: Path, tmp: Path, kinds: set[str], picks: list[bool], width: int) -> None:
    text = path.read_bytes().decode("utf-8", "replace")
    want = _answer(path)
    bad = tmp / path.name
    bad.write_bytes(damage(text, kinds, picks, width))
    assert _answer(bad) == want, (sorted(kinds), picks, width)


@pytest.mark.parametrize("path", LOGS, ids=lambda p: p.name)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dmg=DAMAGE)
def test_damaged_fixture_same_diagnosis(path: Path, tmp_path: Path, dmg: tuple[set[str], list[bool], int]) -> None:
    _check(path, tmp_path, *dmg)


@pytest.mark.skipif(not CORPUS_LOGS, reason="needs the labelled corpora (set CKPTGUARD_CORPUS)")
@pytest.mark.parametrize("path", CORPUS_LOGS, ids=lambda p: p.name[:40])
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dmg=DAMAGE)
def test_damaged_corpus_log_same_diagnosis(path: Path, tmp_path: Path, dmg: tuple[set[str], list[bool], int]) -> None:
    _check(path, tmp_path, *dmg)


TABLE_ONE_LINE = (
    "[rank0]: step 12 loss 2.31 Traceback (most recent call last):   File "
    '"/usr/bin/torchrun", line 8, in <module>     sys.exit(main()) '
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "
    "============================================================ train.py FAILED "
    "------------------------------------------------------------ Failures:   <NO_OTHER_FAILURES> "
    "------------------------------------------------------------ Root Cause (first observed failure): "
    "[0]:   time      : 2025-03-25_20:57:27   host      : node-a   rank      : 1 (local_rank: 1)   "
    "exitcode  : -9 (pid: 4002)   error_file: <N/A>   traceback : Signal 9 (SIGKILL) received by PID 4002 "
    "============================================================\n"
)


def test_torchrun_table_on_one_line(tmp_path: Path) -> None:
    """A failure table whose fields a paste ran together, the signal among them: rank 1's SIGKILL."""
    (tmp_path / "paste.log").write_text(TABLE_ONE_LINE)
    d = diagnose([str(tmp_path / "paste.log")])
    assert (d.failure_class, d.initiating_rank) == ("host_oom_sigkill", 1)


def test_stdout_log_with_binary_bytes_is_read(tmp_path: Path) -> None:
    """A few binary bytes (a crash's garbage, a redirected progress bar) do not make a log binary."""
    junk = bytes(range(0, 32)) * 4 + b"\x00" * 100  # a quarter of the file
    log = (
        junk
        + b"\n"
        + b"".join(b"[rank2]: step %d loss 2.0\n" % i for i in range(30))
        + b"[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    )
    (tmp_path / "stdout.log").write_bytes(log)
    d = diagnose([str(tmp_path / "stdout.log")])
    assert (d.failure_class, d.initiating_rank) == ("cuda_oom", 2)
    assert not any("binary" in n for n in d.notes)


_SRUN_LOG = """0: step 100 loss 2.31
1: step 100 loss 2.30
1: WARNING:root:Error decoding sample 118: OSError: image file is truncated, skipping
0: Traceback (most recent call last):
0:   File "/workspace/train.py", line 301, in save_checkpoint
0:     os.rename(tmp_dir, final_dir)
0: FileNotFoundError: [Errno 2] No such file or directory: '/ckpt/run7/step12000-tmp' -> '/ckpt/run7/step12000'
"""


@pytest.mark.parametrize("joined", [False, True])
def test_a_number_and_colon_inside_a_message_is_not_an_srun_task_id(tmp_path: Path, joined: bool) -> None:
    """``srun --label`` task ids split a paste's joined records only where the log's own lines
    start with that id: "sample 118: OSError" inside rank 1's message is not task 118's record
    (it made a world of 119 ranks and blamed rank 118). A record really joined onto another
    line ("... skipping 0: Traceback") is still split."""
    text = _SRUN_LOG.replace("skipping\n0: Traceback", "skipping 0: Traceback") if joined else _SRUN_LOG
    log = tmp_path / "srun.log"
    log.write_text(text)
    d = diagnose([str(log)])
    assert (d.failure_class, d.initiating_rank, d.world_size) == ("checkpoint_write_race", 0, 2)
