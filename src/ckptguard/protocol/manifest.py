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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import chain, islice
from typing import Annotated, Any, NoReturn

import msgspec
import numpy as np

from ckptguard._version import __version__
from ckptguard.checksum import ALGORITHMS, Hasher
from ckptguard.dcp.records import ITEMSIZES, FileEntry, StoredItem, addressable, whole_chunk
from ckptguard.errors import CheckpointError, CorruptCheckpointError, MalformedRecordError
from ckptguard.protocol import records
from ckptguard.protocol.itemtable import MAX_FILE_BYTES, MAX_NDIM, EncodedItems, ItemTable, TableError
from ckptguard.protocol.records import ATTEMPT_PATTERN, MAX_MANIFEST_DEPTH

FORMAT = "ckptguard-checkpoint"
FORMAT_VERSION = 2
#: How the binary section after the JSON head is encoded (``rows.encoding`` in the head).
ROWS_ENCODING = "msgpack-columns"
_PREFIX = b'{"manifest_checksum":"'
_BODY_KEY = b'","body":'

_Count = Annotated[int, msgspec.Meta(ge=0)]
#: Files are at most 2**62 bytes, so offsets and ends of items add up without overflowing int64.
_Bytes = Annotated[int, msgspec.Meta(ge=0, le=MAX_FILE_BYTES)]
_Dims = tuple[_Count, ...]


class RowsHeader(msgspec.Struct):
    """Where the binary row tables are: the bytes after the JSON head's newline."""

    encoding: Any
    bytes: _Count
    files: _Count = 0
    items: _Count = 0


class ManifestBody(msgspec.Struct):
    """The JSON head of a manifest as the schema checks it (what a person reads: step, sequence
    number, world, attempt, checksum algorithm, versions); the other fields are checked by
    ``_parse``. Fields this release does not know are ignored."""

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
    artifacts: Any
    rows: RowsHeader
    commit_seq: Any = None


class FileColumns(msgspec.Struct, array_like=True):
    """One list per field of the files, one entry per file."""

    path: list[str]
    size: list[_Bytes]
    rank: list[_Count]
    checksum: list[str | None]


class DcpEntry(msgspec.Struct, omit_defaults=True):
    """One entry of DCP's metadata (codec.metadata_to_json): a tensor, or ``type: bytes``."""

    type: str
    dtype: str | None = None
    requires_grad: bool | None = None
    size: list[int] | None = None
    chunks: list[int] | None = None


class DcpBody(msgspec.Struct):
    """DCP's metadata (codec.metadata_to_json): per tensor, its chunks as one flat list of numbers."""

    state_dict: dict[str, DcpEntry] = {}
    planner_data: dict[str, list[str | int]] = {}
    version: str | None = None


class Tables(msgspec.Struct, array_like=True):
    """The binary section of a manifest (MessagePack): what grows with the number of chunks."""

    files: FileColumns
    items: EncodedItems
    dcp: DcpBody


_TABLES_DECODER = msgspec.msgpack.Decoder(Tables)
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
            "rows": {"encoding": ROWS_ENCODING, "bytes": len(tables), "files": len(self.files),
                     "items": len(self.items)},
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
        _invalid(what)


def _invalid(what: str) -> NoReturn:
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


def _parse(data: bytes, path: str, part: tuple[int, int] = (0, 1)) -> Manifest:
    _expect(data.startswith(_PREFIX), "missing manifest_checksum")
    body_start = len(_PREFIX) + 16 + len(_BODY_KEY)
    _expect(data[len(_PREFIX) + 16: body_start] == _BODY_KEY, "malformed header")
    end = data.find(b"\n")  # JSON escapes newlines inside strings: the first one ends the head
    _expect(end > body_start and data[end - 1: end] == b"}", "truncated head")
    raw_body = data[body_start: end - 1]
    tables = memoryview(data)[end + 1:]
    if _digest(raw_body, tables) != data[len(_PREFIX): len(_PREFIX) + 16].decode("ascii", "replace"):
        raise CheckpointError("manifest checksum mismatch: the manifest itself is corrupt")
    # Size: bounded by the storage read. The head's fields are checked below; the row tables are typed
    # by their schema (checked in C, a list per column), and what relates fields to each other is
    # checked on whole columns.
    body = records.decode(raw_body, ManifestBody, path, max_bytes=len(raw_body), max_depth=MAX_MANIFEST_DEPTH)
    _expect(body.format == FORMAT, "wrong format tag")
    _expect(body.format_version == FORMAT_VERSION,
            f"format_version {body.format_version!r} is not supported by this ckptguard "
            f"(expects {FORMAT_VERSION}); upgrade ckptguard")
    _expect(body.rows.encoding == ROWS_ENCODING, f"rows.encoding {str(body.rows.encoding)[:40]!r} is not "
                                                 f"{ROWS_ENCODING!r}")
    _expect(body.rows.bytes == len(tables), f"the row section has {len(tables)} bytes, the head says "
                                            f"{body.rows.bytes} (truncated or appended to)")
    t = records.decode_binary(tables, Tables, path, "manifest row section")
    algo = _str(body.checksum_algorithm, "checksum_algorithm")
    _expect(algo in ALGORITHMS, f"unknown checksum algorithm {algo!r}")
    files = _files(t.files)
    try:
        items = ItemTable.decode(t.items, [f.path for f in files])
    except TableError as e:
        raise MalformedRecordError(f"{path}: not a valid manifest row section: {e}", path=path,
                                   field="items") from None
    _items(items, files)
    artifacts: list[Artifact] = []
    _expect(isinstance(body.artifacts, list), "artifacts must be a list")
    for a in body.artifacts:
        _expect(isinstance(a, dict), "artifact entries are objects")
        kind = _str(a["kind"], "artifact kind")
        _expect(kind in ("file", "dir"), "artifact kind must be file or dir")
        pairs = []
        for p in a["files"]:
            _expect(isinstance(p, list) and len(p) == 2, "artifact file rows have 2 fields")
            pairs.append((_relpath(p[0], "artifact relative path"), _relpath(p[1], "artifact stored path")))
        artifacts.append(Artifact(_int(a["rank"], "artifact rank"), _str(a["key"], "artifact key"), kind, tuple(pairs)))
    dom = body.domain
    _expect(isinstance(dom, dict), "domain must be an object")
    hosts = body.hosts
    _expect(isinstance(hosts, list) and all(isinstance(h, str) for h in hosts), "hosts must be a list of strings")
    _expect(isinstance(body.user_metadata, dict), "user_metadata must be an object")
    versions = body.versions
    _expect(isinstance(versions, dict), "versions must be an object")
    commit_seq = None if body.commit_seq is None else _int(body.commit_seq, "commit_seq", 1)
    dcp: dict[str, Any] = msgspec.to_builtins(t.dcp)
    _check_dcp_agrees(dcp, t.dcp.state_dict, items, part)
    _check_chunks_agree(t.dcp.state_dict, items, whole=dom.get("count") == 1, part=part)
    return Manifest(
        step=_int(body.step, "step"),
        version=_int(body.version, "version", 1),
        attempt=_attempt(body.attempt),
        created_at=float(body.created_at),
        world_size=_int(body.world_size, "world_size", 1),
        domain_index=_int(dom["index"], "domain index"),
        domain_count=_int(dom["count"], "domain count", 1),
        domain_ranks=list(_ints(dom["ranks"], "domain ranks")),
        hosts=list(hosts),
        checksum_algorithm=algo,
        dcp=dcp,
        files=files,
        items=items,
        artifacts=artifacts,
        user_metadata=body.user_metadata,
        versions={str(k): str(v) for k, v in versions.items()},
        commit_seq=commit_seq,
    )


def _files(c: FileColumns) -> list[FileEntry]:
    n = len(c.path)
    _expect(len(c.size) == n and len(c.rank) == n and len(c.checksum) == n,
            "the file columns have different lengths")
    for p in c.path:
        _relpath(p, "file path")
    return list(map(FileEntry._make, zip(c.path, c.size, c.rank, c.checksum, strict=True)))


def _items(table: ItemTable, files: list[FileEntry]) -> None:
    """Each item checked against its file, its dtype and its shape on whole columns (numpy); only a
    manifest that fails is walked row by row, which names the first bad item."""
    n = len(table)
    if not n:
        return
    sizes = np.array([f.size for f in files], dtype=np.int64)  # each <= MAX_FILE_BYTES: sums fit
    # A reader allocates what an item claims: never more than its file holds.
    ok = bool(np.all(table.offset + table.length <= sizes[table.file]))
    # A reader allocates the shape it is told: it must account for exactly the item's bytes.
    has_shape = table.shape_ndim >= 0
    has_dtype = np.array([d is not None for d in table.dtypes], dtype=bool)[table.dtype]
    itemsize = np.array([ITEMSIZES.get(d, 0) if d is not None else 0 for d in table.dtypes], dtype=np.int64)
    ok = ok and bool(np.array_equal(has_shape, has_dtype))
    if ok:
        rows = np.flatnonzero(has_shape)
        size = itemsize[table.dtype[rows]]
        length = table.length[rows]
        ok = bool(np.all(size > 0)) and bool(np.all(
            (length % np.maximum(size, 1) == 0) & (length // np.maximum(size, 1) == _products(table, rows))))
    if not ok:
        _check_items(table.rows(), files)


def _products(table: ItemTable, rows: np.ndarray) -> np.ndarray:
    """The number of elements of each row's shape (-1 where it is 2**62 or more: no item has that)."""
    ndim = table.shape_ndim[rows]
    counts = np.clip(table.shape_ndim, 0, None)
    starts = (np.cumsum(counts) - counts)[rows]
    out = np.ones(len(rows), dtype=np.int64)
    positive = ndim > 0
    if positive.any():
        # Rows without values take none of the flat column: the values of the others are contiguous.
        at = starts[positive]
        floats = np.multiply.reduceat(table.shape.astype(np.float64), at)
        ints = np.multiply.reduceat(table.shape, at)  # wraps only where floats says too big
        out[positive] = np.where(floats < 2.0**62, ints, -1)
    return out


def _check_items(items: list[StoredItem], files: list[FileEntry]) -> None:
    """Row by row, what ``_items`` checks on whole columns: raises naming the first bad item."""
    sizes = {f.path: f.size for f in files}
    for fqn, _, file, offset, length, _, dtype, shape in items:
        _expect(offset + length <= sizes[file], f"item {fqn[:100]!r} claims bytes {offset}..{offset + length} "
                                                f"of {file}, which has {sizes[file]}")
        if shape is not None:
            itemsize = ITEMSIZES.get(dtype) if dtype is not None else None
            _expect(dtype is not None, "item shape without dtype")
            _expect(itemsize is not None, f"item {fqn[:100]!r} has unknown dtype {str(dtype)[:40]!r}")
            _expect(math.prod(shape) * (itemsize or 0) == length,
                    f"item {fqn[:100]!r}: shape {list(shape)[:8]} of {dtype} does not match its {length} bytes")
        else:
            _expect(dtype is None, "item dtype without shape")


def _check_dcp_agrees(dcp: dict[str, Any], entries: dict[str, DcpEntry], table: ItemTable,
                      part: tuple[int, int] = (0, 1)) -> None:
    """``_check_dcp_agrees_with_items`` on whole columns, for the names of ``part`` (k, n): the k-th of
    every n in the table's name list; a manifest that fails is walked row by row."""
    if not len(table):
        return
    if not _entries_agree(entries, table, part):
        _check_dcp_agrees_with_items(dcp, table.rows())


def _entries_agree(entries: dict[str, DcpEntry], table: ItemTable, part: tuple[int, int] = (0, 1)) -> bool:
    """Every tensor row whose name has an entry (of the names of ``part``): a tensor entry of its dtype,
    with a size of its number of dimensions that the row lies inside (a negative size is refused by
    metadata_from_json). The entries as the schema decoded them (their fields' types checked in C); per
    name only list comprehensions (each name of a checkpoint of many small tensors costs here), then the
    rows on flat columns: one element per row and dimension."""
    first, every = part
    dtype_at = {d: i for i, d in enumerate(table.dtypes) if d is not None}
    # The names of this part, each at its position in it: (name index - first) / every.
    got = list(map(entries.get, table.names[first::every]))
    named = np.fromiter((e is not None for e in got), bool, len(got))
    shapes = [(e.dtype, e.size) if e is not None and e.type == "tensor" and e.dtype is not None
              and e.size is not None and len(e.size) <= MAX_NDIM else None for e in got]
    # Per name: the index in table.dtypes of a well-formed tensor entry's dtype (else -1), its number of
    # dimensions (else 0), and the sizes of the well-formed entries one after another.
    entry_dtype = [-1 if t is None else dtype_at.get(t[0], -1) for t in shapes]
    size_ndim = [0 if t is None else len(t[1]) for t in shapes]
    dims = list(chain.from_iterable(t[1] for t in shapes if t is not None))
    rows = np.flatnonzero(table.shape_ndim >= 0)
    if every > 1:
        rows = rows[table.name[rows] % every == first]
    rows = rows[named[(table.name[rows] - first) // every]]
    if not len(rows):
        return True
    names = (table.name[rows] - first) // every
    ndim = table.shape_ndim[rows]
    nd = np.array(size_ndim, dtype=np.int64)
    off_ndim = table.offsets_ndim[rows]
    if not (np.array_equal(np.array(entry_dtype, dtype=np.int64)[names], table.dtype[rows])
            and np.array_equal(nd[names], ndim) and bool(np.all((off_ndim == ndim) | (off_ndim < 0)))):
        return False
    total = int(ndim.sum())
    if not total:
        return True
    try:
        size_flat = np.maximum(np.array(dims, dtype=np.int64), -1)
    except OverflowError:  # a size beyond int64: row by row
        return False
    row_of = np.repeat(np.arange(len(rows)), ndim)
    dim = np.arange(total) - np.repeat(np.cumsum(ndim) - ndim, ndim)
    counts = np.clip(table.shape_ndim, 0, None)
    k = table.shape[(np.cumsum(counts) - counts)[rows][row_of] + dim]
    ocounts = np.clip(table.offsets_ndim, 0, None)
    has_off = (off_ndim >= 0)[row_of]
    at = (np.cumsum(ocounts) - ocounts)[rows][row_of] + dim
    o = np.where(has_off, table.offsets[np.where(has_off, at, 0)] if len(table.offsets) else 0, 0)
    d = size_flat[(np.cumsum(nd) - nd)[names][row_of] + dim]
    return bool(np.all((d < 0) | ((k <= d) & (o <= d - k))))


def _check_chunks_agree(entries: dict[str, DcpEntry], table: ItemTable, whole: bool,
                        part: tuple[int, int] = (0, 1)) -> None:
    """DCP's chunk list of every tensor is what the items store: a load plans its reads from the chunk
    list, while ``verify``, ``read``'s files and ``export`` go by the items, so a manifest whose two
    halves disagree (corrupt, or re-sealed by hand) must be refused by all of them. Each chunk lies
    inside the tensor and the chunks' elements add up to the tensor's; where the manifest holds every
    item (``whole``: one storage domain) the items' chunks are exactly the listed ones, else each item
    is one of them. Whole tensors (one chunk, the common case) are checked on counts and element
    counts per name; only a sharded tensor's chunks are compared row by row (numpy). ``part`` (k, n):
    the k-th of every n entries only."""
    index = {nm: i for i, nm in enumerate(table.names)}
    rows = np.flatnonzero(table.shape_ndim >= 0)
    names = table.name[rows]
    count = np.bincount(names, minlength=len(table.names)).tolist()
    volume = np.zeros(len(table.names), dtype=np.int64)
    np.add.at(volume, names, np.clip(_products(table, rows), 0, None))  # each < 2**62; -1 (huge) as 0
    volumes = volume.tolist()
    sharded: list[tuple[str, DcpEntry, int]] = []
    first, every = part
    mine = entries.items() if every == 1 else islice(entries.items(), first, None, every)
    for nm, e in mine:  # messages formatted only on failure: this runs once per tensor
        size, flat = e.size, e.chunks
        if e.type != "tensor" or size is None or flat is None or not size:
            continue  # malformed entries are refused by metadata_from_json; 0-dim tensors have one chunk
        if min(size) < 0:  # (as metadata_from_json, which verify does not run: two negative dimensions
            # multiply to the items')
            _invalid(f"dcp.state_dict[{nm[:100]!r}]: size {size[:8]} is not a list of integers >= 0")
        if 0 in size and not addressable(size):  # no bytes bound the other dimensions, and torch
            # computes an empty tensor's strides
            _invalid(f"dcp.state_dict[{nm[:100]!r}]: size {size[:8]} has more elements than a "
                     "tensor can address")
        k = index.get(nm, -1)
        n = count[k] if k >= 0 else 0
        if whole_chunk(size, flat):
            if n > 1 or (n == 0 and whole):
                _invalid(f"dcp.state_dict[{nm[:100]!r}] lists one chunk, the items store {n}")
            if n and volumes[k] != math.prod(size):
                _invalid(f"item {nm[:100]!r} is not the whole tensor {size[:8]} its DCP entry lists")
        else:
            sharded.append((nm, e, k))
    if sharded:
        _check_sharded_chunks(sharded, table, rows, whole)


def _check_sharded_chunks(sharded: list[tuple[str, DcpEntry, int]], table: ItemTable, rows: np.ndarray,
                          whole: bool) -> None:
    """``_check_chunks_agree`` for tensors of several chunks (or one that is not the whole tensor)."""
    by_name = rows[np.argsort(table.name[rows], kind="stable")]
    bounds = np.searchsorted(table.name[by_name], np.arange(len(table.names) + 1)).tolist()
    off_counts, shape_counts = np.clip(table.offsets_ndim, 0, None), np.clip(table.shape_ndim, 0, None)
    off_start, shape_start = np.cumsum(off_counts) - off_counts, np.cumsum(shape_counts) - shape_counts
    for nm, e, k in sharded:
        assert e.size is not None and e.chunks is not None
        ndim, where = len(e.size), f"dcp.state_dict[{nm[:100]!r}]"
        _expect(len(e.chunks) % (2 * ndim) == 0, f"{where}: its chunk list is not whole chunks")
        try:
            chunks = np.array(e.chunks, dtype=np.int64).reshape(-1, 2 * ndim)
            size = np.array(e.size, dtype=np.int64)
        except OverflowError:
            raise CheckpointError(f"{where}: a chunk or size beyond 2**63") from None
        offsets, sizes = chunks[:, :ndim], chunks[:, ndim:]
        _expect(bool(np.all((sizes <= size) & (offsets <= size - sizes))), f"{where}: a chunk lies outside "
                                                                           f"its size {e.size[:8]}")
        in_range = float(np.prod(sizes.astype(np.float64), axis=1).sum()) < 2.0**62  # int64 sums then exact
        _expect(in_range and int(np.prod(sizes, axis=1).sum()) == math.prod(e.size),
                f"{where}: its chunks do not add up to its size {e.size[:8]}")
        mine = by_name[bounds[k]:bounds[k + 1]] if k >= 0 else by_name[:0]
        _expect(len(mine) <= len(chunks) and (len(mine) == len(chunks) or not whole),
                f"{where} lists {len(chunks)} chunk(s), the items store {len(mine)}")
        if not len(mine):
            continue
        cols = np.arange(ndim)
        has_off = table.offsets_ndim[mine] >= 0
        item_off = np.where(has_off[:, None], table.offsets[np.where(has_off[:, None], off_start[mine][:, None] + cols,
                                                                      0)] if len(table.offsets) else 0, 0)
        item_shape = table.shape[shape_start[mine][:, None] + cols]
        stored = _as_rows(np.concatenate([item_off, item_shape], axis=1))
        listed = _as_rows(chunks)
        same = np.array_equal(np.sort(stored), np.sort(listed)) if whole else np.isin(stored, listed).all()
        _expect(bool(same), f"{where}: the items store chunks its chunk list does not list")


def _as_rows(a: np.ndarray) -> np.ndarray:
    """Each row of a 2-D int64 array as one comparable value (bytes), for sorting and membership."""
    a = np.ascontiguousarray(a, dtype=">i8")  # big-endian: byte order sorts as the numbers (all >= 0)
    return a.view(np.dtype((np.bytes_, a.shape[1] * 8))).ravel()


def _check_dcp_agrees_with_items(dcp: dict[str, Any], items: Sequence[StoredItem]) -> None:
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


__all__ = ["Artifact", "FileEntry", "Manifest", "StoredItem", "asdict", "manifest_summary", "seal"]
