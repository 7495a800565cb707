"""The knowledge base is data: complete entries, the required ids, valid cross-references."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptguard.cli import app
from ckptguard.diagnose.kb import KBError, load_kb, load_kb_dir

REQUIRED_IDS = {
    "checkpoint_write_race",
    "checkpoint_corrupt_load",
    "disk_full_enospc",
    "stale_nfs_handle",
    "permission_denied_checkpoint_dir",
    "cuda_oom",
    "host_oom_sigkill",
    "nccl_watchdog_timeout",
    "nccl_network_error",
    "rendezvous_failure",
    "cuda_illegal_memory_access",
    "cuda_device_side_assert",
    "segfault",
    "dataloader_worker_killed",
    "loss_nan_divergence",
    "import_error",
    "config_error",
    "python_exception",
}


def test_kb_complete() -> None:
    kb = load_kb()
    assert len(kb.classes) >= 25
    assert set(kb.classes) >= REQUIRED_IDS
    for fc in kb.classes.values():
        assert fc.title and fc.category and fc.mechanism.strip() and fc.fix.strip()
        assert fc.symptoms and fc.affected and fc.confirm and fc.prevention and fc.verify_command
        assert fc.signatures
    assert kb["nccl_watchdog_timeout"].collateral and kb["launcher_sigterm"].collateral
    assert not kb["checkpoint_write_race"].collateral


def test_explain_every_class(runner) -> None:
    listing = runner.invoke(app, ["explain", "--json"])
    ids = json.loads(listing.stdout)
    assert set(ids) == set(load_kb().classes)
    result = runner.invoke(app, ["explain", "checkpoint_write_race", "--json"])
    entry = json.loads(result.stdout)
    assert entry["related"] and entry["verify_command"] and entry["collateral"] is False
    text = runner.invoke(app, ["explain", "stale_nfs_handle"])
    assert text.exit_code == 0 and "Stale" in text.stdout


def test_bad_kb_is_refused(tmp_path: Path) -> None:
    (tmp_path / "python_exception.toml").write_text('id = "python_exception"\ntitle = "x"\n')
    with pytest.raises(KBError):
        load_kb_dir(tmp_path)


def test_misspelt_key_is_refused_naming_file_and_field(tmp_path: Path) -> None:
    """A KB file is edited by hand: a misspelt key must stop the engine, not read as a default."""
    import shutil

    import ckptguard.diagnose

    kb_dir = tmp_path / "kb"
    shutil.copytree(Path(ckptguard.diagnose.__file__).parent / "kb", kb_dir)
    target = kb_dir / "python_exception.toml"
    good = target.read_text()
    assert "weight = 0.5" in good and "collateral = false" in good
    target.write_text(good.replace("weight = 0.5", "weigth = 0.5", 1))
    with pytest.raises(KBError, match=r"python_exception\.toml.*weigth"):
        load_kb_dir(kb_dir)
    target.write_text(good.replace("collateral = false", 'collateral = "no"'))
    with pytest.raises(KBError, match=r"python_exception\.toml.*collateral"):
        load_kb_dir(kb_dir)
    target.write_text(good)
    assert "python_exception" in load_kb_dir(kb_dir)


def _top_level_alternatives(pattern: str) -> list[str]:
    """The ``|`` branches of a regex outside any group (escapes and classes kept whole)."""
    out, cur, depth, in_class, i = [], "", 0, False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            cur += pattern[i : i + 2]
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            out.append(cur)
            cur, i = "", i + 1
            continue
        cur += c
        i += 1
    return [*out, cur]


def test_every_branch_of_a_signature_holds_its_anchor() -> None:
    """The engine tries a signature only on text that holds its anchor: a branch of the pattern
    without the anchor's literal can never match (a message reported in that wording is missed)."""
    import re

    missing = []
    for fc in load_kb().classes.values():
        for s in fc.signatures:
            if not s.anchor:
                continue
            for alt in _top_level_alternatives(s.pattern.pattern):
                literal = re.sub(r"\\(.)", r"\1", re.sub(r"^\(\?[a-z]+\)", "", alt))
                if s.anchor not in literal and s.anchor.lower() not in literal.lower():
                    missing.append((fc.id, s.anchor, alt))
    assert not missing
