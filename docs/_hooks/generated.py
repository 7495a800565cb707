"""MkDocs hook: the reference pages that are generated from the code, never kept by hand.

A page asks for a generated section with a marker line:

- ``<!-- generated:cli -->``: the help of ``ckptguard`` and of each of its commands, as the installed
  CLI prints it (one subprocess per command, so what is shown is what a user sees);
- ``<!-- generated:errors -->``: the tree of ``CheckpointError`` subclasses, from ``ckptguard.errors``;
- ``<!-- generated:kb -->``: the failure classes of the diagnosis knowledge base, from
  ``src/ckptguard/diagnose/kb/*.toml``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
KB_DIR = SRC / "ckptguard" / "diagnose" / "kb"


# Run in one subprocess, as the installed `ckptguard` entry point runs: what a user sees, in plain text
# (TYPER_USE_RICH=0), for the top level and every command listed in `ckptguard --help`.
_HELP_SCRIPT = r"""
import contextlib, io, json, sys
from typer.main import get_command
from ckptguard.cli import _register, app, main

_register()
group = get_command(app)
names = [n for n in group.list_commands(None) if not group.commands[n].hidden]
out = {}
for args in [[]] + [[n] for n in names]:
    sys.argv = ["ckptguard", *args, "--help"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            main()
        except SystemExit as e:
            if e.code not in (0, None):
                raise
    out[" ".join(args)] = buf.getvalue().rstrip()
print(json.dumps(out))
"""


def _cli_helps() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(SRC), COLUMNS="100", TERM="dumb", NO_COLOR="1", TYPER_USE_RICH="0")
    proc = subprocess.run([sys.executable, "-c", _HELP_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"collecting the CLI's help failed ({proc.returncode}): {proc.stderr.strip()}")
    helps: dict[str, str] = json.loads(proc.stdout)
    return helps


def cli_reference() -> str:
    """The top-level help, then one section per command with its ``--help``."""
    out: list[str] = []
    for command, text in _cli_helps().items():
        title = f"ckptguard {command}".strip()
        out += [f"## `{title}`", "", "```text", text, "```", ""]
    return "\n".join(out)


def error_tree() -> str:
    """A nested list of the error classes, each linked to its API entry, with its docstring's first line."""
    sys.path.insert(0, str(SRC))
    from ckptguard import errors

    lines: list[str] = []

    def walk(cls: type[BaseException], depth: int) -> None:
        doc = (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        doc = " ".join(doc.split())
        bases = [b.__name__ for b in cls.__bases__ if not issubclass(b, errors.CheckpointError)]
        also = f" (also a `{'`, `'.join(bases)}`)" if bases else ""
        lines.append(f"{'    ' * depth}- [`{cls.__name__}`][ckptguard.errors.{cls.__name__}]{also}: {doc}")
        for sub in sorted(cls.__subclasses__(), key=lambda c: c.__name__):
            if sub.__module__ == errors.__name__:
                walk(sub, depth + 1)

    walk(errors.CheckpointError, 0)
    return "\n".join(lines)


def kb_reference() -> str:
    """One section per failure class, grouped by category, from the knowledge base's TOML files."""
    classes: list[dict[str, Any]] = []
    for path in sorted(KB_DIR.glob("*.toml")):
        if path.name.startswith("_"):
            continue
        with path.open("rb") as f:
            entry = tomllib.load(f)
        entry["_file"] = path.name
        classes.append(entry)
    by_category: dict[str, list[dict[str, Any]]] = {}
    for entry in classes:
        by_category.setdefault(str(entry.get("category", "other")), []).append(entry)
    out = [f"{len(classes)} failure classes in {len(by_category)} categories. "
           "`ckptguard explain CLASS` prints the same entry in a terminal.", ""]
    for category in sorted(by_category):
        out += [f"## {category}", ""]
        for entry in sorted(by_category[category], key=lambda e: str(e["id"])):
            out += [f"### `{entry['id']}`: {entry.get('title', '')}", ""]
            if entry.get("collateral"):
                out += ["*Collateral: a consequence of another rank's failure, not a cause.*", ""]
            out += [str(entry.get("summary", "")).strip(), ""]
            symptoms = entry.get("symptoms") or []
            if symptoms:
                out += ["**Symptoms**", ""] + [f"- `` {s} ``" for s in symptoms] + [""]
            fix = str(entry.get("fix", "")).strip()
            if fix:
                out += ["**Fix**", "", " ".join(fix.split()), ""]
            prevention = entry.get("prevention") or []
            if prevention:
                out += ["**Prevention**", ""] + [f"- {p}" for p in prevention] + [""]
            out += [f"<small>Source: `src/ckptguard/diagnose/kb/{entry['_file']}`</small>", ""]
    return "\n".join(out)


_GENERATORS = {
    "<!-- generated:cli -->": cli_reference,
    "<!-- generated:errors -->": error_tree,
    "<!-- generated:kb -->": kb_reference,
}


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace each generator's marker line with what it generates."""
    for marker, generate in _GENERATORS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return markdown
