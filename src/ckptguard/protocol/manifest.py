"""The manifest of a committed checkpoint: JSON, strictly parsed, self-checksummed.

It lists every file with its size, every stored item with its place and
checksum, the per-rank artifacts, the topology and versions, and DCP's metadata
in JSON form. Loading never unpickles anything from a checkpoint: DCP's own
``.metadata`` is a plain pickle, so we do not write or read one.
"""

from __future__ import annotations

import json
import platform
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from ckptguard._version import __version__
from ckptguard.checksum import Hasher
from ckptguard.dcp.records import FileEntry, StoredItem
from ckptguard.errors import CheckpointError, CorruptCheckpointError, MalformedRecordError
from ckptguard.protocol import records
from ckptguard.protocol.itemtable import ItemTable, TableError
from ckptguard.protocol.records import MAX_MANIFEST_DEPTH
from ckptguard.protocol.schema import DcpBody, DcpEntry, FileColumns, ManifestBody, RowsHeader, Tables
from ckptguard.protocol.validate import FORMAT, FORMAT_VERSION, ROWS_ENCODING, check_head, check_manifest

_PREFIX = b'{"manifest_checksum":"'
_BODY_KEY = b'","body":'

_TABLES_ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class Artifact:
    """A rank's private file or directory (``files=`` in save), stored under that rank's namespace."""

    rank: int
    key: str
    kind: str  # "file" or "dir"
    files: tuple[tuple[str, str], ...]  # (path relative to the artifact, path in the checkpoint)


@dataclass
class Manifest:
    step: int
    version: int
    attempt: str
    created_at: float
    world_size: int
    domain_index: int
    domain_count: int
    domain_ranks: list[int]
    hosts: list[str]
    checksum_algorithm: str
    dcp: dict[str, Any]
    files: list[FileEntry]
    #: The rows: an ItemTable (built by the leader, parsed from a manifest) or any list of them.
    items: Sequence[StoredItem]
    artifacts: list[Artifact] = field(default_factory=list)
    user_metadata: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    #: Commit sequence number: grows by one with every save of the root (agreed across storage
    #: domains), so "committed last" does not depend on step numbers. None: an older ckptguard.
    commit_seq: int | None = None

    # -- serialization -------------------------------------------------------------
    def to_json(self) -> bytes:
        """The manifest file (:meth:`sealed_parts` joined)."""
        return b"".join(self.sealed_parts())

    def sealed_parts(self) -> list[bytes]:
        """The manifest file as parts to write one after another (joining them would copy the tables,
        tens of MB at thousands of ranks): a JSON head on one line (what a person reads), then the row tables and
        DCP's metadata as MessagePack columns (what grows with the number of chunks), one checksum over
        both. The Commit protocol page, "The manifest", describes the layout."""
        # A tuple encodes as Tables does (array_like), and the DCP dict as DcpBody does (a map).
        table = ItemTable.from_items(self.items, [f.path for f in self.files])
        tables = _TABLES_ENCODER.encode((_file_columns(self.files), table.encode(), self.dcp))
        body: dict[str, Any] = {}
        if self.commit_seq is not None:
            # First, so that listing a root reads only the head of each manifest (commit_seq_from_head).
            body["commit_seq"] = self.commit_seq
        body |= {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "version": self.version,
            "attempt": self.attempt,
            "created_at": self.created_at,
            "world_size": self.world_size,
            "domain": {"index": self.domain_index, "count": self.domain_count, "ranks": self.domain_ranks},
            "hosts": self.hosts,
            "checksum_algorithm": self.checksum_algorithm,
            "versions": self.versions or _versions(),
            "user_metadata": self.user_metadata,
            "artifacts": [
                {"rank": a.rank, "key": a.key, "kind": a.kind, "files": [list(p) for p in a.files]}
                for a in self.artifacts
            ],
            "rows": {
                "encoding": ROWS_ENCODING,
                "bytes": len(tables),
                "files": len(self.files),
                "items": len(self.items),
            },
        }
        return sealed(json.dumps(body, separators=(",", ":"), allow_nan=False, check_circular=False).encode(), tables)

    @staticmethod
    def from_json(data: bytes, path: str, part: tuple[int, int] = (0, 1)) -> Manifest:
        """``part`` (k, n): as in ``Root.parse_manifest``, the checks relating DCP entries and item rows
        of the names k, k + n, ... only."""
        try:
            return _parse(data, path, part)
        except MalformedRecordError:
            raise
        except CheckpointError as e:
            raise CorruptCheckpointError(f"{path}: {e}", path=path) from None
        except (ValueError, TypeError, KeyError, IndexError, ArithmeticError, RecursionError) as e:
            raise CorruptCheckpointError(
                f"{path}: not a valid ckptguard manifest ({type(e).__name__}: {e}). "
                "The checkpoint is corrupt or was not written by ckptguard.",
                path=path,
            ) from None

    # -- queries ---------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def total_item_bytes(self) -> int:
        """The bytes of every item (on the table's column: no StoredItem made)."""
        if isinstance(self.items, ItemTable):
            return int(self.items.length.sum())
        return sum(i.length for i in self.items)

    def artifact(self, rank: int, key: str) -> Artifact | None:
        for a in self.artifacts:
            if a.rank == rank and a.key == key:
                return a
        return None


def seal(body: bytes, tables: bytes) -> bytes:
    """The manifest file from its JSON body and its binary section: ``{"manifest_checksum":"<xxh3-64 of
    body, a newline and tables>","body":<body>}``, a newline, then ``tables``."""
    return b"".join(sealed(body, tables))


def sealed(body: bytes, tables: bytes) -> list[bytes]:
    """:func:`seal`'s bytes in two parts, the head line and ``tables`` (not copied)."""
    return [_PREFIX + _digest(body, tables).encode() + _BODY_KEY + body + b"}\n", tables]


def _digest(head: bytes, tables: bytes | memoryview) -> str:
    """The manifest's own checksum: over the JSON body, a newline, and the binary section."""
    h = Hasher("xxh3-64")
    h.update(head)
    h.update(b"\n")
    h.update(tables)
    return h.hexdigest()


def _file_columns(files: list[FileEntry]) -> tuple[Any, ...]:
    if not files:
        return ((), (), (), ())
    return tuple(zip(*files, strict=True))


def _versions() -> dict[str, str]:
    import torch

    return {"ckptguard": __version__, "torch": torch.__version__, "python": platform.python_version()}


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise CheckpointError(f"not a valid ckptguard manifest: {what}")


def _parse(data: bytes, path: str, part: tuple[int, int] = (0, 1)) -> Manifest:
    """The manifest in ``data``: its frame and checksum, then each section decoded once into its schema
    (protocol/schema.py), then every invariant across fields (validate.check_manifest)."""
    _expect(data.startswith(_PREFIX), "missing manifest_checksum")
    body_start = len(_PREFIX) + 16 + len(_BODY_KEY)
    _expect(data[len(_PREFIX) + 16 : body_start] == _BODY_KEY, "malformed header")
    end = data.find(b"\n")  # JSON escapes newlines inside strings: the first one ends the head
    _expect(end > body_start and data[end - 1 : end] == b"}", "truncated head")
    raw_body = data[body_start : end - 1]
    tables = memoryview(data)[end + 1 :]
    if _digest(raw_body, tables) != data[len(_PREFIX) : len(_PREFIX) + 16].decode("ascii", "replace"):
        raise CheckpointError("manifest checksum mismatch: the manifest itself is corrupt")
    # Size: bounded by the storage read; depth: before any decoder recurses.
    body = records.decode(raw_body, ManifestBody, path, max_bytes=len(raw_body), max_depth=MAX_MANIFEST_DEPTH)
    check_head(body, len(tables))
    t = records.decode_binary(tables, Tables, path, "manifest row section")
    files = _files(t.files)
    try:
        items = ItemTable.decode(t.items, [f.path for f in files])
    except TableError as e:
        raise MalformedRecordError(f"{path}: not a valid manifest row section: {e}", path=path, field="items") from None
    _check_rows(body, [f.path for f in files], len(items), path)
    dom = body.domain
    manifest = Manifest(
        step=body.step,
        version=body.version,
        attempt=body.attempt,
        created_at=body.created_at,
        world_size=body.world_size,
        domain_index=dom.index,
        domain_count=dom.count,
        domain_ranks=dom.ranks,
        hosts=body.hosts,
        checksum_algorithm=body.checksum_algorithm,
        dcp=msgspec.to_builtins(t.dcp),
        files=files,
        items=items,
        artifacts=[Artifact(a.rank, a.key, a.kind, tuple(a.files)) for a in body.artifacts],
        user_metadata=body.user_metadata,
        versions=body.versions,
        commit_seq=body.commit_seq,
    )
    check_manifest(manifest, t.dcp, part)
    return manifest


def _check_rows(body: ManifestBody, paths: Sequence[str], items: int, path: str) -> None:
    """The head's row counts are those of the row section, and no file is listed twice (``verify``
    matches files on disk by name, ``load`` reads rows by index: two rows of one name would let them
    judge different bytes).

    Raises:
        MalformedRecordError: naming ``path`` and the field.
    """
    for name, said, got in (("rows.files", body.rows.files, len(paths)), ("rows.items", body.rows.items, items)):
        if said != got:
            raise MalformedRecordError(
                f"{path}: not a valid ckptguard manifest: {name} is {said}, the row section has {got}",
                path=path,
                field=name,
            )
    seen: set[str] = set()
    for p in paths:
        if p in seen:
            raise MalformedRecordError(
                f"{path}: not a valid ckptguard manifest: file {p[:200]!r} is listed twice",
                path=path,
                field="files.path",
            )
        seen.add(p)


def _files(c: FileColumns) -> list[FileEntry]:
    n = len(c.path)
    _expect(len(c.size) == n and len(c.rank) == n and len(c.checksum) == n, "the file columns have different lengths")
    return list(map(FileEntry._make, zip(c.path, c.size, c.rank, c.checksum, strict=True)))


#: How a manifest with a commit sequence number starts (to_json writes it first in the body).
_HEAD_RE = re.compile(rb'^\{"manifest_checksum":"[0-9a-f]{16}","body":\{"commit_seq":([1-9][0-9]{0,18}),"format":')
HEAD_BYTES = 128


def commit_seq_from_head(head: bytes) -> int | None:
    """The commit sequence number from the first HEAD_BYTES of a manifest, or None if it has none
    there (an older manifest, or a damaged head: then the whole manifest must be read).

    Listing a root needs every checkpoint's place in commit order, and manifests can be
    hundreds of MB: the head is enough. It is not checksummed by itself, but a load of
    the checkpoint parses the whole manifest and refuses one whose sequence number
    differs from the one it was listed with.
    """
    m = _HEAD_RE.match(head)
    return int(m.group(1)) if m else None


def manifest_summary(m: Manifest) -> dict[str, Any]:
    """A small JSON-able view for `ckptguard ls`."""
    return {
        "step": m.step,
        "version": m.version,
        "world_size": m.world_size,
        "files": len(m.files),
        "bytes": m.total_bytes,
        "created_at": m.created_at,
        "domain": {"index": m.domain_index, "count": m.domain_count},
        "versions": m.versions,
        "user_metadata": m.user_metadata,
    }


__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ROWS_ENCODING",
    "Artifact",
    "DcpBody",
    "DcpEntry",
    "FileColumns",
    "FileEntry",
    "Manifest",
    "ManifestBody",
    "RowsHeader",
    "StoredItem",
    "Tables",
    "asdict",
    "manifest_summary",
    "seal",
]
