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

#: No file of a checkpoint is larger: offsets and ends of items then add up inside int64.
MAX_FILE_BYTES = 1 << 62
#: A tensor chunk has at most this many dimensions (torch allows 64).
MAX_NDIM = 64

_I64 = np.int64
#: A StoredItem from a tuple of its fields, without a Python call per row (StoredItem._make, in C).
_STORED_ITEM = functools.partial(tuple.__new__, StoredItem)
#: Column encodings on disk: the narrowest that holds a column's values.
_NARROW = (("u1", 1 << 8), ("u2", 1 << 16), ("u4", 1 << 32), ("u8", 1 << 63))
_CODES = {code for code, _ in _NARROW}
#: The fields join reads from every table, fetched in C.
_NAME, _NAMES, _DTYPES, _PATHS = attrgetter("name"), attrgetter("names"), attrgetter("dtypes"), attrgetter("paths")
_CHECKSUM, _OFFSETS, _SHAPE, _PACKED = (attrgetter("checksum"), attrgetter("offsets"), attrgetter("shape"),
                                        attrgetter("packed"))


class TableError(ValueError):
    """An encoded table that is not one ItemTable wrote (the manifest parser names the file)."""


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
        ints = np.stack([np.fromiter(map({k: i for i, k in enumerate(names)}.__getitem__, fqn), _I64, n),
                         np.fromiter(map({k: i for i, k in enumerate(dtypes)}.__getitem__, dtype), _I64, n),
                         file_of, np.array(offset, dtype=_I64), np.array(length, dtype=_I64), offsets_ndim,
                         shape_ndim], axis=1)
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
            names, name, dtypes, dtype, paths, file,
            np.concatenate([t.offset for t in tables]), np.concatenate([t.length for t in tables]), checksum,
            np.concatenate([t.offsets_ndim for t in tables]), offsets,
            np.concatenate([t.shape_ndim for t in tables]), shape)

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
            cached = list(map(_STORED_ITEM, zip(
                map(self.names.__getitem__, self.name.tolist()), _tuples(self.offsets_ndim, self.offsets),
                map(self.paths.__getitem__, self.file.tolist()), self.offset.tolist(), self.length.tolist(),
                self.checksum.astype(f"U{width}").tolist() if n else [],
                map(self.dtypes.__getitem__, self.dtype.tolist()), _tuples(self.shape_ndim, self.shape),
                strict=True)))
            object.__setattr__(self, "_rows", cached)
        return cached

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
            name, dtype, file, offset, length = (_narrow(self.packed[:, c], (lo[c], hi[c])) for c in range(5))
            offsets_ndim = _narrow(self.offsets_ndim + 1, (lo[5] + 1, hi[5] + 1))
            shape_ndim = _narrow(self.shape_ndim + 1, (lo[6] + 1, hi[6] + 1))
        else:
            name, dtype, file, offset, length = map(_narrow, (self.name, self.dtype, self.file, self.offset,
                                                              self.length))
            offsets_ndim, shape_ndim = _narrow(self.offsets_ndim + 1), _narrow(self.shape_ndim + 1)
        return EncodedItems(len(self), self.names, self.dtypes, name, dtype, file, offset, length, width, binary,
                            checksum, offsets_ndim, _narrow(self.offsets), shape_ndim, _narrow(self.shape))

    @staticmethod
    def decode(e: EncodedItems, paths: list[str]) -> ItemTable:
        """A table from the manifest's columns, every count and index bounded (TableError otherwise);
        what relates the fields to each other (sizes, shapes) is the manifest parser's to check."""
        n = e.count
        cols = {f: _widen(getattr(e, f), f, n) for f in ("name", "dtype", "file", "offset", "length")}
        _bound(cols["name"], len(e.names), "name index")
        _bound(cols["dtype"], len(e.dtypes), "dtype index")
        _bound(cols["file"], len(paths), "file index")
        _bound(cols["offset"], MAX_FILE_BYTES + 1, "offset")
        _bound(cols["length"], MAX_FILE_BYTES + 1, "length")
        width = e.checksum_width
        if n and (not 1 <= width <= 128 or (e.checksum_binary and width % 2)):
            raise TableError(f"checksum width {width} is not one a checksum has")
        raw = e.checksum.hex().encode() if e.checksum_binary else e.checksum
        if len(raw) != n * width:
            raise TableError(f"the checksums take {len(raw)} bytes, not {n} x {width}")
        ragged = []
        for f in ("offsets", "shape"):
            ndim = _widen(getattr(e, f + "_ndim"), f + "_ndim", n) - 1
            _bound(ndim + 1, MAX_NDIM + 2, f"{f} dimensions")
            values = _widen(getattr(e, f), f, int(np.clip(ndim, 0, None).sum()))
            ragged += [ndim, values]
        ints = np.stack([cols["name"], cols["dtype"], cols["file"], cols["offset"], cols["length"], ragged[0],
                         ragged[2]], axis=1)
        return _make(list(e.names), list(e.dtypes), paths, ints,
                     np.frombuffer(raw, f"S{width}") if n else np.zeros(0, "S1"), ragged[1], ragged[3])


class Column(msgspec.Struct, array_like=True):
    """A numpy column on disk: its dtype code (``u1``..``u8``, little-endian) and its bytes."""

    code: str
    data: bytes


class EncodedItems(msgspec.Struct, array_like=True):
    """An ItemTable as the manifest's binary section holds it (see docs/protocol.md, "The manifest")."""

    count: int
    names: list[str]
    dtypes: list[str | None]
    name: Column
    dtype: Column
    file: Column
    offset: Column
    length: Column
    checksum_width: int
    checksum_binary: bool
    checksum: bytes
    offsets_ndim: Column  # ndim + 1 per row: 0 for none
    offsets: Column
    shape_ndim: Column
    shape: Column


def _make(names: list[str], dtypes: list[str | None], paths: list[str], ints: np.ndarray, checksum: np.ndarray,
          offsets: np.ndarray, shape: np.ndarray) -> ItemTable:
    """A table whose seven integer columns (name, dtype, file, offset, length, offsets_ndim,
    shape_ndim) are the columns of ``ints`` (n x 7)."""
    return ItemTable(names, ints[:, 0], dtypes, ints[:, 1], paths, ints[:, 2], ints[:, 3], ints[:, 4], checksum,
                     ints[:, 5], offsets, ints[:, 6], shape, ints)


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


def _narrow(a: np.ndarray, bounds: tuple[int, int] | None = None) -> Column:
    """The narrowest unsigned little-endian encoding of a column of non-negative values (``bounds``:
    its (min, max), when known)."""
    low, top = bounds if bounds is not None else (int(a.min()), int(a.max())) if len(a) else (0, 0)
    if low < 0:
        raise ValueError("a negative value in an item column")
    code = next(c for c, limit in _NARROW if top < limit)
    return Column(code, a.astype("<" + code).tobytes())


def _widen(c: Column, what: str, n: int) -> np.ndarray:
    if c.code not in _CODES:
        raise TableError(f"column {what} has encoding {c.code[:20]!r}, not one of {sorted(_CODES)}")
    a = np.frombuffer(c.data, "<" + c.code) if len(c.data) % int(c.code[1]) == 0 else None
    if a is None or len(a) != n:
        raise TableError(f"column {what} holds {len(c.data)} bytes of {c.code}, not {n} values")
    if c.code == "u8" and n and int(a.max()) >= 1 << 63:
        raise TableError(f"column {what} holds a value of 2**63 or more")
    return a.astype(_I64)


def _bound(a: np.ndarray, limit: int, what: str) -> None:
    if len(a) and int(a.max()) >= limit:
        raise TableError(f"an item's {what} {int(a.max())} is not below {limit}")


__all__ = ["MAX_FILE_BYTES", "Column", "EncodedItems", "ItemTable", "TableError"]
