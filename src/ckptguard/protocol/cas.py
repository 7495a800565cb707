"""The one compare-and-swap loop for every pointer that moves by CAS: `latest`, tags, the S3 index, the lease.

A pointer moves in rounds: read it with its version token, decide from what is
there, write over that very version (or create it, or delete it). Another
writer between the read and the write makes the swap fail, and the round starts
again from a fresh read.

The fence (this job still holds the root: its lease, its index epoch) is
checked in every round, after the decision, by the storage itself once the new
content is staged and immediately before the step that makes it visible (the
link or rename of a synced temp file; the conditional PUT): a job that lost the
root while it waited, stalled, met a conflict or synced the new content changes
nothing. A check once before the loop would let the rounds after a conflict
overwrite what the new holder wrote; a check before staging would let a job
stopped inside the fsync create or move a pointer after a takeover.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ckptguard.errors import CheckpointError
from ckptguard.storage import StorageBackend

R = TypeVar("R")  # the record as decoded
W = TypeVar("W")  # the record to write
T = TypeVar("T")  # what the caller gets back


@dataclass(frozen=True)
class Put(Generic[W, T]):
    """Write ``record`` over the version read (create it if there was none); then return ``result``."""

    record: W
    result: T


@dataclass(frozen=True)
class Remove(Generic[T]):
    """Delete the record, only the version read; then return ``result``."""

    result: T


@dataclass(frozen=True)
class Keep(Generic[T]):
    """Change nothing; return ``result``."""

    result: T


class SwapConflictError(CheckpointError):
    """The pointer kept changing under this job for every round allowed."""


def swap(
    storage: StorageBackend,
    path: str,
    *,
    decode: Callable[[bytes], R],
    encode: Callable[[W], bytes],
    decide: Callable[[R | None], Put[W, T] | Remove[T] | Keep[T]],
    fence: Callable[[], None] | None,
    what: str,
    rounds: int = 16,
    pause_s: float = 0.01,
) -> T:
    """Move the record at ``path`` by compare-and-swap; ``decide``'s result once a round's write lands.

    ``decode`` turns the bytes read into a record (None is passed to ``decide``
    when there is no record); ``decide`` may raise to refuse the change, and must
    be idempotent (a write retried after a lost reply may already have landed).
    ``fence`` raises (LeaseLostError) when this job no longer holds the root; it
    runs before every write, as late as the storage allows (see :func:`swap_once`).
    (Every parameter after ``path`` is keyword-only: each pointer names its record's
    codec, its decision and its fence at the call, which is the point of one loop.)
    """
    for attempt in range(rounds):
        current = storage.read_versioned(path)
        decision = decide(decode(current[0]) if current is not None else None)
        if isinstance(decision, Keep):
            return decision.result
        if swap_once(
            storage, path, current, None if isinstance(decision, Remove) else encode(decision.record), fence=fence
        ):
            return decision.result
        if attempt + 1 < rounds and pause_s > 0:
            time.sleep(pause_s * min(8, attempt + 1))
    raise SwapConflictError(f"could not {what}: {path} kept changing under this job ({rounds} tries)", path=path)


def swap_once(
    storage: StorageBackend,
    path: str,
    current: tuple[bytes, str] | None,
    data: bytes | None,
    *,
    fence: Callable[[], None] | None = None,
) -> bool:
    """One swap over the version ``current`` read (None: create only if absent; ``data`` None: a
    compare-and-delete); whether it landed. The write of every round of :func:`swap`, and the lease's
    takeover, which is one round judged by the acquiring loop (see ``Lease.acquire``). ``fence`` runs
    inside the storage's swap, after the new content is staged and right before it becomes visible.

    A swap whose answer was lost may have landed: it is settled by reading the
    record back (ours: landed; anything else: this round lost, and a late
    arrival of the lost request cannot land any more, its version being gone).
    A read-back that fails too leaves the outcome unknown: the OSError is raised.
    """
    try:
        if data is None:
            return current is None or storage.delete_if_version(path, current[1], fence=fence)
        return storage.compare_and_swap(path, data, current[1] if current is not None else None, fence=fence)
    except OSError:
        after = storage.read_versioned(path)
        if data is None:
            return after is None
        if after is not None and after[0] == data:
            return True
        if after is not None and current is not None:
            unchanged = after[1] == current[1]
        else:
            unchanged = after is None and current is None
        if unchanged:
            raise  # nothing changed: the request failed before it landed (or is still in flight)
        return False
