"""The report answers in the users' taxonomy: a KB class that the users' labels never use declares
the label class it belongs to (its family), and the report keeps it as the finer ``kind``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import ckptguard.diagnose
from ckptguard.cli import app
from ckptguard.diagnose.engine import diagnose
from ckptguard.diagnose.kb import KBError, load_kb, load_kb_dir
from ckptguard.runner.report import summary

from .corpus_score import CORPORA, load_labels

VARIANTS = Path(__file__).parent / "variants"
KB_DIR = Path(ckptguard.diagnose.__file__).parent / "kb"
# What the users' labels do with each split: setup and code errors are exceptions, a lost peer is
# the network error, a SIGTERM from outside is the scheduler's.
FAMILIES = {
    "config_error": "python_exception",
    "import_error": "python_exception",
    "ddp_unused_parameters": "python_exception",
    "cuda_unavailable": "python_exception",
    "nccl_invalid_usage": "python_exception",
    "peer_connection_lost": "nccl_network_error",
    "launcher_sigterm": "scheduler_time_limit",
}


def test_the_splits_declare_their_family() -> None:
    kb = load_kb()
    assert {c: fc.family for c, fc in kb.classes.items() if fc.family} == FAMILIES
    for c in kb.classes:
        assert kb.family(kb.family(c)) == kb.family(c)  # a family is never itself a split


@pytest.mark.skipif(not all((c / "labels.jsonl").is_file() for c in CORPORA), reason="corpora not present")
def test_every_class_the_labels_never_use_is_mapped() -> None:
    """A class that no label uses is a split the users don't make (unclassified_error is "no class";
    interrupted is a stop on purpose, which no crash report labels, kept apart for the hooks)."""
    used = {lb.failure_class for c in CORPORA for lb in load_labels(c)}
    kb = load_kb()
    unmapped = {c for c, fc in kb.classes.items() if c not in used and fc.family is None}
    assert unmapped == {"unclassified_error", "interrupted"}
    assert {fc.family_id for fc in kb.classes.values()} - {"unclassified_error", "interrupted"} <= used


@pytest.mark.parametrize("family", ["import_error", "no_such_class", "config_error"])
def test_a_family_must_be_a_class_without_family(tmp_path: Path, family: str) -> None:
    kb_dir = tmp_path / "kb"
    shutil.copytree(KB_DIR, kb_dir)
    target = kb_dir / "config_error.toml"
    target.write_text(target.read_text().replace('family = "python_exception"', f'family = "{family}"'))
    with pytest.raises(KBError, match=r"config_error\.toml: family"):
        load_kb_dir(kb_dir)


def test_report_answers_the_family_and_keeps_the_kind(runner) -> None:
    """argparse refusing the launcher's flag: python_exception in JSON and text, config error as
    the kind, with the config error's own title and fix; no hypothesis of the answer's own family."""
    log = str(VARIANTS / "argparse_required.log")
    res = runner.invoke(app, ["diagnose", log, "--json"])
    d = json.loads(res.stdout)
    assert (res.exit_code, d["failure_class"], d["kind"]) == (0, "python_exception", "config_error")
    assert d["title"] == load_kb()["config_error"].title and "flag" in d["fix"]
    assert all(a["failure_class"] != "python_exception" for a in d["alternatives"])
    assert all(t["kind"] and t["failure_class"] == load_kb().family(t["kind"]) for t in d["timeline"])
    text = runner.invoke(app, ["diagnose", log]).stdout
    assert "python_exception (config error: Configuration or launch-argument error)" in text
    assert "ckptguard explain config_error" in text
    assert "reported as python_exception" in runner.invoke(app, ["explain", "config_error"]).stdout


def test_a_class_of_its_own_family_reports_itself_as_kind(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text(
        '[rank1]: Traceback (most recent call last):\n[rank1]:   File "t.py", line 1, in <module>\n'
        "[rank1]: OSError: [Errno 28] No space left on device: '/ckpt/step5/optim.pt'\n"
    )
    d = diagnose([str(log)])
    assert (d.failure_class, d.kind, d.initiating_rank) == ("disk_full_enospc", "disk_full_enospc", 1)


def test_lost_peer_alone_is_the_network_family(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text(
        "[rank2]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
        "Connection closed by peer [10.4.0.9]:31027\n"
    )
    d = diagnose([str(log)])
    assert d.failure_class == "nccl_network_error"
    assert d.confidence < 0.8


def test_runner_summary_names_family_and_kind() -> None:
    d = diagnose([str(VARIANTS / "argparse_required.log")])
    out = summary(d, None, 1, [], None)
    assert "failure      python_exception (config error): Configuration or launch-argument error" in out
