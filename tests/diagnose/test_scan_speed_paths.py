"""The fast paths of the scan read exactly what the line-by-line scan reads.

A log whose every line holds an anchor word is read a block at a time (`shapes.Shapes.unread`),
a grep that finds an anchor on nearly every line is stopped, and the knowledge base tests its
signatures through literal prechecks (`literals`). Each must give the answers of the plain path;
and the prefilter's anchors come from the knowledge base, so a rule added later is read too.
"""

from __future__ import annotations

import re
import shutil
import sys
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptguard.diagnose
from ckptguard.diagnose.engine import diagnose
from ckptguard.diagnose.events import EMBEDDABLE_ANCHORS, STRUCTURAL_ANCHORS
from ckptguard.diagnose.hits import ENGINES
from ckptguard.diagnose.ingest import MAX_LINE, Prefilter, Source, scan
from ckptguard.diagnose.kb import load_kb, load_kb_dir
from ckptguard.diagnose.literals import AnchorIndex, branches, required_literal, searcher
from ckptguard.diagnose.shapes import Shapes

from .conftest import FIXTURES


class _LineByLine(Shapes):
    """The same shape table without the block test: every block is read line by line."""

    def unread(self, block: bytes) -> list[int] | None:
        return None


def _prefilter() -> Prefilter:
    return Prefilter(STRUCTURAL_ANCHORS, load_kb().anchors(), embeddable=EMBEDDABLE_ANCHORS)


def _fed(path: Path, shapes_type: type[Shapes], engine: str = "python") -> list[tuple[int, bytes]]:
    pf = _prefilter()
    hits = None
    if engine != "python":
        hits = ENGINES[engine].open(Source(path.name, path), pf)
        assert hits is not None, engine
    out: list[tuple[int, bytes]] = []

    def on_line(line: bytes, lineno: int) -> int:
        out.append((lineno, line))
        return 3 if b"Traceback" in line else 0

    with path.open("rb") as f:
        scan(f, pf, on_line, hits, shapes_type(pf.anchors, MAX_LINE))
    if hits is not None:
        hits.close()
    return out


# Lines of a noisy job: rank tags in several shapes, anchors, digits that differ between
# copies, short lines, a traceback (the lines after it are read whatever they hold).
_SHAPES = [
    "[rank{r}]:2024-05-01 10:{m:02d} WARNING io: read of shard {n} failed with error ECONNRESET\n",
    "[rank{r}]: step {n} loss {m}.{r} top1_error=0.{n} lr 3e-4\n",
    "gpu-{r:03d}:{n}:{n} [{m}] NCCL WARN NET/IB : Got async event : port error\n",
    "{r}: worker {m} exited cleanly after {n} batches\n",
    "[default{r}]: Errno {m} happened, retrying\n",
    "Killed {n}\n",
    "E{m}\n",
    "[rank{r}]: {n}{n}{n}{n}{n}{n} error {m}\n",
    "plain progress line {n} of {m}\n",
    "[rank{r}]: Traceback (most recent call last):\n",
    '[rank{r}]:   File "train.py", line {n}, in step\n',
    "[rank{r}]: RuntimeError: CUDA error: an illegal memory access was encountered\n",
    "\n",
]


@st.composite
def _logs(draw: st.DrawFn) -> bytes:
    ranks = draw(st.integers(1, 40))
    n = draw(st.integers(1, 6000))
    weights = draw(st.lists(st.integers(0, 20), min_size=len(_SHAPES), max_size=len(_SHAPES)))
    if not any(weights):
        weights[0] = 1
    seed = draw(st.integers(0, 2**32 - 1))
    import random

    rng = random.Random(seed)
    pool = [s for s, w in zip(_SHAPES, weights, strict=True) for _ in range(w)]
    lines = [
        rng.choice(pool).format(r=rng.randrange(ranks), m=rng.randrange(60), n=rng.randrange(10 ** rng.randrange(1, 7)))
        for _ in range(n)
    ]
    if draw(st.booleans()):  # an over-long line somewhere
        lines.insert(rng.randrange(len(lines) + 1), "[rank1]: " + "7" * (MAX_LINE + 10) + " error\n")
    return "".join(lines).encode()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_logs())
def test_block_test_reads_what_the_line_test_reads(tmp_path_factory, data: bytes) -> None:
    path = tmp_path_factory.mktemp("log") / "job.log"
    path.write_bytes(data)
    assert _fed(path, Shapes) == _fed(path, _LineByLine)


@pytest.mark.parametrize("engine", ["hyperscan", "grep"])
def test_engine_closed_on_a_dense_log_reads_the_same_lines(tmp_path: Path, engine: str) -> None:
    """The anchor engine is closed once nearly every line holds an anchor; the lines fed do not
    change."""
    path = tmp_path / "dense.log"
    with path.open("w") as f:
        for i in range(300_000):  # several 4 MiB blocks, every line anchored
            f.write(f"[rank{i % 64}]: retry {i} failed with error ECONNRESET (attempt {i % 5})\n")
            if i == 250_000:
                f.write("[rank7]: RuntimeError: CUDA error: an illegal memory access was encountered\n")
    fed = _fed(path, Shapes, engine)
    assert fed == _fed(path, Shapes) == _fed(path, _LineByLine)
    assert any(b"illegal memory access" in line for _, line in fed)
    assert len(fed) < 64 * 5  # each rank's shape read its limit of times, then skipped


def test_examined_lines_do_not_grow_with_the_log_and_memory_is_bounded(tmp_path: Path) -> None:
    """Millions of anchored lines: the lines parsed stop growing once each rank's shapes are
    read, and the scan's memory does not grow with the log."""

    def write(path: Path, copies: int) -> None:
        with path.open("w") as f:
            for i in range(copies):
                f.write(f"[rank{i % 32}]:10:{i % 60:02d} WARNING io: read {i} failed with error EIO\n")
                f.write(f"[rank{i % 32}]: gpu-{i % 8}:{1000 + i % 8}:{2000 + i} [0] NCCL WARN async event {i}\n")
            f.write("[rank5]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n")

    small, big = tmp_path / "small.log", tmp_path / "big.log"
    write(small, 50_000)
    write(big, 200_000)  # 400,000 anchored lines, 25 MB
    d_small = diagnose([str(small)])
    tracemalloc.start()
    d_big = diagnose([str(big)])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert (d_big.failure_class, d_big.initiating_rank) == ("cuda_oom", 5)
    assert d_big.stats["lines_examined"] == d_small.stats["lines_examined"], (d_small.stats, d_big.stats)
    assert peak < 48 * 1024 * 1024, peak


@pytest.mark.parametrize("engine", ["python", "hyperscan", "grep"])
def test_every_kb_anchor_passes_every_path_of_the_prefilter(tmp_path: Path, engine: str) -> None:
    """A line that holds any of the prefilter's anchors (the knowledge base's included, digits
    and all) is read, even buried in a million-line block of one repeated shape."""
    pf = _prefilter()
    anchors = [a.decode() for a in pf.exact]
    assert set(load_kb().anchors()) <= {a for a in anchors} | {
        a for a in load_kb().anchors() if any(x in a for x in anchors)
    }
    path = tmp_path / "buried.log"
    with path.open("w") as f:
        for i in range(120_000):
            f.write(f"[rank{i % 4}]:10:{i % 60:02d} WARNING io: read {i} failed with error EIO\n")
            if i % 500 == 0 and i // 500 < len(anchors):
                f.write(f"[rank9]: line {i} holds << {anchors[i // 500]} >> here\n")
    fed = [line for _, line in _fed(path, Shapes, engine)]
    for a in anchors:
        assert any(f"<< {a} >>".encode() in line for line in fed), a


def test_kb_pattern_lines_pass_the_prefilter() -> None:
    """Every fixture line that a knowledge-base signature matches, whose anchor the prefilter
    carries (a structural anchor inside it, or ``prefilter = true``), passes the prefilter."""
    pf = _prefilter()
    exact = [a.decode() for a in pf.exact]
    kb = load_kb()
    sigs = [
        s
        for fc in kb.classes.values()
        for s in fc.signatures
        if s.on != "exception" and s.anchor and any(a in s.anchor for a in exact)
    ]
    checked = 0
    for p in sorted(FIXTURES.rglob("*.log")):
        for line in p.read_bytes().split(b"\n"):
            text = line.decode("utf-8", "replace")
            for s in sigs:
                if s.pattern.search(text):
                    checked += 1
                    assert pf.line_starts(line) and pf.candidate(line), (s.class_id, text)
    assert checked > 50


def test_a_rule_added_to_the_kb_is_read_in_a_large_log(tmp_path: Path) -> None:
    """A new class whose signature is marked ``prefilter = true`` widens the prefilter by
    itself: its line is found in a large log whose every line holds an anchor (grep is
    stopped there, and the blocks are read by their shapes)."""
    kb_dir = tmp_path / "kb"
    shutil.copytree(Path(ckptguard.diagnose.__file__).parent / "kb", kb_dir)
    (kb_dir / "quux_flux_fault.toml").write_text(
        (kb_dir / "segfault.toml")
        .read_text()
        .replace('id = "segfault"', 'id = "quux_flux_fault"')
        .split("[[signatures]]")[0]
        + '[[signatures]]\non = "line"\npattern = "quux flux capacitor drained"\n'
        'anchor = "flux capacitor"\nweight = 0.9\nprefilter = true\n'
    )
    kb = load_kb_dir(kb_dir)
    log = tmp_path / "job.log"
    with log.open("w") as f:
        for i in range(300_000):
            f.write(f"[rank{i % 16}]: step {i} retried after error EAGAIN\n")
            if i == 250_000:
                f.write("[rank3]: quux flux capacitor drained at step 250000\n")
    d = diagnose([str(log)], kb=kb)
    assert (d.failure_class, d.initiating_rank) == ("quux_flux_fault", 3)


# ---- literals: the knowledge base's cheaper regex tests ---------------------------------


def _all_patterns() -> list[re.Pattern[str]]:
    kb = load_kb()
    return [s.pattern for fc in kb.classes.values() for s in fc.signatures]


_PIECES = sorted(
    {lit for p in _all_patterns() for b in branches(p.pattern) for lit in [required_literal(b)] if lit}
    | {"0", "13", " ", ": ", "[E ", "E0501 12:", "ERROR: ", "Killed", "\n", "x", "(", "]"}
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=8))
def test_searcher_answers_as_the_regex(pieces: list[str]) -> None:
    text = "".join(pieces)
    for p in _all_patterns():
        assert searcher(p)(text) == bool(p.search(text)), (p.pattern, text)


def test_branches_and_literals_of_hand_written_patterns() -> None:
    assert branches(r"a[|]b|c[]|]d|e[^]|]f|(x|y)z|g\|h") == ["a[|]b", "c[]|]d", "e[^]|]f", "(x|y)z", r"g\|h"]
    assert branches(r"(?i)a|b") == [r"(?i)a|b"]  # a global flag belongs to every branch
    assert required_literal(r"\berrno:? \d+") == "errno"
    assert required_literal(r"exit(?:ed)? (?:with )?code") == "exit"
    assert required_literal(r"ab+cd") == "ab"
    assert required_literal(r"a{2}bc\.d") == "bc.d"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=8))
def test_anchor_index_finds_every_anchor(pieces: list[str]) -> None:
    anchors = sorted({s.anchor for fc in load_kb().classes.values() for s in fc.signatures if s.anchor})
    index = AnchorIndex(anchors)
    text = "".join(pieces)
    assert index.present(text) == [a for a in anchors if a in text]


def test_without_hyperscan_the_diagnosis_is_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the Hyperscan wheel is missing (a platform it has none for), grep or the Python
    prefilter find the same lines: the diagnosis, line numbers included, does not change."""
    path = tmp_path / "job.log"
    with path.open("w") as f:
        for i in range(40_000):
            f.write(f"[rank{i % 16}]: step {i} loss 2.{i % 97} top1_error=0.1\n")
            if i == 31_000:
                f.write("[rank11]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n")
    with_hs = diagnose([str(path)])
    monkeypatch.setitem(sys.modules, "hyperscan", None)  # `import hyperscan` raises ImportError
    without = diagnose([str(path)])
    assert (with_hs.failure_class, with_hs.initiating_rank) == ("cuda_oom", 11)
    assert with_hs.to_dict()["evidence"] == without.to_dict()["evidence"]
    assert with_hs.stats["lines_examined"] == without.stats["lines_examined"]


def test_nccl_lines_are_limited_per_process(tmp_path: Path) -> None:
    """NCCL's ``host:pid:tid [dev]`` prefix names one process: a million NCCL WARN lines of 64
    processes are read a few times per process, and a failure after them is still found."""
    path = tmp_path / "nccl.log"
    with path.open("w") as f:
        for i in range(200_000):
            p = i % 64
            prefix = f"node-{p // 8}:{4000 + p}:{4100 + p} [{p % 8}]"
            f.write(f"{prefix} NCCL WARN NET/IB : Got async event : port error {i}\n")
        f.write("[rank9]: RuntimeError: CUDA error: an illegal memory access was encountered\n")
    d = diagnose([str(path)])
    assert d.failure_class == "cuda_illegal_memory_access" and d.initiating_rank == 9, d.failure_class
    assert d.stats["lines_examined"] <= 64 * 4 + 8, d.stats


def test_a_long_progress_line_is_read_as_the_terminal_shows_it(tmp_path: Path) -> None:
    """A progress bar that redraws itself thousands of times on one line (carriage returns, no
    newline) is read as its prefix and its last piece: the cost of a line does not grow with
    the bar's updates, and what follows the last update (a traceback glued to it) is read."""
    bar = "\rEpoch 3:  45%|####5     | {i}/50000 [00:10<00:12, 3.2it/s, loss=2.31, top1_error=0.3]"
    path = tmp_path / "tqdm.log"
    with path.open("w") as f:
        for n in range(40):
            f.write(f"[rank{n % 4}]:" + "".join(bar.format(i=i) for i in range(n * 100, n * 100 + 900)) + "\n")
        glued = "".join(bar.format(i=i) for i in range(5000, 5900))
        f.write(f"[rank2]:{glued}Traceback (most recent call last):\n")
        f.write('[rank2]:  File "/workspace/train.py", line 377, in main\n')
        f.write("[rank2]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB\n")
    fed = _fed(path, Shapes, "hyperscan")
    assert all(len(line) < 400 for _, line in fed), max(len(line) for _, line in fed)
    assert fed == _fed(path, Shapes, "grep") == _fed(path, _LineByLine)
    last_bar = [line for _, line in fed if line.startswith(b"[rank2]:\r")]
    assert last_bar and last_bar[-1].endswith(b"Traceback (most recent call last):")
    d = diagnose([str(path)])
    assert (d.failure_class, d.initiating_rank) == ("cuda_oom", 2)


def test_grep_is_not_used_where_the_scan_reads_other_bytes_than_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grep reads the file itself: its offsets are those of the file's bytes, not of a pasted
    log's normalised text nor of stdin, so without Hyperscan such a stream gets the Python
    prefilter."""
    from ckptguard.diagnose.hits import GrepHits, open_hits

    path = tmp_path / "job.log"
    path.write_text("[rank0]: RuntimeError: boom\n")
    monkeypatch.setitem(sys.modules, "hyperscan", None)
    plain = open_hits(Source(path.name, path), _prefilter(), transformed=False)
    assert isinstance(plain, GrepHits)
    plain.close()
    assert open_hits(Source(path.name, path), _prefilter(), transformed=True) is None
