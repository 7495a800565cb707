"""Command-line interface: `ckptguard ls|verify|diagnose|explain|export|import`.

Each group of commands lives in its own module and registers itself on ``app``;
commands import the heavy parts (torch) lazily so that `diagnose` starts fast.
An error a command does not handle itself ends the process with one line on stderr and
exit status 2, never a traceback; ``ckptguard --debug ...`` shows the traceback instead.
"""

from __future__ import annotations

import sys

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


USAGE_EXIT = 2
_debug = False


@app.callback()
def _root(version: bool = typer.Option(False, "--version", "-V", help="Print the version and exit.",
                                       callback=_version, is_eager=True),
          debug: bool = typer.Option(False, "--debug", help="Show the traceback of an error.")) -> None:
    """Race-free checkpoints for distributed PyTorch: verify them, and diagnose crashed runs."""
    global _debug
    _debug = debug


def debugging() -> bool:
    """Whether ``--debug`` was given: errors a command handles are then raised with their traceback."""
    return _debug or "--debug" in sys.argv[1:]


def _register() -> None:
    from ckptguard.cli import checkpoint_cmd, diagnose_cmd, interop_cmd, run_cmd  # noqa: F401


def main() -> None:
    import sys

    if sys.argv[1:2] == ["run"]:  # before typer: see cli/run_cmd.py
        from ckptguard.cli.run_cmd import main as run_main

        sys.exit(run_main(sys.argv[2:]))
    _register()
    try:
        app()
    except Exception as e:  # Click handles its own usage errors (exit 2); this is everything else
        if debugging():
            raise
        sys.stderr.write(f"error: {_one_line(e)} (ckptguard --debug ... shows the traceback)\n")
        sys.exit(USAGE_EXIT)


def _one_line(e: BaseException) -> str:
    from ckptguard.errors import CheckpointError

    text = " ".join(str(e).split()) or "(no message)"
    return text if isinstance(e, CheckpointError) else f"{type(e).__name__}: {text}"
