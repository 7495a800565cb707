"""What the ranks of a framework's process group share: one rank acts, every rank learns the outcome.

Code that runs inside a framework's collective schedule (a Trainer callback, a checkpoint engine, a
strategy) often has one rank do something, committing a checkpoint, reading a pointer, and every
rank must continue from the same outcome:

    from ckptguard.ranks import one_rank_acts
    step = one_rank_acts("commit the checkpoint", lambda: commit_on_this_rank())

Every function here is collective over the default process group (``torch.distributed``'s
``WORLD``, whatever its backend: the framework set it up) and works without one (one process).
A failure of the acting rank is raised on every rank as the *same* class: a
:class:`~ckptguard.CorruptCheckpointError` on rank 0 is a ``CorruptCheckpointError`` everywhere,
with rank 0's message, so that every rank takes the same branch (``except``, fall back, give up);
:func:`falls_back` tells, from what every rank agreed on, whether a failed load may try an older
checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ckptguard import comm
from ckptguard.protocol.fallback import falls_back

T = TypeVar("T")

__all__ = ["all_gather", "barrier", "broadcast", "falls_back", "one_rank_acts"]


def one_rank_acts(what: str, act: Callable[[], T], *, where: str | None = None) -> T:
    """Rank 0 runs ``act()``; every rank returns its result, or raises its failure as the same class.

    ``what`` completes "rank 0 could not ..." in the message the other ranks raise; ``where`` names
    the directory an ``OSError`` of ``act`` happened under (it becomes a typed error, e.g.
    :class:`~ckptguard.StoragePermissionError`, on every rank). Rank 0 raises its own exception
    object; an exception that is no :class:`~ckptguard.CheckpointError` arrives elsewhere as a
    :class:`~ckptguard.PeerError` naming its class. The result must pickle (one broadcast).
    """
    return comm.world_one_rank_acts(what, act, where=where)


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (``value`` without a process group). For a value rank 0 only
    *has*; a value rank 0 must *compute*, which may fail, goes through :func:`one_rank_acts`."""
    return comm.world_broadcast(value)


def all_gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank (``[value]`` without a process group)."""
    return comm.world_all_gather(value)


def barrier() -> None:
    """Every rank waits for all the others (nothing without a process group)."""
    comm.world_barrier()
