"""A load's reads must cover every element of every destination exactly once.

DCP plans a destination's reads from the chunks the metadata lists and reads nothing where they leave a
gap: a manifest whose chunk list disagrees with what it stores (corrupt, or re-sealed by hand) would load
part of a tensor, or give back uninitialised memory, and succeed. A whole tensor the planner planned
directly is covered by construction.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.tensor import DTensor

from ckptguard.dcp.loadplanner import ReaderPlanner
from ckptguard.dcp.values import PLAIN_TENSOR_TYPES
from ckptguard.errors import CorruptCheckpointError


def check_coverage(
    plan: LoadPlan, planner: ReaderPlanner, metadata: Metadata | None, rank: int, checkpoint_dir: str
) -> None:
    """Raise unless every element of every destination the checkpoint holds a value for is read once.

    Args:
        plan: This rank's load plan.
        planner: Its planner (the template, and the tensors it planned directly).
        metadata: DCP's metadata the plan was made from (None: nothing stored to check against).
        rank: This rank, for the message.
        checkpoint_dir: The checkpoint's data directory, for the message.

    Raises:
        CorruptCheckpointError: A destination's reads leave a gap or overlap (nothing was changed).
    """
    direct = planner.direct_targets()
    reads: dict[str, list[ReadItem]] = defaultdict(list)
    for req in plan.items:
        if req.type != LoadItemType.BYTE_IO and id(req) not in direct:
            reads[req.dest_index.fqn].append(req)
    whole = {entry.read.dest_index.fqn for entry in direct.values()}
    stored: Mapping[str, Any] = metadata.state_dict_metadata if metadata is not None else {}
    for fqn, value in planner.template().items():
        if fqn in whole or fqn not in stored or not isinstance(value, torch.Tensor):
            continue
        local = _local_tensor(value)
        if local is None:
            continue
        got = reads.get(fqn, [])
        covered = sum(math.prod(r.lengths) for r in got)
        if covered != local.numel() or (len(got) > 1 and _boxes_overlap(got)):
            raise CorruptCheckpointError(
                f"rank {rank}: the checkpoint's metadata in {checkpoint_dir} does not cover "
                f"{fqn} exactly once ({covered} of its {local.numel()} elements on this rank, from "
                f"{len(got)} chunk(s)): its chunk list disagrees with what it stores; the manifest is "
                "corrupt. Nothing was changed",
                path=checkpoint_dir,
            )


def _local_tensor(value: torch.Tensor) -> torch.Tensor | None:
    """The part of a destination this rank holds: a plain tensor, a DTensor's local shard; None for
    other kinds (DCP's own planning handles them)."""
    if type(value) in PLAIN_TENSOR_TYPES:
        return value
    if isinstance(value, DTensor):
        local: torch.Tensor = value.to_local()
        return local
    return None


def _boxes_overlap(reads: list[ReadItem]) -> bool:
    """Whether two of these reads write one element of their destination (boxes of dest_offsets and
    lengths; a read of no element overlaps nothing)."""
    lo = np.array([list(r.dest_offsets) for r in reads], dtype=np.int64).reshape(len(reads), -1)
    hi = lo + np.array([list(r.lengths) for r in reads], dtype=np.int64).reshape(len(reads), -1)
    keep = (hi > lo).all(axis=1)
    lo, hi = lo[keep], hi[keep]
    if lo.shape[1] == 1:  # one dimension: sorted, each ends where or before the next starts
        order = np.argsort(lo[:, 0], kind="stable")
        return bool((lo[order[1:], 0] < hi[order[:-1], 0]).any())
    for start in range(0, len(lo), 256):  # pairs, a block of rows at a time
        a_lo, a_hi = lo[start : start + 256, None, :], hi[start : start + 256, None, :]
        meet = (np.maximum(a_lo, lo[None]) < np.minimum(a_hi, hi[None])).all(axis=2)
        meet[np.arange(len(a_lo)), np.arange(start, start + len(a_lo))] = False
        if meet.any():
            return True
    return False
