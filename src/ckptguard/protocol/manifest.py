"""The manifest of a committed checkpoint: JSON, strictly parsed, self-checksummed.

It lists every file with its size, every stored item with its place and
checksum, the per-rank artifacts, the topology and versions, and DCP's metadata
in JSON form. Loading never unpickles anything from a checkpoint: DCP's own
``.metadata`` is a plain pickle, so we do not write or read one.
"""

from __future__ import annotations

import json
import math
import platform
import re
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

import msgspec

from ckptguard._version import __version__
from ckptguard.checksum import ALGORITHMS, checksum
from ckptguard.dcp.records import ITEMSIZES, FileEntry, StoredItem
from ckptguard.errors import CheckpointError, CorruptCheckpointError, MalformedRecordError
from ckptguard.protocol import records
from ckptguard.protocol.records import ATTEMPT_PATTERN, MAX_MANIFEST_DEPTH

FORMAT = "ckptguard-checkpoint"
FORMAT_VERSION = 1

_Count = Annotated[int, msgspec.Meta(ge=0)]
#: [path, size, rank, checksum|null]
FileRow = tuple[str, _Count, _Count, str | None]
#: [fqn, offsets|null, file index, offset, length, checksum, dtype|null, shape|null]
ItemRow = tuple[str, tuple[_Count, ...] | None, _Count, _Count, _Count, str, str | None, tuple[_Count, ...] | None]


class ManifestBody(msgspec.Struct):
    """The body of a manifest as the schema checks it: the row tables typed (one row per file and
    per stored tensor chunk: millions at scale, so checked by the decoder, not in Python); the other
    fields are checked by ``_parse``. Fields this release does not know are ignored."""

    format: Any
    format_version: Any
    step: Any
    version: Any
    attempt: Any
    created_at: Any
    world_size: Any
    domain: Any
    hosts: Any
    checksum_algorithm: Any
    versions: Any
    user_metadata: Any
    files: list[FileRow]
    items: list[ItemRow]
    artifacts: Any
    dcp: Any
    commit_seq: Any = None


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
    items: list[StoredItem]
    artifacts: list[Artifact] = field(default_factory=list)
    user_metadata: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    #: Commit sequence number: grows by one with every save of the root (agreed across storage
    #: domains), so "committed last" does not depend on step numbers. None: an older ckptguard.
    commit_seq: int | None = None

    # -- serialization -------------------------------------------------------------
    def to_json(self) -> bytes:
        file_index = {f.path: i for i, f in enumerate(self.files)}
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
            "files": [[f.path, f.size, f.rank, f.checksum] for f in self.files],
            # Compact rows: [fqn, offsets|null, file index, offset, length, checksum, dtype|null, shape|null]
            # (tuples encode as JSON arrays and cost less memory than lists at millions of rows)
            "items": [
                (i.fqn, i.offsets, file_index[i.file], i.offset, i.length, i.checksum, i.dtype, i.shape)
                for i in self.items
            ],
            "artifacts": [
                {"rank": a.rank, "key": a.key, "kind": a.kind, "files": [list(p) for p in a.files]}
                for a in self.artifacts
            ],
            "dcp": self.dcp,
        }
        # Key order is irrelevant (the checksum covers the exact text written), and not sorting
        # keeps encoding fast for manifests of millions of items.
        text = json.dumps(body, separators=(",", ":"), allow_nan=False, check_circular=False)
        digest = checksum("xxh3-64", text.encode())
        return f'{{"manifest_checksum":"{digest}","body":{text}}}\n'.encode()

    @staticmethod
    def from_json(data: bytes, path: str) -> Manifest:
        try:
            return _parse(data, path)
        except MalformedRecordError:
            raise
        except CheckpointError as e:
            raise CorruptCheckpointError(f"{path}: {e}", path=path) from None
        except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError, RecursionError) as e:
            raise CorruptCheckpointError(
                f"{path}: not a valid ckptguard manifest ({type(e).__name__}: {e}). "
                "The checkpoint is corrupt or was not written by ckptguard.",
                path=path,
            ) from None

    # -- queries ---------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def artifact(self, rank: int, key: str) -> Artifact | None:
        for a in self.artifacts:
            if a.rank == rank and a.key == key:
                return a
        return None


def _versions() -> dict[str, str]:
    import torch

    return {"ckptguard": __version__, "torch": torch.__version__, "python": platform.python_version()}


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise CheckpointError(f"not a valid ckptguard manifest: {what}")


def _int(v: Any, what: str, minimum: int = 0) -> int:
    _expect(isinstance(v, int) and not isinstance(v, bool) and v >= minimum, f"{what} must be an integer >= {minimum}")
    return int(v)


def _str(v: Any, what: str) -> str:
    _expect(isinstance(v, str), f"{what} must be a string")
    return str(v)


def _ints(v: Any, what: str) -> tuple[int, ...]:
    _expect(isinstance(v, list), f"{what} must be a list")
    return tuple(_int(x, what) for x in v)


def _attempt(v: Any) -> str:
    # Object stores read a checkpoint's data under staging/step-N.<attempt>: a path part, so hex only.
    _expect(isinstance(v, str) and re.fullmatch(ATTEMPT_PATTERN, v) is not None,
            f"attempt {str(v)[:100]!r} must be 16-64 hex digits")
    return str(v)


def _relpath(v: Any, what: str) -> str:
    p = _str(v, what)
    parts = p.split("/")
    _expect(bool(p) and not p.startswith("/") and ".." not in parts and "" not in parts and "\\" not in p,
            f"{what} {p!r} must be a plain relative path inside the checkpoint")
    return p


def _parse(data: bytes, path: str) -> Manifest:
    text = data.decode("utf-8")
    head = '{"manifest_checksum":"'
    _expect(text.startswith(head), "missing manifest_checksum")
    stored = text[len(head): len(head) + 16]
    body_start = len(head) + 16 + len('","body":')
    _expect(text[len(head) + 16: body_start] == '","body":', "malformed header")
    body_text = text[body_start:].rstrip()
    _expect(body_text.endswith("}"), "truncated")
    body_text = body_text[:-1]
    if checksum("xxh3-64", body_text.encode()) != stored:
        raise CheckpointError("manifest checksum mismatch: the manifest itself is corrupt")
    raw_body = body_text.encode()
    # Size: bounded by the storage read. The row tables are typed by the schema (checked in C, one
    # tuple per row); what relates fields to each other is checked below.
    body = records.decode(raw_body, ManifestBody, path, max_bytes=len(raw_body), max_depth=MAX_MANIFEST_DEPTH)
    _expect(body.format == FORMAT, "wrong format tag")
    _expect(body.format_version == FORMAT_VERSION,
            f"format_version {body.format_version!r} is not supported by this ckptguard "
            f"(expects {FORMAT_VERSION}); upgrade ckptguard")
    b: dict[str, Any] = {"checksum_algorithm": body.checksum_algorithm, "artifacts": body.artifacts,
                         "domain": body.domain, "hosts": body.hosts, "dcp": body.dcp,
                         "user_metadata": body.user_metadata, "versions": body.versions,
                         "commit_seq": body.commit_seq, "step": body.step, "version": body.version,
                         "attempt": body.attempt, "created_at": body.created_at, "world_size": body.world_size}
    algo = _str(b["checksum_algorithm"], "checksum_algorithm")
    _expect(algo in ALGORITHMS, f"unknown checksum algorithm {algo!r}")
    files = [FileEntry(_relpath(p, "file path"), size, rank, digest) for p, size, rank, digest in body.files]
    items: list[StoredItem] = []
    paths = [f.path for f in files]
    sizes = [f.size for f in files]
    nfiles = len(paths)
    # Hot loop (one row per tensor chunk; types already checked): only what relates the fields.
    for fqn, offsets, fi, offset, length, digest, dtype, shape in body.items:
        # A reader allocates what an item claims: never more than its file holds.
        if fi >= nfiles or offset + length > sizes[fi]:
            _expect(fi < nfiles, f"malformed item row for {fqn[:100]!r}: file index {fi} of {nfiles} files")
            _expect(False, f"item {fqn[:100]!r} claims bytes {offset}..{offset + length} "
                           f"of {paths[fi]}, which has {sizes[fi]}")
        if shape is not None:
            # A reader allocates the shape it is told: it must account for exactly the item's bytes.
            itemsize = ITEMSIZES.get(dtype) if dtype is not None else None
            if itemsize is None or math.prod(shape) * itemsize != length:
                _expect(dtype is not None, "item shape without dtype")
                _expect(itemsize is not None, f"item {fqn[:100]!r} has unknown dtype {str(dtype)[:40]!r}")
                _expect(False, f"item {fqn[:100]!r}: shape {list(shape)[:8]} of {dtype} does not match its "
                               f"{length} bytes")
        elif dtype is not None:
            _expect(False, "item dtype without shape")
        items.append(StoredItem(fqn, offsets, paths[fi], offset, length, digest, dtype, shape))
    artifacts: list[Artifact] = []
    for a in b["artifacts"]:
        _expect(isinstance(a, dict), "artifact entries are objects")
        kind = _str(a["kind"], "artifact kind")
        _expect(kind in ("file", "dir"), "artifact kind must be file or dir")
        pairs = []
        for p in a["files"]:
            _expect(isinstance(p, list) and len(p) == 2, "artifact file rows have 2 fields")
            pairs.append((_relpath(p[0], "artifact relative path"), _relpath(p[1], "artifact stored path")))
        artifacts.append(Artifact(_int(a["rank"], "artifact rank"), _str(a["key"], "artifact key"), kind, tuple(pairs)))
    dom = b["domain"]
    _expect(isinstance(dom, dict), "domain must be an object")
    hosts = b["hosts"]
    _expect(isinstance(hosts, list) and all(isinstance(h, str) for h in hosts), "hosts must be a list of strings")
    _expect(isinstance(b["dcp"], dict), "dcp must be an object")
    _expect(isinstance(b["user_metadata"], dict), "user_metadata must be an object")
    versions = b["versions"]
    _expect(isinstance(versions, dict), "versions must be an object")
    seq = b.get("commit_seq")
    commit_seq = None if seq is None else _int(seq, "commit_seq", 1)
    _check_dcp_agrees_with_items(b["dcp"], items)
    return Manifest(
        step=_int(b["step"], "step"),
        version=_int(b["version"], "version", 1),
        attempt=_attempt(b["attempt"]),
        created_at=float(b["created_at"]),
        world_size=_int(b["world_size"], "world_size", 1),
        domain_index=_int(dom["index"], "domain index"),
        domain_count=_int(dom["count"], "domain count", 1),
        domain_ranks=list(_ints(dom["ranks"], "domain ranks")),
        hosts=list(hosts),
        checksum_algorithm=algo,
        dcp=b["dcp"],
        files=files,
        items=items,
        artifacts=artifacts,
        user_metadata=b["user_metadata"],
        versions={str(k): str(v) for k, v in versions.items()},
        commit_seq=commit_seq,
    )


def _check_dcp_agrees_with_items(dcp: dict[str, Any], items: list[StoredItem]) -> None:
    """The DCP metadata and the item rows describe one tensor twice (``load`` trusts the first, ``read``
    and ``export`` the second): every item row with a dtype must agree with its DCP entry on the dtype,
    the number of dimensions, and lie inside its size; an object entry has no tensor rows. The checksum
    is no signature, so a manifest that says two things is refused here, once, at parse time."""
    entries = dcp.get("state_dict")
    if not isinstance(entries, dict):
        return  # malformed: refused where the DCP metadata is decoded (codec.metadata_from_json)
    for item in items:
        if item.dtype is None or item.shape is None:
            continue
        entry = entries.get(item.fqn)
        if not isinstance(entry, dict):
            continue
        where = f"item {item.fqn[:100]!r} and dcp.state_dict[{item.fqn[:100]!r}]"
        _expect(entry.get("type") == "tensor", f"{where} disagree: a tensor row for an object entry")
        _expect(entry.get("dtype") == item.dtype,
                f"{where} disagree on the dtype ({item.dtype} vs {str(entry.get('dtype'))[:40]})")
        size: Any = entry.get("size")
        _expect(type(size) is list and len(size) == len(item.shape),
                f"{where} disagree on the number of dimensions ({len(item.shape)} vs {str(size)[:80]})")
        offsets = item.offsets if item.offsets is not None else (0,) * len(item.shape)
        inside = len(offsets) == len(item.shape) and all(  # a negative size: refused by metadata_from_json
            type(n) is int and (n < 0 or o + k <= n) for o, k, n in zip(offsets, item.shape, size, strict=True))
        _expect(inside,
                f"{where} disagree on the size: the chunk at {list(offsets)[:8]} of shape "
                f"{list(item.shape)[:8]} is not inside {str(size)[:80]}")


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


__all__ = ["Artifact", "FileEntry", "Manifest", "StoredItem", "asdict", "manifest_summary"]
