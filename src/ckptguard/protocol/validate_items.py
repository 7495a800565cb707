"""The checks of a manifest's item rows (``check_manifest``, protocol/validate.py): checksum text, each
item inside its file and of its shape's bytes, and the items of each data file tiling it.

A failure raises ``CheckpointError`` naming the field (``Manifest.from_json`` makes it a
``CorruptCheckpointError`` naming the file).
"""

from __future__ import annotations

import math
from typing import NoReturn

import numpy as np

from ckptguard.dcp.records import ITEMSIZES, FileEntry, StoredItem
from ckptguard.errors import CheckpointError
from ckptguard.protocol.itemtable import ItemTable

#: Bytes of a checksum column stored as text: hex digits, and zeros padding a shorter checksum.
_HEX = np.zeros(256, dtype=bool)
_HEX[list(b"\x000123456789abcdefABCDEF")] = True


def item_checksums(table: ItemTable) -> None:
    """A checksum column stored as text holds hexadecimal digits only (a reader decodes it as ASCII)."""
    raw = np.frombuffer(table.checksum.tobytes(), dtype=np.uint8)
    expect(bool(_HEX[raw].all()), "items.checksum: a checksum stored as text is not hexadecimal digits")


def items(table: ItemTable, files: list[FileEntry]) -> None:
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
            np.all((length % np.maximum(size, 1) == 0) & (length // np.maximum(size, 1) == products(table, rows)))
        )
    if not ok:
        _check_items(table.rows(), files)


def products(table: ItemTable, rows: np.ndarray) -> np.ndarray:
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
        expect(
            offset + length <= sizes[file],
            f"item {fqn[:100]!r} claims bytes {offset}..{offset + length} of {file}, which has {sizes[file]}",
        )
        if shape is not None:
            itemsize = ITEMSIZES.get(dtype) if dtype is not None else None
            expect(dtype is not None, "item shape without dtype")
            expect(itemsize is not None, f"item {fqn[:100]!r} has unknown dtype {str(dtype)[:40]!r}")
            expect(
                math.prod(shape) * (itemsize or 0) == length,
                f"item {fqn[:100]!r}: shape {list(shape)[:8]} of {dtype} does not match its {length} bytes",
            )
        else:
            expect(dtype is None, "item dtype without shape")


def expect(cond: bool, what: str) -> None:
    if not cond:
        invalid(what)


def invalid(what: str) -> NoReturn:
    raise CheckpointError(f"not a valid ckptguard manifest: {what}")


def tiling(table: ItemTable, files: list[FileEntry]) -> None:
    """The items of each data file cover it exactly: no gap, no overlap, nothing past them (a load reads
    by items, ``verify`` reads whole files: a manifest that says otherwise is refused for both). One sort
    of the rows by (file, offset, length: an empty item first); files without items (artifacts') are not
    data files."""
    if not len(table):
        return
    order = np.lexsort((table.length, table.offset, table.file))
    file, start = table.file[order], table.offset[order]
    end = start + table.length[order]  # each <= MAX_FILE_BYTES: no overflow
    first = np.ones(len(order), dtype=bool)
    first[1:] = file[1:] != file[:-1]
    last = np.ones(len(order), dtype=bool)
    last[:-1] = first[1:]
    sizes = np.array([f.size for f in files], dtype=np.int64)
    follows = np.ones(len(order), dtype=bool)
    follows[1:] = start[1:] == end[:-1]
    ok = np.where(first, start == 0, follows) & (~last | (end == sizes[file]))
    if not bool(ok.all()):
        at = int(np.argmin(ok))
        bad = files[int(file[at])].path
        invalid(
            f"files: the items of {bad[:200]!r} do not tile it (a gap, an overlap, or bytes past its items, "
            f"at byte {int(start[at])})"
        )
