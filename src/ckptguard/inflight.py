"""Saves still in flight when the process group or the process goes away: finished, or reported.

A script that ends with ``save(blocking=False)`` then ``destroy_process_group()``
would tear down the group the background save agrees on; one that just exits
would lose a failed save without a word. This module makes
``torch.distributed.destroy_process_group()`` wait for in-flight saves first, and
at exit (background threads have been joined by then) prints a failed save nobody
waited for and makes the process exit with status 1.

Then, if the script left a gloo default process group alive, it is destroyed: PyTorch
aborts now and then ("terminate called without an active exception", SIGABRT) when a
process exits with gloo groups alive (5 of 16 runs of a bare torch script here, 0 of 16
when it is destroyed at exit), and a job that checkpointed would otherwise end in a
signal after its checkpoint was safe.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import sys
import weakref
from concurrent.futures import Future
from typing import Any, Protocol


class _Saver(Protocol):
    @property
    def root(self) -> str: ...
    def wait(self) -> None: ...
    def pending_save(self) -> Future[None] | None: ...


_live: weakref.WeakSet[Any] = weakref.WeakSet()
_hook_installed = False
_tracked_any = False  # a Checkpointer was made in this process


def _forget_in_child() -> None:
    """A forked child has none of its parent's saving threads: it must not wait at exit for saves
    that only the parent will finish (it waited forever), nor report or destroy the parent's group."""
    global _tracked_any
    _live.clear()
    _tracked_any = False


os.register_at_fork(after_in_child=_forget_in_child)


def track(saver: _Saver) -> None:
    """Watch ``saver``'s background saves until it is garbage."""
    global _tracked_any
    _live.add(saver)
    _tracked_any = True
    _install_destroy_hook()


def _install_destroy_hook() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` (code that imported the function by name
    before ckptguard was imported keeps the original: call ``ck.wait()`` there)."""
    global _hook_installed
    import torch.distributed as dist

    if _hook_installed or not dist.is_available():
        return
    _hook_installed = True
    original = dist.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        first: BaseException | None = None
        for saver in list(_live):
            try:
                saver.wait()
            except BaseException as e:
                first = first or e
        result = original(*args, **kwargs)
        if first is not None:
            raise first
        return result

    dist.destroy_process_group = destroy_process_group


def _report_unwaited_saves() -> None:
    failed = False
    for saver in list(_live):
        pending = saver.pending_save()
        if pending is None:
            continue
        try:
            pending.result()
        except BaseException as e:
            failed = True
            print(
                f"ckptguard: a background save to {saver.root} failed and was never waited for: "
                f"{type(e).__name__}: {e}",
                file=sys.stderr,
                flush=True,
            )
    if failed:
        sys.stdout.flush()
        os._exit(1)
    if _tracked_any:
        _destroy_a_gloo_world_left_alive()
        # Checkpointers nobody closed are cyclic garbage holding gloo groups: freed now, while the
        # interpreter is whole, not by the collection of its shutdown (the same abort as above).
        gc.collect()


def _destroy_a_gloo_world_left_alive() -> None:
    # Only a gloo default group: destroying NCCL at exit can block on peers that are gone.
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.destroy_process_group()
    except Exception:  # the process is exiting: nothing to report to
        pass


atexit.register(_report_unwaited_saves)
