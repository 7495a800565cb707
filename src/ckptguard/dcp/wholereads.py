"""A load's whole plain tensors, planned straight from the manifest's item table.

At the world size and sharding a checkpoint was saved with, most tensors of a load are stored
whole: one item of the template tensor's shape and dtype. Those are matched to their items on the
table's columns (numpy: one pass per column, not one lookup per item) and the reader makes one
read job per item directly, with no DCP ``Metadata``, ``ReadItem`` or plan entry in between (for
a state of many small tensors, that per-item work cost more than the reads). Everything else
(shards, resharding, a world size that changed, casts, objects, DTensor and other tensor
subclasses, 0-dim tensors) is left to DCP's planner, which reads what it always did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import and_, attrgetter, eq, is_, not_
from typing import Any

import numpy as np
import torch

from ckptguard.dcp.codec import dtype_from_name
from ckptguard.dcp.readjob import ReadJob, detached
from ckptguard.dcp.records import StoredItem
from ckptguard.errors import CorruptCheckpointError


@dataclass(frozen=True)
class WholeReads:
    """Names of a load's (flattened) template read whole from their stored items: ``fqns[i]`` into
    ``targets[i]`` from ``items[i]``, each item one chunk at offset zero of the target's shape and dtype."""

    fqns: list[str] = field(default_factory=list)
    targets: list[torch.Tensor] = field(default_factory=list)
    items: list[StoredItem] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.fqns)


def find_whole_reads(obj: Mapping[str, Any], items: Sequence[StoredItem], template: Mapping[str, Any]) -> WholeReads:
    """The plain tensors of ``template`` (a load's flattened state) that the checkpoint holds whole.

    A name qualifies where its template value is a plain ``torch.Tensor`` (not a Parameter or other
    subclass, not on the meta device) and the checkpoint stores exactly one item of that name: a
    tensor chunk at offset zero whose shape and dtype are the template's, listed in DCP's metadata
    (``obj["state_dict"]``, as in :func:`codec.metadata_from_json`) as a tensor of that dtype whose
    one chunk is the whole tensor. The manifest's parse checked that every item row agrees with its
    DCP entry; the entry is compared again here, so a name qualifies only where both halves of the
    manifest say the same.

    Args:
        obj: The manifest's DCP metadata.
        items: The manifest's stored items: an item table (protocol.itemtable) is matched on its
            columns; any other sequence qualifies nothing (everything goes to DCP's planner).
        template: The load's flattened state.

    Returns:
        The qualifying names, their destinations and their stored items, in the template's order.
    """
    table: Any = items
    names: list[str] | None = getattr(items, "names", None)
    entries = obj.get("state_dict")
    if names is None or not isinstance(entries, dict) or not len(table) or not template:
        return WholeReads()
    fqns, values = [], []
    for fqn, value in template.items():
        if type(value) is torch.Tensor:
            fqns.append(fqn)
            values.append(value)
    if not fqns:
        return WholeReads()
    row_of_name = _single_whole_rows(table, len(names))
    index = dict(zip(names, range(len(names)), strict=True))
    name_at = np.fromiter(map(index.get, fqns, repeat(len(names))), np.int64, len(fqns))
    row = np.append(row_of_name, -1)[name_at]  # (len(names): a name the table lacks)
    picked = np.flatnonzero(row >= 0)
    if not len(picked):
        return WholeReads()
    dtypes = _torch_dtypes(table.dtypes)
    stored = table.take(row[picked]).rows()
    chosen = [values[i] for i in picked.tolist()]
    # Per name, C-level passes (map) rather than a Python loop: a state of many small tensors pays
    # this once per tensor. Each comparison is the one a loop would make, on the same objects.
    shapes = list(map(_SHAPE, stored))
    fits = list(map(eq, map(_SHAPE, chosen), shapes))
    fits = list(map(and_, fits, map(is_, map(dtypes.get, map(_DTYPE, stored)), map(_DTYPE, chosen))))
    fits = list(map(and_, fits, map(not_, map(_IS_META, chosen))))
    fqns_stored = list(map(_FQN, stored))
    listed = list(map(_whole_entry, map(entries.get, fqns_stored), map(_DTYPE, stored), shapes))
    out = WholeReads()
    for ok, single, item, value in zip(fits, listed, stored, chosen, strict=True):
        if ok and single:
            out.fqns.append(item.fqn)
            out.targets.append(value)
            out.items.append(item)
    return out


_SHAPE, _DTYPE, _FQN, _IS_META = attrgetter("shape"), attrgetter("dtype"), attrgetter("fqn"), attrgetter("is_meta")


def _whole_entry(e: Any, dtype: str | None, shape: tuple[int, ...]) -> bool:
    """Whether a DCP entry lists a tensor of ``dtype`` whose one chunk is the whole tensor of ``shape``
    (the item's, one dimension or more): else DCP's planner decides."""
    if type(e) is not dict or e.get("type") != "tensor" or e.get("dtype") != dtype:
        return False
    size = list(shape)
    return bool(e.get("size") == size and e.get("chunks") == [0] * len(size) + size)


def in_storage_order(jobs: list[ReadJob], reads: WholeReads) -> list[ReadJob]:
    """``jobs`` and one read job per tensor of ``reads`` (without read items, each checked to fit its
    target), in the order their bytes lie on storage (file, then offset)."""
    out = list(jobs)
    for stored, target in zip(reads.items, reads.targets, strict=True):
        job = ReadJob(stored, [], [detached(target)])
        job.check_fits()
        out.append(job)
    out.sort(key=_FILE_AND_OFFSET)
    return out


#: A job's place on storage.
_FILE_AND_OFFSET = attrgetter("stored.file", "stored.offset")


def _single_whole_rows(table: Any, count: int) -> np.ndarray:
    """Per name index, the row of the one item of that name where it is a tensor chunk of one or more
    dimensions at offset zero; -1 where the name has no such row, or more than one row."""
    n = len(table)
    rows_per_name = np.bincount(table.name, minlength=count)
    first = np.full(count, -1, dtype=np.int64)
    first[table.name[::-1]] = np.arange(n - 1, -1, -1, dtype=np.int64)
    off_ndim = table.offsets_ndim
    tensor = (table.shape_ndim >= 1) & (off_ndim == table.shape_ndim)
    # Rows with any non-zero offset: the row of each offset value, counted where it is non-zero.
    value_row = np.repeat(np.arange(n, dtype=np.int64), np.clip(off_ndim, 0, None))
    if len(value_row) != len(table.offsets):
        raise CorruptCheckpointError("the manifest's item offsets do not match their dimensions")
    at_zero = np.bincount(value_row[table.offsets != 0], minlength=n) == 0
    whole = tensor & at_zero
    single = (rows_per_name == 1) & (first >= 0)
    out = np.full(count, -1, dtype=np.int64)
    out[single] = np.where(whole[first[single]], first[single], -1)
    return out


def _torch_dtypes(names: Sequence[str | None]) -> dict[str | None, torch.dtype]:
    """The torch dtype of each dtype name of the table that torch knows."""
    out: dict[str | None, torch.dtype] = {}
    for name in names:
        if name is None:
            continue
        try:
            out[name] = dtype_from_name(name)
        except CorruptCheckpointError:
            continue  # a dtype this torch lacks: none of its items qualifies
    return out
