"""The integration registry: every registered framework's root is found by discovery, resumed with the
framework's own line, and named in the CLI's help; unregistered names fall back to the plain API."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckptguard import Checkpointer
from ckptguard.cli import _register, app
from ckptguard.discover import FoundRoot, find_roots
from ckptguard.frameworks import BY_NAME, FRAMEWORK_KEY, FRAMEWORKS, Framework, ResumePoint, plain_hint, resume_hint
from ckptguard.resume import resume_info

HIDDEN = [f for f in FRAMEWORKS if f.root_name is not None]


def _root(path: Path, step: int, metadata: dict[str, object]) -> Path:
    with Checkpointer(path, process_group="local") as ck:
        ck.save(step, {"w": torch.full((2,), float(step))}, metadata=metadata)
    return path


def test_names_modules_and_hidden_roots_are_unique() -> None:
    assert len(BY_NAME) == len(FRAMEWORKS)
    assert len({f.module for f in FRAMEWORKS}) == len(FRAMEWORKS)
    assert len({f.root_name for f in HIDDEN}) == len(HIDDEN)
    assert all(f.module.startswith("ckptguard.integrations.") for f in FRAMEWORKS)


@pytest.mark.parametrize("framework", HIDDEN, ids=lambda f: f.name)
def test_a_hidden_root_is_found_and_resumed_with_its_frameworks_line(tmp_path: Path, framework: Framework) -> None:
    f = framework
    assert f.root_name is not None
    out = tmp_path / "out"
    root = _root(out / f.root_name, 3, {FRAMEWORK_KEY: f.name, "tag": "global_step3"})
    (out / "notes").mkdir()
    assert find_roots(out) == [FoundRoot(str(root), f.name)]
    got = resume_info(str(out))
    assert got.step == 3 and got.framework == f.name
    assert got.resume_hint == f.hint(ResumePoint(str(root), 3, {FRAMEWORK_KEY: f.name, "tag": "global_step3"}))
    assert got.resume_hint != plain_hint(ResumePoint(str(root), 3, {}))


def test_a_root_named_in_its_metadata_is_recognised_without_a_hidden_name(tmp_path: Path) -> None:
    root = _root(tmp_path / "dump" / "checkpoint", 7, {FRAMEWORK_KEY: "torchtitan"})
    assert find_roots(tmp_path / "dump") == [FoundRoot(str(root), "torchtitan")]
    assert "torchtitan trainer" in resume_info(str(root)).resume_hint


def test_a_directory_named_beside_a_hidden_root_finds_it(tmp_path: Path) -> None:
    beside = [f for f in HIDDEN if f.beside is not None]
    assert beside, "Accelerate's project_dir/checkpoints is registered"
    for f in beside:
        assert f.root_name is not None and f.beside is not None
        project = tmp_path / f.name
        root = _root(project / f.root_name, 1, {FRAMEWORK_KEY: f.name})
        (project / f.beside).mkdir()
        assert find_roots(project / f.beside) == [FoundRoot(str(root), f.name)]


@pytest.mark.parametrize("framework", [None, "a-framework-not-registered"])
def test_an_unknown_framework_gets_the_plain_apis_line(framework: str | None) -> None:
    point = ResumePoint("/ckpt/root", 12, {})
    assert resume_hint(framework, point) == 'Checkpointer("/ckpt/root").load(state, step=12)'


def test_the_cli_names_every_hidden_root_and_every_frameworks_directory(tmp_path: Path) -> None:
    _register()
    result = CliRunner().invoke(app, ["ls", str(tmp_path)])
    assert result.exit_code == 3
    said = " ".join(result.output.split())
    assert all(f.root_name in said for f in HIDDEN), said
    usage = " ".join(CliRunner().invoke(app, ["ls", "--help"]).output.split())
    assert all(f.describes.replace("``", "").split()[-1] in usage for f in FRAMEWORKS), usage
