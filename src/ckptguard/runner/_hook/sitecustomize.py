"""Started by `ckptguard run --hang-timeout` in every Python process of the job (this directory
is put first on PYTHONPATH): a stack dump on a signal, needing no privileges.

``faulthandler`` is registered for the signal ``CKPTGUARD_STACK_SIGNAL`` with all threads, writing
to ``CKPTGUARD_STACKS_DIR/rank<RANK>_pid<pid>.txt`` (``pid<pid>.txt`` for a process that is not a
rank, such as the launcher). The runner sends the signal only to processes that have such a file
and catch the signal, so a process that is not Python, or forked from one, is never hit by it.
Importing modules counts as progress (a launcher or a rank importing torch is silent for seconds
on a loaded node): a finder first on ``sys.meta_path`` touches ``CKPTGUARD_HEARTBEAT`` at most
twice a second while imports go on, and finds nothing itself. Then the ``sitecustomize`` this one
shadows, if any, is run. Standard library only; nothing here
may raise into the job.
"""

import os


def _install() -> None:
    directory = os.environ.get("CKPTGUARD_STACKS_DIR")
    signum = os.environ.get("CKPTGUARD_STACK_SIGNAL", "")
    if not directory or not signum.isdigit():
        return
    import faulthandler

    rank = os.environ.get("RANK", "")
    name = f"rank{rank}_pid{os.getpid()}.txt" if rank.isdigit() else f"pid{os.getpid()}.txt"
    try:
        f = open(os.path.join(directory, name), "a")  # noqa: SIM115 - open for the process's life
        faulthandler.register(int(signum), file=f, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError):
        return
    globals()["_stack_file"] = f  # kept referenced: faulthandler holds only its descriptor


class _ImportBeat:
    """A meta path finder that finds nothing: each import is a heartbeat (at most one per 0.5 s)."""

    def __init__(self, path: str) -> None:
        import time

        self._path = path
        self._clock = time.monotonic
        self._last = 0.0

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        now = self._clock()
        if now - self._last < 0.5:
            return
        self._last = now
        try:
            os.utime(self._path)
        except OSError:
            try:  # noqa: SIM105 - contextlib is not imported at startup
                os.close(os.open(self._path, os.O_WRONLY | os.O_CREAT, 0o644))
            except OSError:
                pass


def _beat_on_imports() -> None:
    path = os.environ.get("CKPTGUARD_HEARTBEAT")
    if path:
        import sys

        sys.meta_path.insert(0, _ImportBeat(path))


def _chain() -> None:
    """Run the ``sitecustomize`` further down the path (the environment's own), as Python would have."""
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    saved = sys.path[:]
    ours = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import importlib

        importlib.import_module("sitecustomize")
    except ImportError as e:
        if e.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    finally:
        sys.path[:] = saved


try:
    _install()
    _beat_on_imports()
except Exception:  # a stack dump that cannot be set up must not stop the job
    pass
_chain()
