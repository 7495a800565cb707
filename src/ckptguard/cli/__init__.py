"""Command-line interface: `ckptguard ls|verify|diagnose|explain|export|import`.

Each group of commands lives in its own module and registers itself on ``app``;
commands import the heavy parts (torch) lazily so that `diagnose` starts fast.
A usage error (a bad option or argument, an error a command does not handle itself) ends the
process with one line on stderr and exit status 2, never a traceback; ``ckptguard --debug ...``
prints the traceback to stderr as well, with the same exit status.
"""

from __future__ import annotations

import sys
import traceback

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
def _root(
    version: bool = typer.Option(
        False, "--version", "-V", help="Print the version and exit.", callback=_version, is_eager=True
    ),
    debug: bool = typer.Option(False, "--debug", help="Show the traceback of an error."),
) -> None:
    """Race-free checkpoints for distributed PyTorch: verify them, and diagnose crashed runs."""
    global _debug
    _debug = debug


def debugging() -> bool:
    """Whether ``--debug`` was given: errors a command handles are then raised with their traceback."""
    return _debug or "--debug" in sys.argv[1:]


def _register() -> None:
    from ckptguard.cli import checkpoint_cmd, diagnose_cmd, interop_cmd, run_cmd  # noqa: F401


def main() -> None:
    if sys.argv[1:2] == ["run"]:  # before typer: see cli/run_cmd.py
        from ckptguard.cli.run_cmd import main as run_main

        sys.exit(run_main(sys.argv[2:]))
    _register()
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
    from typer.exceptions import Abort

    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as e:
        typer.echo(e.ctx.get_help() if e.ctx is not None else str(e), err=True)
        code = USAGE_EXIT
    except ClickException as e:  # a bad option or argument: one line, as for every other usage error
        if debugging():
            traceback.print_exc()
        ctx = getattr(e, "ctx", None)
        where = f"; see {ctx.command_path} --help" if ctx is not None else ""
        sys.stderr.write(f"error: {_one_line_text(e.format_message())}{where}\n")
        code = e.exit_code
    except Abort:
        sys.stderr.write("aborted\n")
        code = 1
    except Exception as e:  # an error no command handles itself
        if debugging():
            traceback.print_exc()
        sys.stderr.write(
            f"error: {_one_line(e)}" + ("" if debugging() else " (ckptguard --debug ... shows the traceback)") + "\n"
        )
        code = USAGE_EXIT
    sys.exit(code if isinstance(code, int) else 0)


def fail(message: str, code: int = USAGE_EXIT) -> typer.Exit:
    """Print ``message`` as one ``error:`` line on stderr and return the exit to raise. With ``--debug`` the
    traceback (of the error being handled, or of this call) is printed first; the exit code stays the same."""
    from rich.markup import escape

    from ckptguard.cli.output import console, escape_controls

    if debugging():
        if sys.exc_info()[1] is not None:
            traceback.print_exc()
        else:  # refused by the command itself: where it was refused
            sys.stderr.write("Traceback (most recent call last):\n")
            traceback.print_stack(sys._getframe(1))
    console(stderr=True).print(f"[red]error:[/red] {escape(escape_controls(message))}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _one_line_text(text: str) -> str:
    return " ".join(text.split()) or "(no message)"


def _one_line(e: BaseException) -> str:
    from ckptguard.errors import CheckpointError

    text = _one_line_text(str(e))
    return text if isinstance(e, CheckpointError) else f"{type(e).__name__}: {text}"
