"""Terminal output of `ls` and `verify`: data strings are printed as they are (never as rich markup) and
with control characters escaped, whatever a checkpoint holds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ckptguard import Checkpointer

NASTY = {
    "open": "[bold red]x[/",
    "close": "[/]",
    "link": "[link=file:///etc]y[/link]",
    "term": "\x1b[2J\x1b]0;pwned\x07\rcarriage\x9b31m",
}
# Rich's own colours (SGR) are allowed on a terminal; nothing else that moves or retitles it.
_RICH_SGR = re.compile(r"\x1b\[[0-9;]*m")


# Markup and terminal controls often, any other character too.
_CHARS = st.one_of(
    st.sampled_from(list("[]/=\\#:bold red\x1b\x07\r\n\x9b\u202e\x00")), st.characters(blacklist_categories=("Cs",))
)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def _controls_left(out: str) -> list[str]:
    return [
        c
        for c in _RICH_SGR.sub("", out)
        if (ord(c) < 0x20 and c != "\n")
        or 0x7F <= ord(c) < 0xA0
        or c in "\u2028\u2029\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
    ]


def test_markup_and_escape_sequences_in_a_root_print_as_text(tmp_path: Path) -> None:
    root = tmp_path / "run[bold]\x1b]0;t\x07"
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.ones(8)}, metadata=NASTY)
    for terminal in ({}, {"FORCE_COLOR": "1", "COLUMNS": "300"}):
        for command in ("ls", "verify"):
            out = cli(command, str(root), env=terminal)
            assert out.returncode == 0, out.stdout + out.stderr
            assert "MarkupError" not in out.stderr and "Traceback" not in out.stderr, out.stderr
            assert _controls_left(out.stdout) == [], repr(out.stdout)
            assert "run[bold]\\x1b]0;t\\x07" in out.stdout, out.stdout
            if command == "ls":
                assert "[bold red]x[/" in out.stdout and '"[/]"' in out.stdout, out.stdout


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    values=st.lists(st.text(_CHARS, max_size=12), min_size=1, max_size=4),
    dirname=st.text(_CHARS.filter(lambda c: c not in "/\x00"), min_size=1, max_size=10),
)
def test_generated_strings_through_ls_and_verify(tmp_path: Path, values: list[str], dirname: str) -> None:
    from ckptguard.cli import _register, app

    _register()
    root = Path(tempfile.mkdtemp(dir=tmp_path)) / ("d" + dirname)
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.ones(2)}, metadata={f"k{i}": v for i, v in enumerate(values)})
    runner = CliRunner()
    for command in ("ls", "verify"):
        result = runner.invoke(app, [command, str(root)])
        assert result.exit_code == 0, (result.output, result.exception)
        assert _controls_left(result.output) == [], repr(result.output)
