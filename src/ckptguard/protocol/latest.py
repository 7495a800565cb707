"""The `latest` pointer: the one place its format is read and written, and the only two ways it moves.

`latest` names the checkpoint committed last (a hint for tools: loads list the root).
It also remembers the highest commit sequence number ever handed out in the root
(``high_seq``), so that a step deleted and saved again never gets its old number back.
It moves by compare-and-swap (:func:`ckptguard.protocol.cas.swap`), under the fence.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ckptguard.errors import CheckpointError, MalformedRecordError
from ckptguard.protocol import layout, records
from ckptguard.protocol.cas import Keep, Put, Remove, swap
from ckptguard.protocol.decisions import Committed, DomainListing, commit_order
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.records import LatestRecord
from ckptguard.storage import StorageBackend


def path(storage: StorageBackend) -> str:
    return storage.path(layout.LATEST)


def decode(data: bytes) -> LatestRecord | None:
    """The pointer, or None where it is unreadable (a hint: the listing decides, not `latest`)."""
    try:
        return records.decode(data, LatestRecord, layout.LATEST)
    except MalformedRecordError:
        return None


def read(storage: StorageBackend) -> LatestRecord | None:
    """The pointer (None: absent or unreadable)."""
    try:
        return decode(storage.read_bytes(path(storage), records.MAX_CONTROL_BYTES))
    except (FileNotFoundError, CheckpointError):
        return None


def problem(storage: StorageBackend) -> str | None:
    """Why the pointer cannot be read (None: it can, or there is none)."""
    where = path(storage)
    try:
        records.decode(storage.read_bytes(where, records.MAX_CONTROL_BYTES), LatestRecord, where)
    except FileNotFoundError:
        return None
    except (OSError, CheckpointError) as e:
        return str(e)
    return None


def high_seq(record: LatestRecord | None, seq: int | None = None) -> int:
    """The highest commit sequence number ``record`` names or remembers, and ``seq`` (0: none)."""
    if record is None:
        return seq or 0
    return max(record.seq or 0, record.high_seq or 0, seq or 0)


def _record(name: CheckpointName, seq: int | None, high: int) -> LatestRecord:
    return LatestRecord(step=name.step, dir=name.dirname, updated_at=time.time(), seq=seq, high_seq=high or None)


def move(
    storage: StorageBackend,
    name: CheckpointName,
    seq: int | None,
    *,
    fence: Callable[[], None],
    committed: Callable[[CheckpointName], bool],
) -> bool:
    """Point `latest` at ``name`` unless it already names a checkpoint committed later; whether it moved.

    "Later" is commit order (the sequence number), not the step number: after a
    rollback, step 110 committed after step 300 is the newer one. A writer that read
    an older pointer cannot overwrite a newer one written meanwhile, and a stalled job
    (whose commit is older than any commit of the job that took the root over) never
    moves it backwards. ``committed(name)``: whether the checkpoint a pointer names is
    still there (a pointer at a deleted checkpoint is replaced whatever its number).
    """

    def decide(cur: LatestRecord | None) -> Put[LatestRecord, bool] | Keep[bool]:
        if cur is not None and cur.seq is not None and (seq is None or cur.seq >= seq):
            cur_name = CheckpointName.parse(cur.dir or "")
            if cur_name is not None and cur_name != name and committed(cur_name):
                return Keep(False)
        return Put(_record(name, seq, high_seq(cur, seq)), True)

    moved: bool = swap(
        storage, path(storage), decode=decode, encode=records.encode, decide=decide, fence=fence, what="move `latest`"
    )
    return moved


def after_delete(storage: StorageBackend, deleted: int, left: DomainListing, *, fence: Callable[[], None]) -> None:
    """If `latest` names the step ``deleted``, point it at the checkpoint committed last of those ``left``
    (or remove it); the deleted step's number is remembered, never handed out again."""

    def decide(cur: LatestRecord | None) -> Put[LatestRecord, None] | Remove[None] | Keep[None]:
        if cur is None or cur.step != deleted:
            return Keep(None)  # absent, unreadable (the next commit replaces it), or naming another step
        agreed = {st: Committed(max(vs), vs[max(vs)]) for st, vs in left.items() if vs}
        if not agreed:
            return Remove(None)
        last = commit_order(agreed)[-1]
        return Put(_record(CheckpointName(last, agreed[last].version), agreed[last].seq, high_seq(cur)), None)

    swap(storage, path(storage), decode=decode, encode=records.encode, decide=decide, fence=fence, what="move `latest`")


def names(record: LatestRecord | None, name: CheckpointName) -> bool:
    """Whether the pointer names the checkpoint ``name``."""
    return record is not None and record.dir == name.dirname


__all__ = ["LatestRecord", "after_delete", "decode", "high_seq", "move", "names", "path", "problem", "read"]
