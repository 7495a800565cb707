"""Bad input: empty, binary, non-UTF-8, a 50 MB line, a log cut mid-traceback; and secrets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from ckptguard.cli import app
from ckptguard.diagnose.engine import diagnose
from ckptguard.diagnose.ingest import UsageError

from .conftest import FIXTURES, SEED, cli_json


def test_empty_input(runner, tmp_path: Path) -> None:
    (tmp_path / "empty.log").write_bytes(b"")
    code, out = cli_json(runner, str(tmp_path / "empty.log"))
    assert code == 1 and out["found"] is False and out["failure_class"] is None


def test_stdin(runner) -> None:
    result = runner.invoke(app, ["diagnose", "-", "--json"], input=SEED.read_text())
    assert result.exit_code == 0
    assert json.loads(result.stdout)["initiating_rank"] == 8


def test_usage_errors(runner, tmp_path: Path) -> None:
    assert runner.invoke(app, ["diagnose", str(tmp_path / "missing.log")]).exit_code == 2
    assert runner.invoke(app, ["diagnose"]).exit_code == 2
    assert runner.invoke(app, ["explain", "no_such_class"]).exit_code == 2


def test_binary_garbage_and_non_utf8(tmp_path: Path) -> None:
    rnd = os.urandom(3 * 1024 * 1024)
    (tmp_path / "garbage.bin.log").write_bytes(rnd)
    with pytest.raises(UsageError, match=r"garbage\.bin\.log is a binary file"):
        diagnose([str(tmp_path / "garbage.bin.log")])
    (tmp_path / "job.log").write_bytes(
        b"step 1\n\0\0\0\n" + b"step 2 loss 1.0\n" * 2000 + b"[rank1]: torch.OutOfMemoryError: CUDA out of memory.\n"
    )
    d = diagnose([str(tmp_path / "job.log")])  # a text log with a few NULs (a crash's padding) is read
    assert (d.failure_class, d.initiating_rank) == ("cuda_oom", 1)
    bad = (
        b"\xff\xfe[rank1]: caf\xe9 \x80\x81\n[rank1]: Traceback (most recent call last):\n"
        b"[rank1]: OSError: [Errno 28] No space left on device: '/ck\xffpt/x.pt'\n"
    )
    (tmp_path / "latin.log").write_bytes(bad)
    d = diagnose([str(tmp_path / "latin.log")])
    assert (d.failure_class, d.initiating_rank) == ("disk_full_enospc", 1)


def test_50mb_single_line_bounded_memory(tmp_path: Path) -> None:
    p = tmp_path / "long.log"
    with p.open("wb") as f:
        f.write(b"[rank0]: RuntimeError: Connection reset by peer " + b"x" * (50 * 1024 * 1024) + b"\n")
        f.write(b"[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n")
    tracemalloc.start()
    d = diagnose([str(p)])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 32 * 1024 * 1024, peak
    assert (d.failure_class, d.initiating_rank, d.collateral_ranks) == ("cuda_oom", 1, [0])
    assert d.stats["lines"] == 2
    assert all(len(e.text) <= 400 for e in d.evidence)


def test_log_cut_mid_traceback(tmp_path: Path) -> None:
    lines = (FIXTURES / "exception_keyerror.log").read_text().splitlines(keepends=True)
    cut = next(i for i, ln in enumerate(lines) if "fail_now(step)" in ln)
    (tmp_path / "cut.log").write_text("".join(lines[:cut]))
    d = diagnose([str(tmp_path / "cut.log")])
    assert d.failure_class in (None, "python_exception", "nccl_network_error", "scheduler_time_limit")
    whole = "".join(lines[: cut + 3])
    (tmp_path / "cut2.log").write_text(whole.rsplit("\n", 1)[0][:-5])  # cut inside a line
    diagnose([str(tmp_path / "cut2.log")])


SECRETS = {
    "aws": "AKIAIOSFODNN7EXAMPLQ",
    "aws_secret": "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEYzz",
    "hf": "hf_abcdefghijklmnopqrstuvwxyzABCDEFGH12",
    "github": "ghp_0123456789abcdefghijklmnopqrstuvwxyz",
    "bearer": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "urlpass": "S3cr3tPassw0rd",
    "email": "jane.doe@example-corp.com",
    "gcp": "AIzaSyA1234567890abcdefghijklmnopqrstuv",
    "openai": "sk-proj-ABCDEFGHIJKLMNOPQRSTUVWX1234",
    "wandb": "0123456789abcdef0123456789abcdef01234567",
}


def _planted(tmp_path: Path) -> Path:
    s = SECRETS
    text = (FIXTURES / "exception_keyerror.log").read_text()
    text = text.replace(
        "[default2]:[rank2]: KeyError: 'labels'",
        f"[default2]:[rank2]: KeyError: 'labels' token={s['hf']} aws {s['aws']} "
        f"aws_secret_access_key={s['aws_secret']} mail {s['email']} "
        f"url https://bob:{s['urlpass']}@hub.example.com/x Authorization: Bearer {s['bearer']} "
        f"gh {s['github']} key {s['gcp']} {s['openai']} WANDB_API_KEY={s['wandb']}",
    )
    p = tmp_path / "secrets.log"
    p.write_text(text)
    return p


def test_secrets_never_leave(runner, tmp_path: Path) -> None:
    log = _planted(tmp_path)
    html = tmp_path / "r.html"
    text = runner.invoke(app, ["diagnose", str(log), "--html", str(html)])
    js = runner.invoke(app, ["diagnose", str(log), "--json"])
    assert text.exit_code == 0 and js.exit_code == 0
    out = json.loads(js.stdout)
    assert out["initiating_rank"] == 2
    assert any("<secret>" in e["text"] for e in out["evidence"])
    for name, value in SECRETS.items():
        for kind, blob in (("text", text.stdout), ("json", js.stdout), ("html", html.read_text())):
            assert value not in blob, f"{name} leaked into {kind} output"


def test_mask_hosts_consistently(runner) -> None:
    code, out = cli_json(runner, str(SEED), "--mask-hosts")
    blob = json.dumps(out)
    assert code == 0 and out["initiating_rank"] == 8
    assert "NH-DC-NM129" not in blob
    assert out["initiating_host"] == "host-1"
    assert "host-1" in " ".join(e["text"] for e in out["evidence"])


def test_html_report(runner, tmp_path: Path) -> None:
    html = tmp_path / "r.html"
    result = runner.invoke(app, ["diagnose", str(FIXTURES / "dir_race_2nodes.log"), "--html", str(html)])
    assert result.exit_code == 0
    page = html.read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page and "rank 2" in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # self-contained


def test_diagnose_does_not_import_torch() -> None:
    """The diagnose modules and their CLI import no torch (checked with the package's own
    __init__, which belongs to the checkpoint library, bypassed)."""
    code = (
        "import importlib.util, sys, types\n"
        "spec = importlib.util.find_spec('ckptguard')\n"
        "pkg = types.ModuleType('ckptguard'); pkg.__path__ = list(spec.submodule_search_locations)\n"
        "sys.modules['ckptguard'] = pkg\n"
        "from ckptguard.cli import diagnose_cmd\n"
        "from ckptguard.diagnose import engine, report\n"
        "d = engine.diagnose([sys.argv[1]]); report.render_html(d)\n"
        "assert d.initiating_rank == 8\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code, str(SEED)], check=True)


# ---- bad input always gets an answer or a clear message --------------------------


def _bad_inputs(tmp_path: Path) -> dict[str, Path]:
    """Empty, binary, a 50 MB line, mixed encodings, UTF-16, a damaged .gz, NULs and CRs."""
    oom = "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    files = {
        "empty.log": b"",
        "binary.log": bytes(range(256)) * 4096,
        "mixed.log": (
            "[rank0]: step 1 loss 2.0 \u2713\n".encode()
            + "[rank0]: caf\xe9 na\xefve\r\n".encode("latin-1")
            + "[rank2]: 训练 step 2\n".encode("gb18030")
            + b"\x00\x00\x00[rank3]: \xff\xfe\x00\n"
            + oom.encode()
        ),
        "utf16.log": ("\ufeff" + "step 1\r\n" + oom.replace("\n", "\r\n")).encode("utf-16-le"),
        "damaged.log.gz": b"\x1f\x8b\x08\x00" + os.urandom(4096),
        "only_cr.log": oom.replace("\n", "\r").encode() * 3,
    }
    out = {}
    for name, data in files.items():
        out[name] = tmp_path / name
        out[name].write_bytes(data)
    with (tmp_path / "long_line.log").open("wb") as f:  # 50 MB, no newline at all
        f.write(b"x" * (50 * 1024 * 1024) + b" RuntimeError: CUDA error: an illegal memory access was encountered")
    out["long_line.log"] = tmp_path / "long_line.log"
    return out


def test_bad_input_never_a_traceback(runner, tmp_path: Path) -> None:
    for name, path in _bad_inputs(tmp_path).items():
        result = runner.invoke(app, ["diagnose", str(path), "--json"])
        assert result.exit_code in (0, 1, 2), (name, result.output[-2000:])
        assert result.exception is None or isinstance(result.exception, SystemExit), (name, result.exception)
        if result.exit_code == 2:
            assert "error:" in result.output, name
        else:
            json.loads(result.stdout)


def test_bad_input_answers(tmp_path: Path) -> None:
    paths = _bad_inputs(tmp_path)
    assert not diagnose([str(paths["empty.log"])]).found
    d = diagnose([str(paths["mixed.log"])])
    assert (d.failure_class, d.initiating_rank) == ("cuda_oom", 1)
    d = diagnose([str(paths["utf16.log"])])
    assert (d.failure_class, d.initiating_rank) == ("cuda_oom", 1)  # PowerShell's UTF-16 logs
    d = diagnose([str(paths["damaged.log.gz"]), str(paths["utf16.log"])])
    assert d.failure_class == "cuda_oom" and any("damaged.log.gz" in n for n in d.notes)


def test_unreadable_only_input_is_a_usage_error(runner, tmp_path: Path) -> None:
    (tmp_path / "bad.log.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    result = runner.invoke(app, ["diagnose", str(tmp_path / "bad.log.gz")])
    assert result.exit_code == 2 and "cannot read" in result.output


def _fed(path: Path, engine: str) -> list[tuple[int, bytes]]:
    """The (line number, line) pairs that the scan hands to the extractor, the anchors found by
    ``engine`` (a name in `hits.ENGINES`, or "python")."""
    from ckptguard.diagnose.events import STRUCTURAL_ANCHORS
    from ckptguard.diagnose.hits import ENGINES
    from ckptguard.diagnose.ingest import Prefilter, Source, scan
    from ckptguard.diagnose.kb import load_kb

    pf = Prefilter(STRUCTURAL_ANCHORS, load_kb().anchors())
    src = Source(path.name, path)
    hits = None
    if engine != "python":
        hits = ENGINES[engine].open(src, pf)
        assert hits is not None, f"{engine} is installed on every machine this runs on"
    out: list[tuple[int, bytes]] = []

    def on_line(line: bytes, lineno: int) -> int:
        out.append((lineno, line))
        return 2 if b"Traceback" in line else 0

    with path.open("rb") as f:
        scan(f, pf, on_line, hits)
    if hits is not None:
        hits.close()
    return out


@pytest.mark.parametrize("engine", ["hyperscan", "grep"])
def test_anchor_engines_feed_the_same_lines(tmp_path: Path, engine: str) -> None:
    """Hyperscan and grep -F find the anchors; the lines fed must be exactly the Python
    prefilter's, across 4 MiB block edges, over-long lines and anchors at a line's very end."""
    big = tmp_path / "big.log"
    with big.open("wb") as f:
        for i in range(120_000):
            f.write(b"[rank%d]: step %d loss 1.0 tok/s 1000\n" % (i % 8, i))
            if i % 7 == 0:  # a word fragment of an anchor inside a metric's name, and a real word
                f.write(
                    b"[rank2]: step %d top1_error=0.2 starting eval\n" % i
                    if i % 2
                    else b"[rank2]: std::runtime_error after step %d\n" % i
                )
            if i % 9973 == 0:
                f.write(b'[rank3]: RuntimeError: boom\nTraceback (most recent call last):\n  File "x.py"\n')
            if i % 31337 == 0:
                f.write(b"x" * (70 * 1024) + b" Errno 28 at the end of an over-long line\n")
            if i % 50_000 == 0:
                f.write(b"[rank1]: ends with an anchor: Killed\n")
            if i % 20_011 == 0:  # a progress bar's updates on one line: its anchor many times
                f.write(b"[rank4]:" + b"\rEpoch 1: 45%|####| 450/1000 [00:10<00:12, 3.2it/s]" * (300 + i % 7))
                f.write(b" RuntimeError: boom after the bar\n" if i % 2 else b"\n")
    files = [big, *sorted(p for p in FIXTURES.rglob("*.log"))[:8]]
    for p in files:
        assert _fed(p, engine) == _fed(p, "python"), p


def test_a_metric_named_like_an_anchor_does_not_make_every_line_parsed(tmp_path: Path) -> None:
    """A logger that prints `top1_error=` or `train/error_rate` on every step: the word inside
    a snake_case name is not a failure's word, so those lines are not examined (they were all
    parsed, at a fraction of a MB/s); a C++ `std::system_error` still is."""
    log = tmp_path / "metrics.log"
    with log.open("w") as f:
        for i in range(20_000):
            f.write(
                f"2024-05-01 10:00:00,001 INFO step={i} top1_error=0.21 train/error_rate=0.2 "
                f"num_exceptions=0 early_exit=False saving_steps=500 loss_nan=0\n"
            )
        f.write("terminate called after throwing an instance of 'std::system_error'\n")
    d = diagnose([str(log)])
    assert d.failure_class == "unclassified_error"
    assert d.stats["lines_examined"] < 10, d.stats
