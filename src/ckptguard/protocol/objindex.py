"""The catalog of an object-store root (``.ckptguard/index.json``): every commit in order, with its state.

Moved by compare-and-swap on its ETag (:mod:`ckptguard.protocol.cas`); its epoch is the fence of
object-store roots (see :mod:`ckptguard.protocol.objstore`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from ckptguard.protocol import records
from ckptguard.protocol.layout import CheckpointName

INDEX_FORMAT = "ckptguard-index"


@dataclass
class IndexEntry:
    step: int
    version: int
    attempt: str
    state: str  # "pending" (intent recorded, commit object maybe created), "committed", "aborted"
    epoch: int  # the index epoch of the job that recorded it
    seq: int | None = None  # commit sequence number, in commit order (committed entries)

    @property
    def name(self) -> CheckpointName:
        return CheckpointName(self.step, self.version)


@dataclass
class Index:
    epoch: int = 0
    next_seq: int = 1
    entries: list[IndexEntry] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        body = {
            "format": INDEX_FORMAT,
            "epoch": self.epoch,
            "next_seq": self.next_seq,
            "entries": [asdict(e) for e in self.entries],
        }
        return (json.dumps(body, separators=(",", ":")) + "\n").encode()

    @staticmethod
    def from_bytes(data: bytes, path: str) -> Index:
        body = records.decode(data, records.IndexBody, path, max_bytes=records.MAX_INDEX_BYTES)
        return Index(
            body.epoch,
            body.next_seq,
            [IndexEntry(e.step, e.version, e.attempt, e.state, e.epoch, e.seq) for e in body.entries],
        )

    def find(self, name: CheckpointName) -> IndexEntry | None:
        for e in self.entries:
            if e.step == name.step and e.version == name.version:
                return e
        return None


def tombstone_record(attempt: str, epoch: int) -> bytes:
    """What holds the commit key of an attempt that must never commit (a pending intent aborted)."""
    return records.encode(records.TombstoneRecord("ckptguard-tombstone", attempt, epoch, time.time()))
