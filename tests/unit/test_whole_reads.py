"""Which tensors of a load are read whole straight from the manifest's item table: exactly those
stored as one whole chunk of the template's shape and dtype, with a DCP entry that says the same.
Everything else (a tensor in several chunks, as at another world size or sharding; a chunk not at
offset zero; another shape or dtype; a Parameter or tensor subclass; a 0-dim tensor; an entry that
disagrees with its item) is left to DCP's planner."""

from __future__ import annotations

from typing import Any

import torch

from ckptguard.dcp.records import StoredItem
from ckptguard.dcp.wholereads import find_whole_reads
from ckptguard.protocol.itemtable import ItemTable

FILE = "data/rank00000_0.bin"


def _tensor(fqn: str, offsets: tuple[int, ...], shape: tuple[int, ...], at: int, dtype: str = "float32") -> StoredItem:
    size = 4 if dtype == "float32" else 8
    length = size * int(torch.Size(shape).numel())
    return StoredItem(fqn, offsets, FILE, at, length, f"{at:016x}", dtype, shape)


def _entry(size: list[int], chunks: list[int], dtype: str = "float32") -> dict[str, Any]:
    return {"type": "tensor", "dtype": dtype, "requires_grad": False, "size": size, "chunks": chunks}


def _checkpoint() -> tuple[dict[str, Any], ItemTable]:
    items = [
        _tensor("whole", (0, 0), (2, 3), 0),
        _tensor("also", (0,), (5,), 100),
        _tensor("sharded", (0,), (4,), 200),  # two chunks of one tensor (two ranks wrote it)
        _tensor("sharded", (4,), (4,), 300),
        _tensor("tail", (4,), (4,), 400),  # the second chunk only (another storage domain holds the first)
        _tensor("scalar", (), (), 500),
        _tensor("double", (0,), (3,), 600, "float64"),
        _tensor("bigger", (0,), (3,), 700),  # the entry says the tensor is larger than the item
        _tensor("two_listed", (0,), (6,), 800),  # the entry lists other chunks than the item
        StoredItem("obj", None, FILE, 900, 10, "00" * 8),
    ]
    entries = {
        "whole": _entry([2, 3], [0, 0, 2, 3]),
        "also": _entry([5], [0, 5]),
        "sharded": _entry([8], [0, 4, 4, 4]),
        "tail": _entry([8], [0, 4, 4, 4]),
        "scalar": _entry([], []),
        "double": _entry([3], [0, 3], "float64"),
        "bigger": _entry([4], [0, 4]),
        "two_listed": _entry([6], [0, 3, 3, 3]),
        "obj": {"type": "bytes"},
    }
    return {"state_dict": entries}, ItemTable.from_items(items, [FILE])


def test_only_tensors_stored_whole_as_the_template_has_them_are_read_from_the_item_table() -> None:
    dcp, table = _checkpoint()
    template: dict[str, Any] = {
        "whole": torch.zeros(2, 3),
        "also": torch.zeros(10)[::2],  # a view: still whole (the reader copies into it)
        "sharded": torch.zeros(8),
        "tail": torch.zeros(8),
        "scalar": torch.tensor(0.0),
        "double": torch.zeros(3, dtype=torch.float32),  # a widening cast: DCP's planner casts
        "bigger": torch.zeros(3),
        "two_listed": torch.zeros(6),
        "obj": torch.zeros(1),  # a tensor where an object is stored: refused by DCP's planner
        "missing": torch.zeros(2),  # not in the checkpoint: refused (strict) or left alone by DCP's planner
    }
    reads = find_whole_reads(dcp, table, template)
    assert reads.fqns == ["whole", "also"]
    assert [t is template[n] for n, t in zip(reads.fqns, reads.targets, strict=True)] == [True, True]
    assert [i.offset for i in reads.items] == [0, 100]


def test_parameters_subclasses_and_other_shapes_or_dtypes_are_left_to_dcp() -> None:
    dcp, table = _checkpoint()
    for value in (
        torch.nn.Parameter(torch.zeros(2, 3)),
        torch.zeros(3, 2),
        torch.zeros(6),
        torch.zeros(2, 3, dtype=torch.float64),
        torch.zeros(2, 3, device="meta"),
    ):
        assert not find_whole_reads(dcp, table, {"whole": value}), value


def test_a_plain_list_of_items_or_an_empty_template_plans_nothing_whole() -> None:
    dcp, table = _checkpoint()
    assert not find_whole_reads(dcp, list(table), {"whole": torch.zeros(2, 3)})
    assert not find_whole_reads(dcp, table, {})
    assert not find_whole_reads({}, table, {"whole": torch.zeros(2, 3)})
