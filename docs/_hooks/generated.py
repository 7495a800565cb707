"""MkDocs hook: the reference pages that are generated from the code, never kept by hand.

A page asks for a generated section with a marker line:

- ``<!-- generated:cli -->``: the help of ``ckptguard`` and of each of its commands, as the installed
  CLI prints it (one subprocess per command, so what is shown is what a user sees);
- ``<!-- generated:errors -->``: the tree of ``CheckpointError`` subclasses, from ``ckptguard.errors``;
- ``<!-- generated:other-errors -->``: the exceptions defined elsewhere in ``src/ckptguard`` that a user can meet
  (``OTHER_ERRORS``), each with where it is met;
- ``<!-- generated:kb -->``: the failure classes of the diagnosis knowledge base, from
  ``src/ckptguard/diagnose/kb/*.toml``.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, NamedTuple

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


#: Exception classes defined outside ``ckptguard.errors`` that reach a user, and where they are met.
OTHER_ERRORS: dict[str, str] = {
    "ckptguard.dcp._torch_private.TorchVersionError":
        "`from ckptguard import Checkpointer` (and every import that loads the checkpointing code) on a torch "
        "that lacks a private API ckptguard uses; the message names the torch versions tested. An "
        "`ImportError`, not a `CheckpointError`: install a tested torch.",
    "ckptguard.protocol.cas.SwapConflictError":
        "a save, `tag()`/`untag()` or retention when a control record (the `latest` pointer, a tag, an object "
        "store's index) kept changing under the job for every retry allowed: another writer changes the same "
        "root, or the store does not honour conditional writes.",
    "ckptguard.diagnose.schema.KBError":
        "`ckptguard diagnose` and `ckptguard explain` when a file of the failure knowledge base is malformed "
        "(one `error:` line, exit status 2): reinstall ckptguard, or fix the TOML file the message names.",
    "ckptguard.diagnose.ingest.UsageError":
        "`ckptguard diagnose` given a path that does not exist, a directory with no log, a binary file or a file "
        "it cannot read (one `error:` line, exit status 2).",
}

#: Exception classes a user never meets: caught inside ckptguard and turned into what is said here.
INTERNAL_ERRORS: dict[str, str] = {
    "ckptguard.protocol.itemcolumns.TableError": "a `CorruptCheckpointError` naming the manifest",
    "ckptguard.runner.logdir.LogDirError": "`ckptguard run`: one line on stderr and exit status 125",
    "ckptguard.runner.child.CommandNotFound": "`ckptguard run`: exit status 127 or 126, as a shell's",
    "ckptguard.dcp.readjob.Stopped": "the failure of another file of the same load, which is raised instead",
}


class ExceptionClass(NamedTuple):
    """An exception class as its source defines it (read with ``ast``: nothing is imported, torch included)."""

    module: str
    name: str
    bases: tuple[str, ...]
    doc: str


def defined_exception_classes() -> dict[str, ExceptionClass]:
    """Every public exception class defined in ``src/ckptguard``, by ``module.Class``: a class whose base is a
    built-in exception or, transitively, another such class of the package."""
    classes: dict[str, ExceptionClass] = {}
    for path in sorted((SRC / "ckptguard").rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = tuple(b.id if isinstance(b, ast.Name) else ast.unparse(b).rsplit(".", 1)[-1]
                              for b in node.bases)
                classes[f"{module}.{node.name}"] = ExceptionClass(module, node.name, bases,
                                                                  ast.get_docstring(node) or "")
    builtin = {name for name, obj in vars(builtins).items() if isinstance(obj, type) and issubclass(obj, BaseException)}
    known = set(builtin)
    while True:
        more = {c.name for c in classes.values() if c.name not in known and any(b in known for b in c.bases)}
        if not more:
            break
        known |= more
    return {q: c for q, c in classes.items() if c.name in known - builtin}


def other_errors() -> str:
    """A list of ``OTHER_ERRORS``: each class, what it derives from, its docstring's first line, where it is met."""
    defined = defined_exception_classes()
    lines: list[str] = []
    for qualified, where in OTHER_ERRORS.items():
        cls = defined[qualified]
        doc = " ".join(cls.doc.split("\n\n")[0].split())
        bases = ", ".join(f"`{b}`" for b in cls.bases)
        lines.append(f"- `{cls.name}` (`{cls.module}`; subclass of {bases}): {doc} Raised by {where}")
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
    "<!-- generated:other-errors -->": other_errors,
    "<!-- generated:kb -->": kb_reference,
}


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace each generator's marker line with what it generates."""
    for marker, generate in _GENERATORS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return markdown
