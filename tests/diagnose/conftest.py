"""Shared helpers for the diagnose tests: run the public CLI in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckptguard.cli import _register, app

FIXTURES = Path(__file__).parent / "fixtures"
SEED = FIXTURES / "olmo_894_seed.txt"  # copy of shared/seeds/000_f504ede596b47034.txt

_register()


@pytest.fixture(scope="session")
def runner() -> CliRunner:
    return CliRunner()


def cli_json(runner: CliRunner, *args: str) -> tuple[int, dict]:
    """`ckptguard diagnose ARGS --json` through typer; returns (exit code, parsed JSON)."""
    result = runner.invoke(app, ["diagnose", *args, "--json"])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)
