"""Verify accepts a tensor's chunk list exactly when a load reads every element of it exactly once.

Generated chunk lists of a real checkpoint's tensors (grid and guillotine tilings, a pinwheel that is
neither, each maybe with a chunk moved, grown, shrunk, repeated or dropped, or boxes drawn at random),
written into step 2's manifest with one item row per chunk (checksums recomputed), then judged three
ways: the element counts of the layout itself (numpy), ``verify``, and a load of step 2 (which reads
each row's bytes as its chunk: the values move with the layout, so only success is compared). The one
manifest check (protocol/validate.py) is what both commands run."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptguard import Checkpointer, CheckpointError
from ckptguard.protocol.layout import CheckpointName
from ckptguard.verify import verify_checkpoint

from tests.fuzz.harness import base_state, fresh_copy, kept_until_exit, make_base, scratch
from tests.fuzz.strategies import rewrite_chunks

Chunk = tuple[tuple[int, ...], tuple[int, ...]]
_SHAPES = {"w": (8,), "x": (4, 4)}
#: Five rectangles tiling 4 x 4 whose boundaries make no grid (no chunk is one cell of it).
_PINWHEEL: list[Chunk] = [((0, 0), (3, 1)), ((3, 0), (1, 3)), ((1, 3), (3, 1)), ((0, 1), (1, 3)), ((1, 1), (2, 2))]


@functools.cache
def _base() -> Path:
    return make_base(kept_until_exit("ckptguard-tiling-") / "base")


@st.composite
def _guillotine(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Chunk]:
    """A tiling: the tensor cut in two along a dimension, each part cut again or kept (up to 4 deep)."""

    def cut(off: tuple[int, ...], size: tuple[int, ...], depth: int) -> list[Chunk]:
        dims = [d for d, n in enumerate(size) if n > 1]
        if not depth or not dims or not draw(st.booleans()):
            return [(off, size)]
        d = draw(st.sampled_from(dims))
        c = draw(st.integers(1, size[d] - 1))
        first = (*size[:d], c, *size[d + 1 :])
        second_off = (*off[:d], off[d] + c, *off[d + 1 :])
        second = (*size[:d], size[d] - c, *size[d + 1 :])
        return cut(off, first, depth - 1) + cut(second_off, second, depth - 1)

    return cut((0,) * len(shape), shape, 4)


@st.composite
def _boxes(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Chunk]:
    """Boxes anywhere inside the tensor, empty ones included."""
    out = []
    for _ in range(draw(st.integers(1, 6))):
        off = tuple(draw(st.integers(0, n - 1)) for n in shape)
        out.append((off, tuple(draw(st.integers(0, n - o)) for n, o in zip(shape, off, strict=True))))
    return out


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[str, list[Chunk]]:
    fqn = draw(st.sampled_from(sorted(_SHAPES)))
    shape = _SHAPES[fqn]
    starts = [_guillotine(shape), _boxes(shape)] + ([st.just(list(_PINWHEEL))] if shape == (4, 4) else [])
    chunks = list(draw(st.one_of(starts)))
    how = draw(st.sampled_from(["as is", "as is", "move", "grow", "shrink", "repeat", "drop"]))
    i, d = draw(st.integers(0, len(chunks) - 1)), draw(st.integers(0, len(shape) - 1))
    (off, size), step = chunks[i], draw(st.sampled_from([-1, 1]))
    if how == "move" and off[d] + step >= 0 and off[d] + step + size[d] <= shape[d]:
        chunks[i] = ((*off[:d], off[d] + step, *off[d + 1 :]), size)
    elif how in ("grow", "shrink") and size[d] + step >= 0 and off[d] + size[d] + step <= shape[d]:
        chunks[i] = (off, (*size[:d], size[d] + step, *size[d + 1 :]))
    elif how == "repeat":
        chunks.append(chunks[i])
    elif how == "drop" and len(chunks) > 1:
        chunks.pop(i)
    return fqn, chunks


def _read_once(shape: tuple[int, ...], chunks: list[Chunk]) -> bool:
    """Whether reading each chunk once reads every element exactly once (by counting them)."""
    counts = np.zeros(shape, dtype=np.int64)
    for off, size in chunks:
        counts[tuple(slice(o, o + n) for o, n in zip(off, size, strict=True))] += 1
    return bool(np.all(counts == 1))


def test_the_pinwheel_is_no_grid_and_tiles() -> None:
    """The layout the grid check cannot decide is in the strategy, and is a tiling."""
    assert _read_once((4, 4), _PINWHEEL)
    bounds = {o[0] for o, _ in _PINWHEEL} | {o[0] + s[0] for o, s in _PINWHEEL}
    assert any(len([b for b in bounds if o[0] < b < o[0] + s[0]]) for o, s in _PINWHEEL)


@settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(_layouts())
def test_verify_accepts_a_chunk_list_iff_load_reads_every_element_once(layout: tuple[str, list[Chunk]]) -> None:
    fqn, chunks = layout
    once = _read_once(_SHAPES[fqn], chunks)
    with scratch("ckptguard-tiling-ex-") as where:
        root = fresh_copy(_base(), where / "root")
        rewrite_chunks(root, 2, fqn, chunks)
        intact = verify_checkpoint(str(root), CheckpointName(2)).intact
        state = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in base_state().items()}
        try:
            with Checkpointer(root, read_only=True) as ck, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loaded = ck.load(state, step=2)
        except CheckpointError:
            loaded = None
    assert intact == once, (chunks, intact)
    assert (loaded == 2) == once, (chunks, loaded)


def test_a_tensor_of_2_to_the_60_elements_is_judged_by_its_chunks_not_its_elements() -> None:
    """A declared size is never allocated: a layout that is no grid, over 2**60 elements, in a moment."""
    from ckptguard.dcp.records import covers_once

    n = 1 << 30
    pinwheel = [((o[0] * n // 4, o[1] * n // 4), (s[0] * n // 4, s[1] * n // 4)) for o, s in _PINWHEEL]
    ok = np.array([[*o, *s] for o, s in pinwheel], dtype=np.int64)
    assert covers_once([n, n], ok)
    bad = ok.copy()
    bad[4, 0] += 1  # the centre moved down one row: the same volume, one overlap and one gap
    assert not covers_once([n, n], bad)
    # 20,000 rows each cut at another column (no grid), then the rest of the tensor
    cut = [1 + i % 999 for i in range(20_000)]
    rows = [[i, 0, 1, c] for i, c in enumerate(cut)] + [[i, c, 1, n - c] for i, c in enumerate(cut)]
    many = np.array([*rows, [20_000, 0, n - 20_000, n]], dtype=np.int64)
    assert covers_once([n, n], many)
    many[7, 3] += 1  # row 7's first chunk overlaps its second, row 8's leaves a gap: the same volume
    many[8, 3] -= 1
    assert not covers_once([n, n], many)
