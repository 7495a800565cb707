"""The docs: the README's promises to CI, and the reference pages generated from the code.

The generators run here without mkdocs (the site itself is built by scripts/build_docs); each test names what
a reader of the built site would miss if it failed.
"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path
from types import ModuleType

import ckptguard
from ckptguard import errors

from tests.support.jobs import REPO

ROOT = REPO


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks_generated", ROOT / "docs" / "_hooks" / "generated.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_short_and_keeps_the_two_commands_verbatim() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail to a docs page"
    # .ci/run and users copy these lines exactly.
    assert "./scripts/setup && .venv/bin/python examples/demo/run_demo.py" in lines
    assert "./scripts/setup && .venv/bin/python -m pytest" in lines
    assert not re.search(r"\b\d+ passed\b", "\n".join(lines)), "no hard-coded test counts in the README"


def test_cli_reference_has_a_section_with_the_help_of_every_command() -> None:
    page = _hooks().cli_reference()
    sections = dict(re.findall(r"## `ckptguard ?([a-z]*)`\n\n```text\n(.*?)\n```", page, flags=re.S))
    for command in ["", "ls", "verify", "diagnose", "explain", "export", "import", "run"]:
        assert command in sections, f"no section for `ckptguard {command}`"
        assert "Usage" in sections[command] or "usage" in sections[command], sections[command]
    assert "--checkpoints" in sections["run"]  # argparse's help, not typer's stub
    assert "--step" in sections["verify"]


def test_knowledge_base_reference_has_every_class_of_the_toml_files() -> None:
    page = _hooks().kb_reference()
    kb = Path(ckptguard.__file__).parent / "diagnose" / "kb"
    ids = [tomllib.loads(p.read_text())["id"] for p in sorted(kb.glob("*.toml")) if not p.name.startswith("_")]
    assert ids
    for class_id in ids:
        assert f"### `{class_id}`" in page, class_id


def test_error_tree_names_every_exported_error_class_once() -> None:
    tree = _hooks().error_tree()
    exported = [name for name in ckptguard.__all__ if isinstance(getattr(errors, name, None), type)]
    assert "CheckpointError" in exported
    for name in exported:
        assert tree.count(f"[`{name}`]") == 1, name


def test_errors_page_lists_every_exception_class_a_user_can_meet() -> None:
    hooks = _hooks()
    tree, others = hooks.error_tree(), hooks.other_errors()
    for qualified in hooks.defined_exception_classes():
        module, name = qualified.rsplit(".", 1)
        if module == "ckptguard.errors":
            assert f"[`{name}`]" in tree, name
        elif qualified in hooks.OTHER_ERRORS:
            assert f"- `{name}` (`{module}`;" in others, name
        else:
            assert qualified in hooks.INTERNAL_ERRORS, (
                f"{qualified}: add it to OTHER_ERRORS (a user can meet it) or INTERNAL_ERRORS (never escapes) in "
                "docs/_hooks/generated.py"
            )
    assert "TorchVersionError" in others and "KBError" in others
