"""How an item table (protocol/itemtable.py) is stored: each integer column as its narrowest
little-endian array, and DCP's chunk lists as MessagePack written straight from numpy columns.
"""

from __future__ import annotations

from itertools import pairwise

import msgspec
import numpy as np

_I64 = np.int64
#: Column encodings on disk: the narrowest that holds a column's values.
_NARROW = (("u1", 1 << 8), ("u2", 1 << 16), ("u4", 1 << 32), ("u8", 1 << 63))
_CODES = {code for code, _ in _NARROW}


class TableError(ValueError):
    """An encoded table that is not one ItemTable wrote (the manifest parser names the file)."""


class Column(msgspec.Struct, array_like=True):
    """A numpy column on disk: its dtype code (``u1``..``u8``, little-endian) and its bytes."""

    code: str
    data: bytes


class EncodedItems(msgspec.Struct, array_like=True):
    """An ItemTable as the manifest's binary section holds it (see the Commit protocol page, "The manifest")."""

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


#: MessagePack's forms of a non-negative integer, as msgspec writes them: below 128 the integer is its
#: own byte (positive fixint); then a marker byte and the integer big-endian in 1, 2, 4 or 8 bytes.
_UINT_BOUNDS = np.array([128, 1 << 8, 1 << 16, 1 << 32], dtype=_I64)
_UINT_MARKER = np.array([0, 0xCC, 0xCD, 0xCE, 0xCF], dtype=_I64)
#: Each value is first laid out as 16 bytes, two big-endian words: its marker (byte 7) and itself
#: (bytes 8-15); per form, the bytes of those 16 that MessagePack writes.
_UINT_BYTES = [list(range(15, 16)), [7, 15], [7, 14, 15], [7, 12, 13, 14, 15], [7, *range(8, 16)]]
_UINT_KEEP = np.array([[b in kept for b in range(16)] for kept in _UINT_BYTES])


def msgpack_uints(values: np.ndarray) -> bytes:
    """``values`` (m x c, non-negative) flattened row by row as a MessagePack array: byte for byte what
    msgspec encodes for the same list of ints, without a Python int per value. Every value is laid
    out as 16 bytes (marker, value) and the bytes its form uses are kept: by slicing, for each run of
    rows whose columns have the same forms (offsets grow with the rank, sizes repeat: few runs),
    else by a mask."""
    v = np.ascontiguousarray(values, dtype=_I64)
    v = v if v.ndim == 2 else v.reshape(-1, 1)
    m, c = v.shape
    n = m * c
    if n and int(v.min()) < 0:
        raise ValueError("a negative value in a chunk list")
    head = (
        bytes([0x90 | n])
        if n < 16
        else b"\xdc" + n.to_bytes(2, "big")
        if n < 1 << 16
        else b"\xdd" + n.to_bytes(4, "big")
    )
    if not n:
        return head
    form = np.searchsorted(_UINT_BOUNDS, v, side="right")
    laid = np.zeros((m, c, 2), ">u8")
    laid[:, :, 0] = _UINT_MARKER[form]
    laid[:, :, 1] = v
    raw = laid.view(np.uint8).reshape(m, c * 16)
    starts = np.flatnonzero((form[1:] != form[:-1]).any(axis=1)) + 1
    if len(starts) > 16 + m // 64:
        kept_bytes: bytes = raw[_UINT_KEEP[form].reshape(m, c * 16)].tobytes()
        return head + kept_bytes
    pieces = [head]
    bounds = [0, *starts.tolist(), m]
    for a, z in pairwise(bounds):
        kept = [16 * j + b for j, f in enumerate(form[a].tolist()) for b in _UINT_BYTES[f]]
        pieces.append(raw[a:z, kept].tobytes())
    return b"".join(pieces)


def narrow_column(a: np.ndarray, bounds: tuple[int, int] | None = None) -> Column:
    """The narrowest unsigned little-endian encoding of a column of non-negative values (``bounds``:
    its (min, max), when known)."""
    low, top = bounds if bounds is not None else (int(a.min()), int(a.max())) if len(a) else (0, 0)
    if low < 0:
        raise ValueError("a negative value in an item column")
    code = next(c for c, limit in _NARROW if top < limit)
    return Column(code, a.astype("<" + code).tobytes())


def widen_column(c: Column, what: str, n: int) -> np.ndarray:
    """The ``n`` values of a stored column as int64.

    Raises:
        TableError: an unknown encoding, another number of values, or one of 2**63 or more.
    """
    if c.code not in _CODES:
        raise TableError(f"column {what} has encoding {c.code[:20]!r}, not one of {sorted(_CODES)}")
    a = np.frombuffer(c.data, "<" + c.code) if len(c.data) % int(c.code[1]) == 0 else None
    if a is None or len(a) != n:
        raise TableError(f"column {what} holds {len(c.data)} bytes of {c.code}, not {n} values")
    if c.code == "u8" and n and int(a.max()) >= 1 << 63:
        raise TableError(f"column {what} holds a value of 2**63 or more")
    return a.astype(_I64)


def bound_column(a: np.ndarray, limit: int, what: str) -> None:
    """Raise TableError naming ``what`` unless every value of ``a`` is below ``limit``."""
    if len(a) and int(a.max()) >= limit:
        raise TableError(f"an item's {what} {int(a.max())} is not below {limit}")


__all__ = ["Column", "EncodedItems", "TableError", "bound_column", "msgpack_uints", "narrow_column", "widen_column"]
