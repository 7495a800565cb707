"""The catalog of an object-store root (``.ckptguard/index.json``): every commit in order, with its state.

Moved by compare-and-swap on its ETag (:mod:`ckptguard.protocol.cas`); its epoch is the fence of
object-store roots (see :mod:`ckptguard.protocol.objstore`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ckptguard.errors import CorruptCheckpointError
from ckptguard.protocol import layout
from ckptguard.protocol.layout import CheckpointName

INDEX = f"{layout.CONTROL}/index.json"
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
        body = {"format": INDEX_FORMAT, "epoch": self.epoch, "next_seq": self.next_seq,
                "entries": [asdict(e) for e in self.entries]}
        return (json.dumps(body, separators=(",", ":")) + "\n").encode()

    @staticmethod
    def from_bytes(data: bytes, path: str) -> Index:
        try:
            body = json.loads(data)
            if not isinstance(body, dict) or body.get("format") != INDEX_FORMAT:
                raise ValueError("wrong format tag")
            entries = [IndexEntry(int(e["step"]), int(e["version"]), str(e["attempt"]), str(e["state"]),
                                  int(e["epoch"]), None if e.get("seq") is None else int(e["seq"]))
                       for e in body["entries"]]
            if any(e.state not in ("pending", "committed", "aborted") for e in entries):
                raise ValueError("unknown entry state")
            return Index(int(body["epoch"]), int(body["next_seq"]), entries)
        except (ValueError, TypeError, KeyError) as e:
            raise CorruptCheckpointError(
                f"{path} is not a valid ckptguard index ({type(e).__name__}: {e}); it was modified by hand or "
                "by another tool. Committed checkpoints cannot be found without it.", path=path) from None

    def find(self, name: CheckpointName) -> IndexEntry | None:
        for e in self.entries:
            if e.step == name.step and e.version == name.version:
                return e
        return None
