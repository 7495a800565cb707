"""Quarantine: the record a writing job leaves when one of its loads found a committed checkpoint corrupt.

    .ckptguard/quarantine/step-0000000N[.vV].json    one record per checkpoint found corrupt

The record names the checkpoint (step, version) and the commit sequence number it was listed
with, so it applies to that commit only: a step saved again gets a new number, and the record no
longer matches it. Listings read the records and skip what they name without reading the
checkpoint again (``load(step=None)``, ``ls``, ``verify``, ``ckptguard run --checkpoints``); the
next save of a quarantined step replaces it (as ``overwrite=True`` would) instead of raising
StepExistsError. A record is written and removed by compare-and-swap under the fence, like every
change to a root; older ckptguard versions do not read it (the on-disk format is unchanged).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Literal

import msgspec

from ckptguard.errors import CheckpointError, MalformedRecordError
from ckptguard.protocol import layout, records
from ckptguard.protocol.cas import Keep, Put, Remove, swap
from ckptguard.protocol.layout import CheckpointName
from ckptguard.storage import StorageBackend

#: Where the records are, under the root.
DIR = f"{layout.CONTROL}/quarantine"
_SUFFIX = ".json"
#: The reason is the load's error message, cut to this many characters.
MAX_REASON = 2000

Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON * 4)]


class QuarantineRecord(msgspec.Struct, frozen=True):
    """``.ckptguard/quarantine/<checkpoint>.json``: a committed checkpoint a load found corrupt."""

    format: Literal["ckptguard-quarantine"]
    step: records.NonNegative
    version: records.Positive
    seq: records.Positive | None
    reason: Reason
    at: float = 0.0

    @property
    def name(self) -> CheckpointName:
        return CheckpointName(self.step, self.version)

    def matches(self, seq: int | None) -> bool:
        """Whether the record is about the commit listed with sequence number ``seq`` (not a later save
        of the same step and version after a delete)."""
        return self.seq == seq


def record_path(storage: StorageBackend, name: CheckpointName) -> str:
    return storage.path(DIR, name.dirname + _SUFFIX)


def _decode(path: str) -> Callable[[bytes], QuarantineRecord]:
    def decode(data: bytes) -> QuarantineRecord:
        return records.decode(data, QuarantineRecord, path)

    return decode


def read_all(storage: StorageBackend) -> dict[CheckpointName, QuarantineRecord]:
    """Every readable record, by the checkpoint it names. A record that does not parse, or whose name
    and content disagree, quarantines nothing (the checkpoint is then read and judged by its bytes)."""
    out: dict[CheckpointName, QuarantineRecord] = {}
    for entry in storage.listdir(storage.path(DIR)):
        if not entry.endswith(_SUFFIX):
            continue
        name = CheckpointName.parse(entry[: -len(_SUFFIX)])
        if name is None:
            continue
        path = record_path(storage, name)
        try:
            record = records.decode(storage.read_bytes(path, records.MAX_CONTROL_BYTES), QuarantineRecord, path)
        except (FileNotFoundError, MalformedRecordError, CheckpointError):
            continue
        if record.name == name:
            out[name] = record
    return out


def write(
    storage: StorageBackend, name: CheckpointName, seq: int | None, reason: str, fence: Callable[[], None]
) -> QuarantineRecord:
    """Record ``name`` (listed with ``seq``) as corrupt; ``fence`` raises once this job lost the root.
    The record now in place."""
    path = record_path(storage, name)
    record = QuarantineRecord(
        format="ckptguard-quarantine",
        step=name.step,
        version=name.version,
        seq=seq,
        reason=reason[:MAX_REASON],
        at=time.time(),
    )

    def decide(current: QuarantineRecord | None) -> Put[QuarantineRecord, QuarantineRecord] | Keep[QuarantineRecord]:
        if current is not None and current.version == name.version and current.matches(seq):
            return Keep(current)  # recorded already (by another load, or this one's retried swap)
        return Put(record, record)

    storage.makedirs(storage.path(DIR))
    written: QuarantineRecord = swap(
        storage,
        path,
        decode=_lenient(path),
        encode=records.encode,
        decide=decide,
        fence=fence,
        what=f"quarantine {name.dirname}",
    )
    return written


def remove(storage: StorageBackend, name: CheckpointName, fence: Callable[[], None]) -> None:
    """Remove the record of ``name`` if there is one (its checkpoint was deleted, retired or replaced)."""
    path = record_path(storage, name)

    def decide(current: QuarantineRecord | None) -> Remove[None] | Keep[None]:
        return Keep(None) if current is None else Remove(None)

    swap(
        storage,
        path,
        decode=_lenient(path),
        encode=records.encode,
        decide=decide,
        fence=fence,
        what=f"remove the quarantine record of {name.dirname}",
    )


def _lenient(path: str) -> Callable[[bytes], QuarantineRecord]:
    """The decoder of a swap: an unreadable record is replaced or removed, not a reason to fail."""
    strict = _decode(path)

    def decode(data: bytes) -> QuarantineRecord:
        try:
            return strict(data)
        except MalformedRecordError:
            # version 0 names no checkpoint: never taken for the record being written
            return QuarantineRecord(format="ckptguard-quarantine", step=0, version=0, seq=None, reason="")

    return decode


def matching(
    found: dict[CheckpointName, QuarantineRecord], name: CheckpointName, seq: int | None
) -> QuarantineRecord | None:
    """The record of the commit ``name`` listed with ``seq``, if it is quarantined."""
    record = found.get(name)
    return record if record is not None and record.matches(seq) else None


__all__ = ["DIR", "QuarantineRecord", "matching", "read_all", "record_path", "remove", "write"]
