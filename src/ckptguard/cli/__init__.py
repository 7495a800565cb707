"""Command-line interface: `ckptguard ls|verify|diagnose|explain`.

Each group of commands lives in its own module and registers itself on ``app``;
commands import the heavy parts (torch) lazily so that `diagnose` starts fast.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="ckptguard",
    help="Race-free checkpoints for distributed PyTorch: verify them, and diagnose crashed runs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from ckptguard._version import __version__

        typer.echo(f"ckptguard {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", "-V", help="Print the version and exit.",
                                       callback=_version, is_eager=True)) -> None:
    """Race-free checkpoints for distributed PyTorch: verify them, and diagnose crashed runs."""


def _register() -> None:
    from ckptguard.cli import checkpoint_cmd, diagnose_cmd, interop_cmd, run_cmd  # noqa: F401


def main() -> None:
    import sys

    if sys.argv[1:2] == ["run"]:  # before typer: see cli/run_cmd.py
        from ckptguard.cli.run_cmd import main as run_main

        sys.exit(run_main(sys.argv[2:]))
    _register()
    app()
