"""The load's pure decisions: whether a destination's reads overlap (checked against every element), and
the verified-bytes budget."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ckptguard.dcp import loadmemory
from ckptguard.dcp.coverage import _boxes_overlap

SHAPE = (6, 5)


def _read(offsets: tuple[int, int], lengths: tuple[int, int]) -> ReadItem:
    index = MetadataIndex("w", torch.Size(offsets))
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=index,
        dest_offsets=torch.Size(offsets),
        storage_index=index,
        storage_offsets=torch.Size((0, 0)),
        lengths=torch.Size(lengths),
    )


boxes = st.lists(
    st.tuples(st.integers(0, SHAPE[0] - 1), st.integers(0, SHAPE[1] - 1), st.integers(0, 3), st.integers(0, 3)),
    min_size=1,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(boxes)
def test_boxes_overlap_exactly_when_two_reads_write_one_element(spec: list[tuple[int, int, int, int]]) -> None:
    reads = [_read((r, c), (h, w)) for r, c, h, w in spec]
    cells = [{(r + i, c + j) for i in range(h) for j in range(w)} for r, c, h, w in spec]
    expected = any(a & b for a, b in itertools.combinations(cells, 2))
    assert _boxes_overlap(reads) == expected


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 5)), min_size=1, max_size=20))
def test_one_dimensional_reads_overlap_exactly_when_two_share_an_element(spec: list[tuple[int, int]]) -> None:
    reads = [
        ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex("v", torch.Size((o,))),
            dest_offsets=torch.Size((o,)),
            storage_index=MetadataIndex("v", torch.Size((o,))),
            storage_offsets=torch.Size((0,)),
            lengths=torch.Size((n,)),
        )
        for o, n in spec
    ]
    cells = [set(range(o, o + n)) for o, n in spec]
    assert _boxes_overlap(reads) == any(a & b for a, b in itertools.combinations(cells, 2))


def test_a_given_budget_is_kept_and_the_default_follows_the_page_cache() -> None:
    assert loadmemory.load_budget(123, 1 << 40, 8) == 123
    assert loadmemory.load_budget(None, 1, 1) in (0, loadmemory.POSIX_MEMORY_BYTES)
    assert loadmemory.load_budget(None, 1 << 60, 1) == loadmemory.POSIX_MEMORY_BYTES  # never fits the cache
    assert 0 < loadmemory.auto_memory_bytes(8) <= loadmemory.auto_memory_bytes(1)
