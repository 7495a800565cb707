"""The checks of a manifest's DCP metadata (``check_manifest``, protocol/validate.py): every entry a whole
record of its type, the entries agreeing with the item rows (dtype, dimensions, place), and each tensor's
chunk list what the items store, covering the tensor exactly once.

A load plans its reads from the chunk list, while ``verify``, ``read``'s files and ``export`` go by the
items: a manifest whose two halves disagree (corrupt, or re-sealed by hand: the checksum is no
signature) is refused here, once, for all of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain, islice, repeat
from typing import Any

import numpy as np

from ckptguard.dcp.records import ITEMSIZES, StoredItem, addressable, covers_once, whole_chunk
from ckptguard.errors import CheckpointError
from ckptguard.protocol.itemtable import MAX_NDIM, ItemTable
from ckptguard.protocol.schema import DcpEntry
from ckptguard.protocol.validate_items import expect, invalid, products


def dcp_entries(entries: dict[str, DcpEntry], part: tuple[int, int]) -> None:
    """Each entry of ``part`` (k, n: the k-th of every n) is a whole record of its type: a tensor with a
    known dtype, requires_grad, a size of at most MAX_NDIM integers >= 0 that a tensor can address, and a
    chunk list of whole chunks of integers >= 0; an object with none of those.

    Checked on all entries at once (list comprehensions and C-level passes: each name of a checkpoint of
    many small tensors costs here); entries that fail are walked one by one (``_walk_dcp_entries``),
    which names the first bad one."""
    first, every = part
    mine = list(entries.values()) if every == 1 else list(islice(entries.values(), first, None, every))
    if not _dcp_entries_hold(mine):
        _walk_dcp_entries(entries, part)


def _dcp_entries_hold(mine: list[DcpEntry]) -> bool:
    """True only where every entry of ``mine`` passes ``_walk_dcp_entries`` (False: walk them)."""
    tensors = [e for e in mine if e.type == "tensor"]
    if len(tensors) < len(mine) and not all(
        e.type == "bytes" and e.dtype is None and e.size is None and e.chunks is None
        for e in mine
        if e.type != "tensor"
    ):
        return False
    if not tensors:
        return True
    sizes = [e.size for e in tensors]
    flats = [e.chunks for e in tensors]
    if (
        None in sizes
        or None in flats
        or not {e.dtype for e in tensors} <= _DTYPE_NAMES
        or None in [e.requires_grad for e in tensors]
    ):
        return False
    sized: list[list[int]] = sizes  # type: ignore[assignment]  # (None refused above)
    chunked: list[list[int]] = flats  # type: ignore[assignment]
    ndims = list(map(len, sized))
    if max(ndims) > MAX_NDIM:
        return False
    if min(chain.from_iterable(sized), default=0) < 0 or min(chain.from_iterable(chunked), default=0) < 0:
        return False
    if not all(map(addressable, sized)):
        return False
    lengths = np.fromiter(map(len, chunked), np.int64, len(chunked))
    return bool(np.all(lengths % np.maximum(2 * np.array(ndims, dtype=np.int64), 1) == 0))


#: The dtype names a tensor entry may have.
_DTYPE_NAMES = frozenset(ITEMSIZES)


def _walk_dcp_entries(entries: dict[str, DcpEntry], part: tuple[int, int]) -> None:
    """``dcp_entries`` entry by entry: raises naming the first bad entry."""
    first, every = part
    mine = entries.items() if every == 1 else islice(entries.items(), first, None, every)
    for nm, e in mine:
        where = f"dcp.state_dict[{nm[:100]!r}]"
        if e.type == "bytes":
            expect(
                e.dtype is None and e.size is None and e.chunks is None,
                f"{where}: an object entry with a tensor's fields",
            )
            continue
        expect(e.type == "tensor", f"{where}: type {e.type[:40]!r} is neither tensor nor bytes")
        expect(
            e.dtype is not None and e.dtype in ITEMSIZES,
            f"{where}: dtype {str(e.dtype)[:40]!r} is not one a tensor has",
        )
        expect(e.requires_grad is not None, f"{where}: requires_grad is missing")
        size, flat = e.size, e.chunks
        expect(
            size is not None and len(size) <= MAX_NDIM and min(size, default=0) >= 0,
            f"{where}: size {str(size)[:100]} is not a list of integers >= 0",
        )
        expect(
            flat is not None and min(flat, default=0) >= 0, f"{where}: chunk offsets and sizes must be integers >= 0"
        )
        assert size is not None and flat is not None
        expect(addressable(size), f"{where}: size {size[:8]} has more elements than a tensor can address")
        expect(len(flat) % (2 * len(size) or 1) == 0, f"{where}: its chunk list is not whole chunks")


def check_dcp_agrees(
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


def check_chunks_agree(
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
    count = np.bincount(names, minlength=len(table.names))
    volume = np.zeros(len(table.names), dtype=np.int64)
    np.add.at(volume, names, np.clip(products(table, rows), 0, None))  # each < 2**62; -1 (huge) as 0
    first, every = part
    mine = list(entries.items()) if every == 1 else list(islice(entries.items(), first, None, every))
    sharded = _whole_chunks_agree(mine, index, count, volume, whole)
    if sharded is None:  # some entry fails: found and named entry by entry
        sharded = _walk_whole_chunks(mine, index, count.tolist(), volume.tolist(), whole)
    if sharded:
        _check_sharded_chunks(sharded, table, rows, whole)


def _whole_chunks_agree(
    mine: list[tuple[str, DcpEntry]], index: dict[str, int], count: np.ndarray, volume: np.ndarray, whole: bool
) -> list[tuple[str, DcpEntry, int]] | None:
    """``_walk_whole_chunks`` on all entries at once (list comprehensions and numpy): the entries of
    several chunks, or None where some entry fails (then walk them to name it)."""
    tensors = [(nm, e) for nm, e in mine if e.type == "tensor" and e.size and e.chunks is not None]
    if not tensors:
        return []
    sizes: list[list[int]] = [e.size for _, e in tensors]  # type: ignore[misc]  # (non-empty: above)
    if min(chain.from_iterable(sizes)) < 0 or not all(map(addressable, sizes)):
        return None
    single = np.fromiter(map(whole_chunk, sizes, [e.chunks for _, e in tensors]), bool, len(tensors))
    k = np.fromiter(map(index.get, [nm for nm, _ in tensors], repeat(-1)), np.int64, len(tensors))
    n = np.where(k >= 0, count[k], 0)
    if bool(np.any(single & ((n > 1) | ((n == 0) & whole)))):
        return None
    stored = np.flatnonzero(single & (n > 0))
    # Each size's product is below 2**62 (addressable, or 0 with a zero dimension): int64 holds it.
    prods = np.fromiter(map(math.prod, [sizes[i] for i in stored.tolist()]), np.int64, len(stored))
    if not np.array_equal(volume[k[stored]], prods):
        return None
    return [(tensors[i][0], tensors[i][1], int(k[i])) for i in np.flatnonzero(~single).tolist()]


def _walk_whole_chunks(
    mine: list[tuple[str, DcpEntry]], index: dict[str, int], count: list[int], volumes: list[int], whole: bool
) -> list[tuple[str, DcpEntry, int]]:
    """``check_chunks_agree`` for the entries of one whole chunk, entry by entry (raising naming the
    first that fails); the entries of several chunks, for ``_check_sharded_chunks``."""
    sharded: list[tuple[str, DcpEntry, int]] = []
    for nm, e in mine:  # messages formatted only on failure
        size, flat = e.size, e.chunks
        if e.type != "tensor" or size is None or flat is None or not size:
            continue  # malformed entries are refused by metadata_from_json; 0-dim tensors have one chunk
        if min(size) < 0:  # (as metadata_from_json, which verify does not run: two negative dimensions
            # multiply to the items')
            invalid(f"dcp.state_dict[{nm[:100]!r}]: size {size[:8]} is not a list of integers >= 0")
        if 0 in size and not addressable(size):  # no bytes bound the other dimensions, and torch
            # computes an empty tensor's strides
            invalid(f"dcp.state_dict[{nm[:100]!r}]: size {size[:8]} has more elements than a tensor can address")
        k = index.get(nm, -1)
        n = count[k] if k >= 0 else 0
        if whole_chunk(size, flat):
            if n > 1 or (n == 0 and whole):
                invalid(f"dcp.state_dict[{nm[:100]!r}] lists one chunk, the items store {n}")
            if n and volumes[k] != math.prod(size):
                invalid(f"item {nm[:100]!r} is not the whole tensor {size[:8]} its DCP entry lists")
        else:
            sharded.append((nm, e, k))
    return sharded


def _check_sharded_chunks(
    sharded: list[tuple[str, DcpEntry, int]], table: ItemTable, rows: np.ndarray, whole: bool
) -> None:
    """``check_chunks_agree`` for tensors of several chunks (or one that is not the whole tensor)."""
    by_name = rows[np.argsort(table.name[rows], kind="stable")]
    bounds = np.searchsorted(table.name[by_name], np.arange(len(table.names) + 1)).tolist()
    off_counts, shape_counts = np.clip(table.offsets_ndim, 0, None), np.clip(table.shape_ndim, 0, None)
    off_start, shape_start = np.cumsum(off_counts) - off_counts, np.cumsum(shape_counts) - shape_counts
    for nm, e, k in sharded:
        assert e.size is not None and e.chunks is not None
        ndim, where = len(e.size), f"dcp.state_dict[{nm[:100]!r}]"
        expect(len(e.chunks) % (2 * ndim) == 0, f"{where}: its chunk list is not whole chunks")
        try:
            chunks = np.array(e.chunks, dtype=np.int64).reshape(-1, 2 * ndim)
            size = np.array(e.size, dtype=np.int64)
        except OverflowError:
            raise CheckpointError(f"{where}: a chunk or size beyond 2**63") from None
        offsets, sizes = chunks[:, :ndim], chunks[:, ndim:]
        expect(
            bool(np.all((sizes <= size) & (offsets <= size - sizes))),
            f"{where}: a chunk lies outside its size {e.size[:8]}",
        )
        in_range = float(np.prod(sizes.astype(np.float64), axis=1).sum()) < 2.0**62  # int64 sums then exact
        expect(
            in_range and int(np.prod(sizes, axis=1).sum()) == math.prod(e.size),
            f"{where}: its chunks do not add up to its size {e.size[:8]}",
        )
        mine = by_name[bounds[k] : bounds[k + 1]] if k >= 0 else by_name[:0]
        expect(
            len(mine) <= len(chunks) and (len(mine) == len(chunks) or not whole),
            f"{where} lists {len(chunks)} chunk(s), the items store {len(mine)}",
        )
        if len(mine):
            _check_stored_chunks_listed(table, mine, chunks, off_start, shape_start, whole, where)
        # Every load plans one read per listed chunk: a gap would be left unread, an overlap read twice.
        expect(
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
    expect(bool(same), f"{where}: the items store chunks its chunk list does not list")


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
        expect(entry.get("type") == "tensor", f"{where} disagree: a tensor row for an object entry")
        expect(
            entry.get("dtype") == item.dtype,
            f"{where} disagree on the dtype ({item.dtype} vs {str(entry.get('dtype'))[:40]})",
        )
        size: Any = entry.get("size")
        expect(
            type(size) is list and len(size) == len(item.shape),
            f"{where} disagree on the number of dimensions ({len(item.shape)} vs {str(size)[:80]})",
        )
        offsets = item.offsets if item.offsets is not None else (0,) * len(item.shape)
        inside = len(offsets) == len(item.shape) and all(  # a negative size: refused by metadata_from_json
            type(n) is int and (n < 0 or o + k <= n) for o, k, n in zip(offsets, item.shape, size, strict=True)
        )
        expect(
            inside,
            f"{where} disagree on the size: the chunk at {list(offsets)[:8]} of shape "
            f"{list(item.shape)[:8]} is not inside {str(size)[:80]}",
        )
