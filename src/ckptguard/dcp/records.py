"""Where the data path put each item: the rows a manifest lists (NamedTuples: millions at scale)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np


class StoredItem(NamedTuple):
    """One DCP storage item (a tensor chunk or a serialized object) inside a data file.

    A NamedTuple, not a dataclass: manifests hold one per tensor chunk (millions
    at scale), and tuples are created, pickled and hashed several times faster.
    """

    fqn: str
    offsets: tuple[int, ...] | None  # chunk offsets for tensors, None for objects
    file: str
    offset: int
    length: int
    checksum: str
    dtype: str | None = None  # tensors only
    shape: tuple[int, ...] | None = None  # tensors only: the stored chunk's shape


class FileEntry(NamedTuple):
    """A file of the checkpoint. Data files are covered item by item; artifacts carry their own checksum."""

    path: str
    size: int
    rank: int
    checksum: str | None = None


#: Bytes per element of each dtype name a manifest may hold, without importing torch (``ls`` and
#: ``verify`` never do): a tensor row's shape must account for exactly its bytes. A test checks it
#: against the installed torch's dtypes (tests/project/test_torch_private.py).
ITEMSIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "bcomplex32": 4,  # torch 2.14
    "qint8": 1,
    "quint8": 1,
    "qint32": 4,
    "quint4x2": 1,
    "quint2x4": 1,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    "bits8": 1,
    "bits16": 2,
    "float8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2fnuz": 1,
    "float8_e4m3fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    **{f"uint{n}": 1 for n in range(1, 8)},
    **{f"int{n}": 1 for n in range(1, 8)},
}


#: How deeply a stored value may nest (dicts, lists, tuples, sets): decoding and encoding recurse.
MAX_VALUE_DEPTH = 100


#: No tensor of a checkpoint has this many elements (torch's strides are int64).
_MAX_ELEMENTS = 1 << 62


def addressable(size: list[int]) -> bool:
    """Whether torch can make a tensor of ``size`` (an empty one's other dimensions count too: torch
    computes its strides)."""
    return (math.prod(size) if 0 not in size else math.prod(d for d in size if d)) < _MAX_ELEMENTS


def whole_chunk(size: list[int], flat: Any) -> bool:
    """Whether a flat chunk list (``metadata_to_json``) is one chunk that is the whole tensor of ``size``
    (at least one dimension): most tensors of most checkpoints."""
    ndim = len(size)
    return bool(ndim) and type(flat) is list and len(flat) == 2 * ndim and flat[ndim:] == size and not any(flat[:ndim])


#: Primes below 2**31 (a product of two residues fits in 64 bits): the weighted count of a layout that
#: is not a grid is taken modulo each (see ``_weighted_cover``).
_PRIMES = (2_147_483_647, 2_147_483_629, 2_147_483_587, 2_147_483_579)


def covers_once(size: Sequence[int], chunks: np.ndarray) -> bool:
    """Whether ``chunks`` (m x 2·ndim int64: offsets, then sizes; each already inside ``size``) cover
    every element of a tensor of ``size`` exactly once: a reader plans one read per chunk and reads
    nothing where they leave a gap, so a gap is memory nobody wrote and an overlap is read twice.

    The cost is bounded by the chunk list, never by the tensor's elements (a size may declare 2**60):
    a sort of the chunks' boundaries per dimension. A sharded tensor's chunks form a grid (each chunk one
    cell of the grid their boundaries make): then distinct cells adding up to the tensor is the whole
    check; one dimension is a sort; other layouts get ``_weighted_cover``."""
    ndim = len(size)
    if ndim == 0:
        return len(chunks) == 1
    offsets, sizes = chunks[:, :ndim], chunks[:, ndim:]
    if not all(size):
        return True  # no elements: nothing to read, nothing left unread
    volume = np.prod(sizes.astype(np.float64), axis=1)
    if float(volume.sum()) >= 2.0**62 or int(np.prod(sizes, axis=1).sum()) != math.prod(size):
        return False
    keep = volume > 0
    offsets, ends = offsets[keep], offsets[keep] + sizes[keep]
    m = len(offsets)
    if m <= 1:
        return True
    one_cell = True
    for d in range(ndim):
        bounds = np.unique(np.concatenate([offsets[:, d], ends[:, d]]))
        one_cell = one_cell and bool(
            np.all(np.searchsorted(bounds, ends[:, d]) - np.searchsorted(bounds, offsets[:, d]) == 1)
        )
    if one_cell:  # each chunk is one cell: they overlap only if two are the same cell
        return len(np.unique(offsets, axis=0)) == m
    if ndim == 1:
        order = np.argsort(offsets[:, 0], kind="stable")
        return bool(np.all(offsets[order][1:, 0] >= ends[order][:-1, 0]))
    return _weighted_cover(size, offsets, ends)


def _weighted_cover(size: Sequence[int], offsets: np.ndarray, ends: np.ndarray) -> bool:
    """Whether the boxes [offsets, ends) (inside ``size``, none empty) cover it exactly once, for a layout
    that is not a grid, in O(m·ndim) after one sort per dimension (pairs of boxes would be O(m²)).

    The boundaries of the boxes cut each dimension into intervals, and the tensor into cells. Each
    interval gets a weight, a box the product over its dimensions of the weights it spans (a prefix sum),
    which is the sum over the cells it covers of the products of their intervals' weights. So the boxes'
    weights add up to the tensor's exactly when sum over the cells of (times covered - 1) x (the cell's
    product) is 0: a polynomial in the weights that is not the zero polynomial unless every cell is
    covered once (its coefficients are below every prime: m < 2**31). Modulo a prime p, weights drawn
    uniformly make a non-zero polynomial of degree ndim vanish with probability at most ndim / p
    (Schwartz-Zippel): with four primes below 2**31 and ndim <= 64, below 2**-100. The weights are drawn
    from a hash of the chunk list, so the answer is the same for every reader of one manifest (verify
    and load agree), and a chunk list cannot be chosen against weights it determines short of about
    2**100 tries."""
    m, ndim = offsets.shape
    if m >= _PRIMES[-1]:
        return False  # more chunks than a coefficient may count (no manifest holds 2**31 chunks of one tensor)
    digest = hashlib.sha256(np.asarray(size, dtype=np.int64).tobytes() + offsets.tobytes() + ends.tobytes())
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest.digest(), "little")))
    cuts = []
    for d in range(ndim):
        bounds = np.unique(np.concatenate([offsets[:, d], ends[:, d], np.array([0, size[d]], dtype=np.int64)]))
        cuts.append((len(bounds) - 1, np.searchsorted(bounds, offsets[:, d]), np.searchsorted(bounds, ends[:, d])))
    for p in _PRIMES:
        whole = 1
        weight = np.ones(m, dtype=np.uint64)
        for intervals, lo, hi in cuts:
            prefix = np.zeros(intervals + 1, dtype=np.uint64)  # each < 2**31, at most 2m + 1: sums fit
            np.cumsum(rng.integers(1, p, size=intervals, dtype=np.uint64), out=prefix[1:])
            prefix %= np.uint64(p)
            weight = weight * ((prefix[hi] + np.uint64(p) - prefix[lo]) % np.uint64(p)) % np.uint64(p)
            whole = whole * int(prefix[-1]) % p
        if int(weight.sum(dtype=np.uint64)) % p != whole:
            return False
    return True
