"""The stored items of a checkpoint as columns: built by each rank, joined by the leader, encoded in bulk.

At 16,384 ranks a manifest lists millions of tensor chunks. Each rank turns its
own rows into an :class:`ItemTable` (numpy columns, names and dtypes as indices
into small tables) before sending them; the leader joins the tables with one
``np.concatenate`` per column and the manifest writes each column as one narrow
little-endian array. No Python object per row is made on the leader; a reader
makes the rows (:class:`StoredItem`) only when it iterates, in C.
"""

from __future__ import annotations

import binascii
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter, is_
from typing import Any, overload

import msgspec
import numpy as np

from ckptguard.dcp.records import StoredItem
from ckptguard.protocol.itemcolumns import (
    Column,
    EncodedItems,
    TableError,
    bound_column,
    msgpack_uints,
    narrow_column,
    widen_column,
)

#: No file of a checkpoint is larger: offsets and ends of items then add up inside int64.
MAX_FILE_BYTES = 1 << 62
#: A tensor chunk has at most this many dimensions (torch allows 64).
MAX_NDIM = 64

_I64 = np.int64
#: A StoredItem from a tuple of its fields, without a Python call per row (StoredItem._make, in C).
_STORED_ITEM = functools.partial(tuple.__new__, StoredItem)
#: The fields join reads from every table, fetched in C.
_NAME, _NAMES, _DTYPES, _PATHS = attrgetter("name"), attrgetter("names"), attrgetter("dtypes"), attrgetter("paths")
_CHECKSUM, _OFFSETS, _SHAPE, _PACKED = (
    attrgetter("checksum"),
    attrgetter("offsets"),
    attrgetter("shape"),
    attrgetter("packed"),
)


@dataclass(frozen=True, eq=False)
class ItemTable(Sequence[StoredItem]):
    """Rows of StoredItem as columns (int64 numpy arrays); ``paths[file[i]]`` is row i's file.

    ``offsets_ndim``/``shape_ndim`` are -1 where a row has no offsets/shape (an object), and
    ``offsets``/``shape`` hold the rows' values one after another."""

    names: list[str]
    name: np.ndarray
    dtypes: list[str | None]
    dtype: np.ndarray
    paths: list[str]
    file: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    checksum: np.ndarray  # fixed-width bytes ("S<w>")
    offsets_ndim: np.ndarray
    offsets: np.ndarray
    shape_ndim: np.ndarray
    shape: np.ndarray
    #: The seven per-row integer columns side by side (n x 7) when the table was made by ``_make``:
    #: the columns above are views of it, and ``join`` concatenates it once instead of column by column.
    packed: np.ndarray | None = None

    # -- building ------------------------------------------------------------------------------
    @staticmethod
    def from_items(items: Sequence[StoredItem], paths: list[str]) -> ItemTable:
        """One rank's rows as a table (a transpose and a few maps, in C); every row's file in ``paths``."""
        if isinstance(items, ItemTable) and items.paths == paths:
            return items
        n = len(items)
        if not n:
            return _empty(paths)
        fqn, offsets, file, offset, length, digest, dtype, shape = zip(*items, strict=True)
        names = list(dict.fromkeys(fqn))
        dtypes = list(dict.fromkeys(dtype))
        index = {p: i for i, p in enumerate(paths)}
        try:
            file_of = np.fromiter(map(index.__getitem__, file), _I64, n)
        except KeyError as e:
            raise ValueError(f"an item lies in {e.args[0]!r}, which is not among the files") from None
        offsets_ndim, offsets_flat = _ragged(offsets, n)
        shape_ndim, shape_flat = _ragged(shape, n)
        ints = np.stack(
            [
                np.fromiter(map({k: i for i, k in enumerate(names)}.__getitem__, fqn), _I64, n),
                np.fromiter(map({k: i for i, k in enumerate(dtypes)}.__getitem__, dtype), _I64, n),
                file_of,
                np.array(offset, dtype=_I64),
                np.array(length, dtype=_I64),
                offsets_ndim,
                shape_ndim,
            ],
            axis=1,
        )
        return _make(names, dtypes, list(paths), ints, np.array(digest, dtype=np.bytes_), offsets_flat, shape_flat)

    @staticmethod
    def join(tables: Sequence[ItemTable]) -> ItemTable:
        """The rows of every table, in order; file indices shifted past the files of the tables before.
        One ``np.concatenate`` of the integer columns side by side (the per-array cost of 16,384 small
        tables is what counts), one per other column, and every per-table step a C iterator (``map``,
        ``list.count``): no bytecode runs per table. Ranks that save the same structure send equal
        name and dtype tables, which then need no remapping (others are remapped table by table)."""
        if not tables:
            return _empty([])
        first = tables[0]
        names, dtypes = list(first.names), list(first.dtypes)
        count = len(tables)
        lengths = np.fromiter(map(len, map(_NAME, tables)), _I64, count)
        nfiles = np.fromiter(map(len, map(_PATHS, tables)), _I64, count)
        checksum = np.concatenate(list(map(_CHECKSUM, tables)))  # numpy widens to the widest "S<w>"
        paths = list(chain.from_iterable(map(_PATHS, tables)))
        offsets = np.concatenate(list(map(_OFFSETS, tables)))
        shape = np.concatenate(list(map(_SHAPE, tables)))
        same_names = list(map(_NAMES, tables)).count(first.names) == count
        same_dtypes = list(map(_DTYPES, tables)).count(first.dtypes) == count
        packed = list(map(_PACKED, tables))
        if not any(map(is_, packed, repeat(None))):  # one concatenation of the integer columns
            ints: np.ndarray = np.concatenate(packed)
            if not same_names:
                ints[:, 0] = np.concatenate([_remap(names, t.names)[t.name] for t in tables])
            if not same_dtypes:
                ints[:, 1] = np.concatenate([_remap(dtypes, t.dtypes)[t.dtype] for t in tables])
            ints[:, 2] += np.repeat(np.cumsum(nfiles) - nfiles, lengths)
            return _make(names, dtypes, paths, ints, checksum, offsets, shape)
        name = np.concatenate([t.name for t in tables])
        dtype = np.concatenate([t.dtype for t in tables])
        if not same_names:
            name = np.concatenate([_remap(names, t.names)[t.name] for t in tables])
        if not same_dtypes:
            dtype = np.concatenate([_remap(dtypes, t.dtypes)[t.dtype] for t in tables])
        file = np.concatenate([t.file for t in tables]) + np.repeat(np.cumsum(nfiles) - nfiles, lengths)
        return ItemTable(
            names,
            name,
            dtypes,
            dtype,
            paths,
            file,
            np.concatenate([t.offset for t in tables]),
            np.concatenate([t.length for t in tables]),
            checksum,
            np.concatenate([t.offsets_ndim for t in tables]),
            offsets,
            np.concatenate([t.shape_ndim for t in tables]),
            shape,
        )

    # -- DCP's chunk lists ----------------------------------------------------------------------
    def flat_chunks(self, rows_per_rank: Sequence[int], min_rows: int = 1) -> dict[str, tuple[int, int, msgspec.Raw]]:
        """Per name with at least ``min_rows`` rows, (row count, dimensions, MessagePack of the list
        [offsets..., shape..., offsets..., shape...] of its rows in table order): DCP's flat chunk list
        (codec.metadata_to_json) encoded from the columns, with no Python object per chunk. The
        table holds the ranks' rows one rank after another (``rows_per_rank``). DCP lists a tensor's
        chunks rank by rank, each rank's in its plan's order, which the table does not keep (the
        writer groups a rank's items by file): a name is listed only where each rank holds at most
        one of its rows, all with the same number of dimensions for offsets and shape; whether the
        count and dimensions are DCP's is the caller's check."""
        n = len(self)
        if n == 0 or sum(rows_per_rank) != n:
            return {}
        grid = self._rank_grid(rows_per_rank)
        if grid is not None:
            if len(rows_per_rank) < max(min_rows, 1):
                return {}
            # Every rank holds one row of each of the same names, in the same order (a sharded model):
            # rank by rank, its rows' offsets (and shapes) have the same layout, and a name's chunks are
            # columns of those, no sort needed.
            names, dims = grid
            width = sum(dims)
            offsets, shape = self.offsets.reshape(-1, width), self.shape.reshape(-1, width)
            at = np.cumsum(dims).tolist()
            columns = {name: (a - d, a) for name, d, a in zip(names, dims, at, strict=True)}
            return {
                self.names[name]: (
                    len(rows_per_rank),
                    a - s,
                    msgspec.Raw(msgpack_uints(np.concatenate([offsets[:, s:a], shape[:, s:a]], axis=1))),
                )
                for name, (s, a) in sorted(columns.items())
            }
        counts = np.bincount(self.name, minlength=len(self.names))
        wanted = np.flatnonzero(counts >= max(min_rows, 1))
        if not len(wanted):
            return {}
        rank = np.repeat(np.arange(len(rows_per_rank), dtype=_I64), np.asarray(rows_per_rank, dtype=_I64))
        # Grouped by name, each group in table (rank) order; a radix sort where names fit 16 bits.
        key = self.name.astype(np.uint16) if len(self.names) <= 1 << 16 else self.name
        order = np.argsort(key, kind="stable")
        name_sorted, rank_sorted = self.name[order], rank[order]
        same_name = name_sorted[1:] == name_sorted[:-1]
        repeated = set(name_sorted[1:][same_name & (rank_sorted[1:] <= rank_sorted[:-1])].tolist())
        ends = np.cumsum(counts)
        starts = ends - counts
        lo, hi = int(self.offsets_ndim.min()), int(self.offsets_ndim.max())
        if lo == hi >= 0 and (self.shape_ndim == lo).all():  # every row a tensor of lo dimensions
            d = lo
            every = np.concatenate([self.offsets.reshape(n, d), self.shape.reshape(n, d)], axis=1)[order]
            return {
                self.names[k]: (int(counts[k]), d, msgspec.Raw(msgpack_uints(every[starts[k] : ends[k]])))
                for k in wanted.tolist()
                if k not in repeated
            }
        off_ndim, shape_ndim = np.clip(self.offsets_ndim, 0, None), np.clip(self.shape_ndim, 0, None)
        off_start, shape_start = np.cumsum(off_ndim) - off_ndim, np.cumsum(shape_ndim) - shape_ndim
        out: dict[str, tuple[int, int, msgspec.Raw]] = {}
        for k in wanted.tolist():
            if k in repeated:
                continue
            rows = order[starts[k] : ends[k]]
            ndim = self.offsets_ndim[rows]
            d = int(ndim[0])
            if d < 0 or not (ndim == d).all() or not (self.shape_ndim[rows] == d).all():
                continue
            cols = np.arange(d)
            chunks = np.concatenate(
                [self.offsets[off_start[rows][:, None] + cols], self.shape[shape_start[rows][:, None] + cols]], axis=1
            )
            out[self.names[k]] = (len(rows), d, msgspec.Raw(msgpack_uints(chunks)))
        return out

    def _rank_grid(self, rows_per_rank: Sequence[int]) -> tuple[list[int], list[int]] | None:
        """(name indices, dimensions) of the first rank's rows where every rank holds rows of exactly
        those distinct names in that order, each a tensor chunk with offsets and shape of those
        dimensions (at least one); else None."""
        k = rows_per_rank[0]
        if not k or not (np.asarray(rows_per_rank, dtype=_I64) == k).all():
            return None
        first, dims = self.name[:k], self.offsets_ndim[:k]
        if (dims < 1).any() or len(np.unique(first)) != k or not (self.name.reshape(-1, k) == first).all():
            return None
        if not ((self.offsets_ndim.reshape(-1, k) == dims).all() and (self.shape_ndim == self.offsets_ndim).all()):
            return None
        return first.tolist(), dims.tolist()

    # -- rows ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.name)

    @overload
    def __getitem__(self, i: int) -> StoredItem: ...
    @overload
    def __getitem__(self, i: slice) -> list[StoredItem]: ...
    def __getitem__(self, i: int | slice) -> StoredItem | list[StoredItem]:
        return self.rows()[i]

    def __iter__(self) -> Iterator[StoredItem]:
        return iter(self.rows())

    def rows(self) -> list[StoredItem]:
        """Every row as a StoredItem (made once, in C, and kept)."""
        cached: list[StoredItem] | None = self.__dict__.get("_rows")
        if cached is None:
            n = len(self)
            width = self.checksum.dtype.itemsize
            cached = list(
                map(
                    _STORED_ITEM,
                    zip(
                        map(self.names.__getitem__, self.name.tolist()),
                        _tuples(self.offsets_ndim, self.offsets),
                        map(self.paths.__getitem__, self.file.tolist()),
                        self.offset.tolist(),
                        self.length.tolist(),
                        self.checksum.astype(f"U{width}").tolist() if n else [],
                        map(self.dtypes.__getitem__, self.dtype.tolist()),
                        _tuples(self.shape_ndim, self.shape),
                        strict=True,
                    ),
                )
            )
            object.__setattr__(self, "_rows", cached)
        return cached

    def take(self, rows: np.ndarray) -> ItemTable:
        """The table of the rows at ``rows`` (indices, in that order): a rank that loads a few of a
        checkpoint's items makes StoredItems for those only."""
        ints = (
            self.packed
            if self.packed is not None
            else np.stack(
                [self.name, self.dtype, self.file, self.offset, self.length, self.offsets_ndim, self.shape_ndim], axis=1
            )
        )
        return _make(
            self.names,
            self.dtypes,
            self.paths,
            ints[rows],
            self.checksum[rows],
            _take_ragged(self.offsets_ndim, self.offsets, rows),
            _take_ragged(self.shape_ndim, self.shape, rows),
        )

    # -- bytes ---------------------------------------------------------------------------------
    def __reduce__(self) -> tuple[Any, ...]:
        """Sent between ranks as the manifest stores it (narrow columns, ~34 bytes a row), not as
        int64 arrays with pickle's overhead per array."""
        return _from_wire, (msgspec.msgpack.encode(self.encode()), self.paths)

    def encode(self) -> EncodedItems:
        """The table as the manifest stores it: each column as its narrowest little-endian array."""
        width = self.checksum.dtype.itemsize
        raw = self.checksum.tobytes()
        try:  # hex checksums (every algorithm ckptguard has) stored as their bytes: half the size; only
            # lowercase hex of even width, so that decoding (``bytes.hex``) gives back the same text
            as_bytes = binascii.unhexlify(raw)
            binary = width % 2 == 0 and binascii.hexlify(as_bytes) == raw
        except binascii.Error:
            binary = False
        checksum = as_bytes if binary else raw
        if self.packed is not None and len(self):  # the per-row columns' bounds in one pass
            lo, hi = self.packed.min(axis=0).tolist(), self.packed.max(axis=0).tolist()
            name, dtype, file, offset, length = (narrow_column(self.packed[:, c], (lo[c], hi[c])) for c in range(5))
            offsets_ndim = narrow_column(self.offsets_ndim + 1, (lo[5] + 1, hi[5] + 1))
            shape_ndim = narrow_column(self.shape_ndim + 1, (lo[6] + 1, hi[6] + 1))
        else:
            name, dtype, file, offset, length = map(
                narrow_column, (self.name, self.dtype, self.file, self.offset, self.length)
            )
            offsets_ndim, shape_ndim = narrow_column(self.offsets_ndim + 1), narrow_column(self.shape_ndim + 1)
        return EncodedItems(
            len(self),
            self.names,
            self.dtypes,
            name,
            dtype,
            file,
            offset,
            length,
            width,
            binary,
            checksum,
            offsets_ndim,
            narrow_column(self.offsets),
            shape_ndim,
            narrow_column(self.shape),
        )

    @staticmethod
    def decode(e: EncodedItems, paths: list[str]) -> ItemTable:
        """A table from the manifest's columns, every count and index bounded (TableError otherwise);
        what relates the fields to each other (sizes, shapes) is the manifest parser's to check."""
        n = e.count
        cols = {f: widen_column(getattr(e, f), f, n) for f in ("name", "dtype", "file", "offset", "length")}
        bound_column(cols["name"], len(e.names), "name index")
        bound_column(cols["dtype"], len(e.dtypes), "dtype index")
        bound_column(cols["file"], len(paths), "file index")
        bound_column(cols["offset"], MAX_FILE_BYTES + 1, "offset")
        bound_column(cols["length"], MAX_FILE_BYTES + 1, "length")
        width = e.checksum_width
        if n and (not 1 <= width <= 128 or (e.checksum_binary and width % 2)):
            raise TableError(f"checksum width {width} is not one a checksum has")
        raw = e.checksum.hex().encode() if e.checksum_binary else e.checksum
        if len(raw) != n * width:
            raise TableError(f"the checksums take {len(raw)} bytes, not {n} x {width}")
        ragged = []
        for f in ("offsets", "shape"):
            ndim = widen_column(getattr(e, f + "_ndim"), f + "_ndim", n) - 1
            bound_column(ndim + 1, MAX_NDIM + 2, f"{f} dimensions")
            values = widen_column(getattr(e, f), f, int(np.clip(ndim, 0, None).sum()))
            ragged += [ndim, values]
        ints = np.stack(
            [cols["name"], cols["dtype"], cols["file"], cols["offset"], cols["length"], ragged[0], ragged[2]], axis=1
        )
        return _make(
            list(e.names),
            list(e.dtypes),
            paths,
            ints,
            np.frombuffer(raw, f"S{width}") if n else np.zeros(0, "S1"),
            ragged[1],
            ragged[3],
        )


def _make(
    names: list[str],
    dtypes: list[str | None],
    paths: list[str],
    ints: np.ndarray,
    checksum: np.ndarray,
    offsets: np.ndarray,
    shape: np.ndarray,
) -> ItemTable:
    """A table whose seven integer columns (name, dtype, file, offset, length, offsets_ndim,
    shape_ndim) are the columns of ``ints`` (n x 7)."""
    return ItemTable(
        names,
        ints[:, 0],
        dtypes,
        ints[:, 1],
        paths,
        ints[:, 2],
        ints[:, 3],
        ints[:, 4],
        checksum,
        ints[:, 5],
        offsets,
        ints[:, 6],
        shape,
        ints,
    )


def _from_wire(blob: bytes, paths: list[str]) -> ItemTable:
    return ItemTable.decode(msgspec.msgpack.decode(blob, type=EncodedItems), paths)


def _empty(paths: list[str]) -> ItemTable:
    z = np.zeros(0, _I64)
    return _make([], [], list(paths), np.zeros((0, 7), _I64), np.zeros(0, "S1"), z, z)


def _remap(table: list[Any], local: list[Any]) -> np.ndarray:
    """Indices into ``table`` (extended with what it lacks) of each entry of ``local``."""
    index = {k: i for i, k in enumerate(table)}
    for k in local:
        if k not in index:
            index[k] = len(table)
            table.append(k)
    return np.fromiter(map(index.__getitem__, local), _I64, len(local))


def _ragged(values: tuple[tuple[int, ...] | None, ...], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row tuples (or None) as (ndim per row, -1 for None; every value one after another)."""
    ndim = np.fromiter((-1 if v is None else len(v) for v in values), _I64, n)
    flat = np.fromiter(chain.from_iterable(v for v in values if v is not None), _I64)
    return ndim, flat


def _take_ragged(ndim: np.ndarray, flat: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The values of the rows at ``rows`` of a ragged column (``ndim`` per row, -1 for none), one
    after another."""
    counts = np.clip(ndim, 0, None)
    starts = np.cumsum(counts) - counts
    taken = counts[rows]
    total = int(taken.sum())
    if not total:
        return np.zeros(0, _I64)
    within = np.arange(total) - np.repeat(np.cumsum(taken) - taken, taken)
    values: np.ndarray = flat[np.repeat(starts[rows], taken) + within]
    return values


def _tuples(ndim: np.ndarray, flat: np.ndarray) -> list[tuple[int, ...] | None]:
    """The per-row tuples back (None where ndim is -1): one reshape when every row has the same ndim."""
    n = len(ndim)
    if not n:
        return []
    kinds = np.unique(ndim)
    if len(kinds) == 1 and kinds[0] >= 0:
        d = int(kinds[0])
        return list(map(tuple, flat.reshape(n, d).tolist())) if d else [()] * n
    out: list[tuple[int, ...] | None] = [None] * n
    starts = np.cumsum(np.clip(ndim, 0, None)) - np.clip(ndim, 0, None)
    for d in kinds.tolist():
        if d < 0:
            continue
        rows = np.flatnonzero(ndim == d)
        values = flat[starts[rows][:, None] + np.arange(d)].tolist() if d else [[]] * len(rows)
        for r, v in zip(rows.tolist(), values, strict=True):
            out[r] = tuple(v)
    return out


__all__ = ["MAX_FILE_BYTES", "Column", "EncodedItems", "ItemTable", "TableError", "msgpack_uints"]
