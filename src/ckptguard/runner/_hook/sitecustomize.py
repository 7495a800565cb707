"""Started by `ckptguard run --hang-timeout` in every Python process of the job (this directory
is put first on PYTHONPATH): a stack dump on a signal, needing no privileges.

``faulthandler`` is registered for the signal ``CKPTGUARD_STACK_SIGNAL`` with all threads, writing
to ``CKPTGUARD_STACKS_DIR/rank<RANK>_pid<pid>.txt`` (``pid<pid>.txt`` for a process that is not a
rank, such as the launcher). The runner sends the signal only to processes that have such a file
and catch the signal, so a process that is not Python, or forked from one, is never hit by it.
A process that learns its rank from ``init_process_group`` (``torch.multiprocessing`` spawn or
fork, no RANK in the environment) renames its file to ``rank<r>_pid<pid>.txt``; a forked child
opens its own file, ``pid<pid>.fork.txt`` (a data-loader worker, a helper: not a rank until it
says so). Importing modules counts as progress (a launcher or a rank importing torch is silent for seconds
on a loaded node): a finder first on ``sys.meta_path`` touches ``CKPTGUARD_HEARTBEAT`` at most
twice a second while imports go on, and finds nothing itself. Then the ``sitecustomize`` this one
shadows, if any, is run. Standard library only; nothing here
may raise into the job.
"""

import os


def _install(forked: bool = False) -> None:
    directory = os.environ.get("CKPTGUARD_STACKS_DIR")
    signum = os.environ.get("CKPTGUARD_STACK_SIGNAL", "")
    if not directory or not signum.isdigit():
        return
    import faulthandler

    rank = "" if forked else os.environ.get("RANK", "")  # a forked child is not its parent's rank
    name = f"rank{rank}_pid{os.getpid()}.txt" if rank.isdigit() else f"pid{os.getpid()}{'.fork' if forked else ''}.txt"
    try:
        f = open(os.path.join(directory, name), "a")  # noqa: SIM115 - open for the process's life
        faulthandler.register(int(signum), file=f, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError):
        return
    old = globals().get("_stack_file")
    globals()["_stack_file"] = f  # kept referenced: faulthandler holds only its descriptor
    globals()["_stack_path"] = os.path.join(directory, name)
    if old is not None:  # a forked child: the parent's file stays the parent's
        try:  # noqa: SIM105 - contextlib is not imported at startup
            old.close()
        except OSError:
            pass


def _name_rank(rank: int) -> None:
    """The process learned its rank (``init_process_group`` with an explicit rank, no RANK in the
    environment): rename its stack file so the runner knows it."""
    old = globals().get("_stack_path")
    if not old:
        return
    head, base = os.path.split(old)
    if base.startswith("rank"):
        return
    new = os.path.join(head, f"rank{rank}_{base.replace('.fork', '')}")
    try:
        os.rename(old, new)
        globals()["_stack_path"] = new
    except OSError:
        pass


def _wrap_init(module: object) -> None:
    """Wrap ``torch.distributed.distributed_c10d.init_process_group`` to learn the rank."""
    import functools

    init = getattr(module, "init_process_group", None)
    get_rank = getattr(module, "get_rank", None)
    if init is None or get_rank is None:
        return

    @functools.wraps(init)
    def init_process_group(*args: object, **kwargs: object) -> object:
        out = init(*args, **kwargs)
        try:  # noqa: SIM105 - contextlib is not imported at startup
            _name_rank(int(get_rank()))
        except Exception:
            pass
        return out

    module.init_process_group = init_process_group  # type: ignore[attr-defined]


class _ImportBeat:
    """A meta path finder that finds nothing: each import is a heartbeat (at most one per 0.5 s)."""

    def __init__(self, path: str) -> None:
        import time

        self._path = path
        self._clock = time.monotonic
        self._last = 0.0

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name == _C10D:
            return _c10d_spec(name, path)
        now = self._clock()
        if now - self._last < 0.5:
            return None
        self._last = now
        try:
            os.utime(self._path)
        except OSError:
            try:  # noqa: SIM105 - contextlib is not imported at startup
                os.close(os.open(self._path, os.O_WRONLY | os.O_CREAT, 0o644))
            except OSError:
                pass
        return None


_C10D = "torch.distributed.distributed_c10d"


def _c10d_spec(name: str, path: object) -> object:
    """The module's own spec, its loader wrapped to patch ``init_process_group`` once loaded."""
    try:
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)  # type: ignore[arg-type]
        loader = spec.loader if spec is not None else None
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return None

        def exec_and_wrap(module: object) -> None:
            exec_module(module)
            _wrap_init(module)

        loader.exec_module = exec_and_wrap  # type: ignore[union-attr,method-assign]
        return spec
    except Exception:
        return None


def _beat_on_imports() -> None:
    path = os.environ.get("CKPTGUARD_HEARTBEAT")
    if path:
        import sys

        sys.meta_path.insert(0, _ImportBeat(path))  # type: ignore[arg-type]


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
    os.register_at_fork(after_in_child=lambda: _install(forked=True))  # a forked rank gets its own stack file
except Exception:  # a stack dump that cannot be set up must not stop the job
    pass
_chain()
