"""Every invariant of a manifest that relates one field to another, checked in one function.

``check_manifest`` is what every reader of a checkpoint runs on the manifest it parsed
(``Manifest.from_json``: load, read, export, import, verify, ``ls`` and ``run --checkpoints``
all get their manifest from it), so "verify says intact" and "load succeeds" judge the same
manifest by the same rules. The fields' types and bounds are the schema's
(protocol/schema.py, checked in C while decoding); here: the head (format, version, encoding,
algorithm, attempt, storage domain); files and artifact rows;
items (hex checksums, inside their file, shapes of their bytes); DCP's metadata (whole
records, planner paths one tree, agreeing with the items, chunks covering each tensor exactly once).

A failure raises ``CheckpointError`` naming the field (``Manifest.from_json`` makes it a
``CorruptCheckpointError`` naming the file).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from itertools import chain, islice, pairwise
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from ckptguard.checksum import ALGORITHMS
from ckptguard.dcp.records import (
    ITEMSIZES,
    MAX_VALUE_DEPTH,
    FileEntry,
    StoredItem,
    addressable,
    covers_once,
    whole_chunk,
)
from ckptguard.errors import CheckpointError, CorruptCheckpointError
from ckptguard.protocol.itemtable import MAX_NDIM, ItemTable
from ckptguard.protocol.layout import is_plain_relpath
from ckptguard.protocol.records import ATTEMPT_PATTERN
from ckptguard.protocol.schema import DcpBody, DcpEntry, ManifestBody

if TYPE_CHECKING:
    from ckptguard.protocol.manifest import Manifest

FORMAT = "ckptguard-checkpoint"
FORMAT_VERSION = 2
#: How the binary section after the JSON head is encoded (``rows.encoding`` in the head).
ROWS_ENCODING = "msgpack-columns"
#: Bytes of a checksum column stored as text: hex digits, and zeros padding a shorter checksum.
_HEX = np.zeros(256, dtype=bool)
_HEX[list(b"\x000123456789abcdefABCDEF")] = True


def check_head(body: ManifestBody, rows_bytes: int) -> None:
    """What the head says about itself and its row section (before the row section is decoded)."""
    _expect(body.format == FORMAT, "wrong format tag")
    _expect(
        body.format_version == FORMAT_VERSION,
        f"format_version {body.format_version!r} is not supported by this ckptguard "
        f"(expects {FORMAT_VERSION}); upgrade ckptguard",
    )
    _expect(body.rows.encoding == ROWS_ENCODING, f"rows.encoding {body.rows.encoding[:40]!r} is not {ROWS_ENCODING!r}")
    _expect(
        body.rows.bytes == rows_bytes,
        f"the row section has {rows_bytes} bytes, the head says {body.rows.bytes} (truncated or appended to)",
    )


def check_manifest(m: Manifest, dcp: DcpBody, part: tuple[int, int] = (0, 1)) -> None:
    """Every cross-field invariant of a parsed manifest (module docstring); ``dcp``: DCP's metadata as
    the schema decoded it. ``part`` (k, n): the checks relating DCP entries and item rows
    of the names k, k + n, ... only (the ranks of a storage domain share that work).

    Raises:
        CheckpointError: naming the field that breaks an invariant.
    """
    _expect(m.checksum_algorithm in ALGORITHMS, f"unknown checksum algorithm {m.checksum_algorithm[:40]!r}")
    _attempt(m.attempt)
    _domain(m)
    for f in m.files:
        _relpath(f.path, "file path")
    _artifacts(m)
    items = m.items
    if not isinstance(items, ItemTable):
        items = ItemTable.from_items(items, [f.path for f in m.files])
    _item_checksums(items)
    _items(items, m.files)
    entries = dcp.state_dict
    _dcp_entries(entries, part)
    _planner_paths(dcp.planner_data)
    _check_dcp_agrees(m.dcp, entries, items, part)
    _check_chunks_agree(entries, items, whole=m.domain_count == 1, part=part)


def check_whole_reads(m: Manifest, declared: Mapping[str, int], path: str) -> None:
    """Before a template-free read (``read``, ``export``) allocates each tensor of ``declared`` (name:
    bytes) whole: the bytes of each are stored in this manifest. Where the manifest is the only storage
    domain's, its parse already bounded every tensor so; a manifest of one domain of several bounds a
    tensor only by its own chunk list, and the chunks another domain stores cannot be read here anyway.

    Raises:
        CorruptCheckpointError: naming ``path`` and the first tensor larger than what is stored for it.
    """
    table = m.items
    if isinstance(table, ItemTable):
        per_name = np.bincount(table.name, weights=table.length.astype(np.float64), minlength=len(table.names))
        stored = dict(zip(table.names, per_name.tolist(), strict=True))
    else:
        stored = {}
        for item in table:
            stored[item.fqn] = stored.get(item.fqn, 0) + item.length
    for fqn, nbytes in declared.items():
        if nbytes > stored.get(fqn, 0):
            raise CorruptCheckpointError(
                f"{path}: dcp.state_dict[{fqn[:100]!r}] declares {nbytes} bytes, this manifest stores "
                f"{int(stored.get(fqn, 0))} for it (storage domain {m.domain_index} of {m.domain_count}): "
                "a read would allocate what it cannot fill; read it where every byte is stored",
                path=path,
            )


def _dcp_entries(entries: dict[str, DcpEntry], part: tuple[int, int]) -> None:
    """Each entry of ``part`` (k, n: the k-th of every n) is a whole record of its type: a tensor with a
    known dtype, requires_grad, a size of at most MAX_NDIM integers >= 0 that a tensor can address, and a
    chunk list of whole chunks of integers >= 0; an object with none of those."""
    first, every = part
    mine = entries.items() if every == 1 else islice(entries.items(), first, None, every)
    for nm, e in mine:
        where = f"dcp.state_dict[{nm[:100]!r}]"
        if e.type == "bytes":
            _expect(
                e.dtype is None and e.size is None and e.chunks is None,
                f"{where}: an object entry with a tensor's fields",
            )
            continue
        _expect(e.type == "tensor", f"{where}: type {e.type[:40]!r} is neither tensor nor bytes")
        _expect(
            e.dtype is not None and e.dtype in ITEMSIZES,
            f"{where}: dtype {str(e.dtype)[:40]!r} is not one a tensor has",
        )
        _expect(e.requires_grad is not None, f"{where}: requires_grad is missing")
        size, flat = e.size, e.chunks
        _expect(
            size is not None and len(size) <= MAX_NDIM and min(size, default=0) >= 0,
            f"{where}: size {str(size)[:100]} is not a list of integers >= 0",
        )
        _expect(
            flat is not None and min(flat, default=0) >= 0, f"{where}: chunk offsets and sizes must be integers >= 0"
        )
        assert size is not None and flat is not None
        _expect(addressable(size), f"{where}: size {size[:8]} has more elements than a tensor can address")
        _expect(len(flat) % (2 * len(size) or 1) == 0, f"{where}: its chunk list is not whole chunks")


def _planner_paths(planner: dict[str, list[str | int]]) -> None:
    """Lists and dicts are rebuilt from planner_data (values.unflatten): each path non-empty, no deeper
    than a stored value may nest, starting with a key, each index below the number of entries, and the
    paths one tree (what follows a prefix is always an index, always a key, or the value itself)."""
    entries = len(planner)
    kinds: dict[tuple[str | int, ...], str] = {}
    for k, path in planner.items():
        _expect(
            0 < len(path) <= MAX_VALUE_DEPTH
            and type(path[0]) is str
            and all(type(p) is str or (type(p) is int and 0 <= p < entries) for p in path),
            f"planner_data[{k[:100]!r}]: bad planner path {str(path)[:100]}",
        )
        for i, p in enumerate([*path, None]):
            kind = "value" if p is None else type(p).__name__
            _expect(
                kinds.setdefault(tuple(path[:i]), kind) == kind,
                f"planner_data[{k[:100]!r}]: bad planner path {str(path)[:100]}: it nests where another path does not",
            )


def _domain(m: Manifest) -> None:
    """The storage domain: one of ``count`` (at most one per rank), its ranks distinct, ascending and of
    the world (a reader bounds a tensor by what this manifest stores only where it is the one domain)."""
    _expect(m.domain_count <= m.world_size, f"domain.count {m.domain_count} is more than world_size {m.world_size}")
    _expect(
        m.domain_index < m.domain_count, f"domain.index {m.domain_index} is not below domain.count {m.domain_count}"
    )
    ranks = m.domain_ranks
    _expect(
        bool(ranks) and all(a < b for a, b in pairwise(ranks)) and ranks[-1] < m.world_size,
        f"domain.ranks {ranks[:8]} must be distinct ranks below world_size {m.world_size}, ascending",
    )


def _artifacts(m: Manifest) -> None:
    """Each artifact row names a listed file of its rank, which carries its own checksum."""
    files = {f.path: f for f in m.files}
    seen: set[tuple[int, str]] = set()
    named: set[str] = set()
    for a in m.artifacts:
        where = f"artifacts[rank {a.rank}, {a.key[:100]!r}]"
        _expect(a.kind in ("file", "dir"), f"{where}: kind must be file or dir")
        _expect((a.rank, a.key) not in seen, f"{where} is listed twice")
        seen.add((a.rank, a.key))
        _expect(a.kind == "dir" or len(a.files) == 1, f"{where}: a file artifact has one file row, not {len(a.files)}")
        _expect(a.rank < m.world_size, f"{where}: rank {a.rank} is not below world_size {m.world_size}")
        for rel, stored in a.files:
            _relpath(rel, f"{where} relative path")
            _relpath(stored, f"{where} stored path")
            f = files.get(stored)
            _expect(f is not None, f"{where}: its file {stored[:200]!r} is not in the manifest's file list")
            assert f is not None
            _expect(
                f.checksum is not None and f.rank == a.rank,
                f"{where}: its file {stored[:200]!r} is not a file of rank {a.rank} with a checksum",
            )
            named.add(stored)
    # A file with its own checksum is an artifact's (data files are covered by their items): one that no
    # artifact row names was not written by a save.
    orphans = [f.path for f in m.files if f.checksum is not None and f.path not in named]
    _expect(
        not orphans,
        f"files: {orphans[0][:200]!r} has a checksum of its own, and no artifact names it" if orphans else "",
    )


def _item_checksums(table: ItemTable) -> None:
    """A checksum column stored as text holds hexadecimal digits only (a reader decodes it as ASCII)."""
    raw = np.frombuffer(table.checksum.tobytes(), dtype=np.uint8)
    _expect(bool(_HEX[raw].all()), "items.checksum: a checksum stored as text is not hexadecimal digits")


def _expect(cond: bool, what: str) -> None:
    if not cond:
        _invalid(what)


def _invalid(what: str) -> NoReturn:
    raise CheckpointError(f"not a valid ckptguard manifest: {what}")


def _str(v: Any, what: str) -> str:
    _expect(isinstance(v, str), f"{what} must be a string")
    return str(v)


def _attempt(v: Any) -> str:
    # Object stores read a checkpoint's data under staging/step-N.<attempt>: a path part, so hex only.
    _expect(
        isinstance(v, str) and re.fullmatch(ATTEMPT_PATTERN, v) is not None,
        f"attempt {str(v)[:100]!r} must be 16-64 hex digits",
    )
    return str(v)


def _relpath(v: Any, what: str) -> str:
    p = _str(v, what)
    _expect(is_plain_relpath(p), f"{what} {p[:200]!r} must be a plain relative path inside the checkpoint")
    return p


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
        ok = bool(np.all(size > 0)) and bool(
            np.all((length % np.maximum(size, 1) == 0) & (length // np.maximum(size, 1) == _products(table, rows)))
        )
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
        _expect(
            offset + length <= sizes[file],
            f"item {fqn[:100]!r} claims bytes {offset}..{offset + length} of {file}, which has {sizes[file]}",
        )
        if shape is not None:
            itemsize = ITEMSIZES.get(dtype) if dtype is not None else None
            _expect(dtype is not None, "item shape without dtype")
            _expect(itemsize is not None, f"item {fqn[:100]!r} has unknown dtype {str(dtype)[:40]!r}")
            _expect(
                math.prod(shape) * (itemsize or 0) == length,
                f"item {fqn[:100]!r}: shape {list(shape)[:8]} of {dtype} does not match its {length} bytes",
            )
        else:
            _expect(dtype is None, "item dtype without shape")


def _check_dcp_agrees(
    dcp: dict[str, Any], entries: dict[str, DcpEntry], table: ItemTable, part: tuple[int, int] = (0, 1)
) -> None:
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
    shapes = [
        (e.dtype, e.size)
        if e is not None
        and e.type == "tensor"
        and e.dtype is not None
        and e.size is not None
        and len(e.size) <= MAX_NDIM
        else None
        for e in got
    ]
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
    if not (
        np.array_equal(np.array(entry_dtype, dtype=np.int64)[names], table.dtype[rows])
        and np.array_equal(nd[names], ndim)
        and bool(np.all((off_ndim == ndim) | (off_ndim < 0)))
    ):
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


def _check_chunks_agree(
    entries: dict[str, DcpEntry], table: ItemTable, whole: bool, part: tuple[int, int] = (0, 1)
) -> None:
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
            _invalid(f"dcp.state_dict[{nm[:100]!r}]: size {size[:8]} has more elements than a tensor can address")
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


def _check_sharded_chunks(
    sharded: list[tuple[str, DcpEntry, int]], table: ItemTable, rows: np.ndarray, whole: bool
) -> None:
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
        _expect(
            bool(np.all((sizes <= size) & (offsets <= size - sizes))),
            f"{where}: a chunk lies outside its size {e.size[:8]}",
        )
        in_range = float(np.prod(sizes.astype(np.float64), axis=1).sum()) < 2.0**62  # int64 sums then exact
        _expect(
            in_range and int(np.prod(sizes, axis=1).sum()) == math.prod(e.size),
            f"{where}: its chunks do not add up to its size {e.size[:8]}",
        )
        mine = by_name[bounds[k] : bounds[k + 1]] if k >= 0 else by_name[:0]
        _expect(
            len(mine) <= len(chunks) and (len(mine) == len(chunks) or not whole),
            f"{where} lists {len(chunks)} chunk(s), the items store {len(mine)}",
        )
        if len(mine):
            _check_stored_chunks_listed(table, mine, chunks, off_start, shape_start, whole, where)
        # Every load plans one read per listed chunk: a gap would be left unread, an overlap read twice.
        _expect(
            covers_once(e.size, chunks),
            f"{where}: its chunks do not cover the tensor exactly once (two overlap, and leave a gap)",
        )


def _check_stored_chunks_listed(
    table: ItemTable,
    mine: np.ndarray,
    chunks: np.ndarray,
    off_start: np.ndarray,
    shape_start: np.ndarray,
    whole: bool,
    where: str,
) -> None:
    """The chunks the items of one tensor store are its listed ``chunks`` (all of them if ``whole``)."""
    ndim = chunks.shape[1] // 2
    cols = np.arange(ndim)
    has_off = table.offsets_ndim[mine] >= 0
    item_off = np.where(
        has_off[:, None],
        table.offsets[np.where(has_off[:, None], off_start[mine][:, None] + cols, 0)] if len(table.offsets) else 0,
        0,
    )
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
        _expect(
            entry.get("dtype") == item.dtype,
            f"{where} disagree on the dtype ({item.dtype} vs {str(entry.get('dtype'))[:40]})",
        )
        size: Any = entry.get("size")
        _expect(
            type(size) is list and len(size) == len(item.shape),
            f"{where} disagree on the number of dimensions ({len(item.shape)} vs {str(size)[:80]})",
        )
        offsets = item.offsets if item.offsets is not None else (0,) * len(item.shape)
        inside = len(offsets) == len(item.shape) and all(  # a negative size: refused by metadata_from_json
            type(n) is int and (n < 0 or o + k <= n) for o, k, n in zip(offsets, item.shape, size, strict=True)
        )
        _expect(
            inside,
            f"{where} disagree on the size: the chunk at {list(offsets)[:8]} of shape "
            f"{list(item.shape)[:8]} is not inside {str(size)[:80]}",
        )
