"""DCP's save planner for ckptguard: replicated tensors once per storage domain, per-rank values caught,
plans cached across saves of the same structure. The load planner is in ``loadplanner.py``.
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    SavePlan,
    WriteItem,
    WriteItemType,
)

from ckptguard.checksum import checksum
from ckptguard.dcp import _torch_private
from ckptguard.dcp.codec import tensor_bytes

# The load side lives in loadplanner.py; these names stay importable from here.
from ckptguard.dcp.loadplanner import SafeLoadPlanner, decode_object, refuse_mismatches, widens
from ckptguard.dcp.records import StoredItem
from ckptguard.dcp.values import PLAIN_TENSOR_TYPES, flat_collision_error, is_per_rank_key
from ckptguard.errors import ReplicatedValueError

__all__ = [
    "DomainSavePlanner",
    "SafeLoadPlanner",
    "combined_digest",
    "decode_object",
    "divergence_message",
    "forget_cached_plans",
    "plan_cache_key",
    "plan_divergence_message",
    "ranks_differing",
    "refuse_mismatches",
    "replicated_digests",
    "widens",
]


class DomainSavePlanner(_torch_private.CachingSavePlanner):
    """DCP's planner, with replicated tensors written once per storage domain, not once per job.

    DCP deduplicates replicated tensors across all ranks, which assumes one
    shared filesystem. With node-local disks each domain must hold its own copy,
    or a node could not load the replicated parameters (DDP) from its own disk.
    """

    def __init__(self, domain_of_rank: Sequence[int], cache_key: str, rank: int = 0) -> None:
        # DCP's plan caching: when no rank's plan changed since the last save (the usual case:
        # same model, same shapes), ranks send empty plans and the coordinator reuses the global
        # plan. The cache is class-level in DCP; the key keeps Checkpointers (and their storage
        # domains, which shape the global plan) apart.
        super().__init__(plan_cache_key(cache_key, rank))
        self.domain_of_rank = list(domain_of_rank)

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        """DCP's set-up; for a state of plain tensors and objects, one walk instead of DCP's two, and
        the last save's local plan taken up again when the state's structure is the same."""
        self._structure: list[tuple[Any, ...]] | None = None
        self._reusable: SavePlan | None = None
        try:
            flat, mappings = _torch_private.flatten_state_dict(state_dict)
        except ValueError as e:  # two values of one DCP name: the same refusal on every rank
            raise flat_collision_error(e) from None
        structure = _save_structure(flat, is_coordinator)
        if structure is None:  # DTensor, ShardedTensor or another value DCP plans itself
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        self.set_up_flat(flat, mappings, is_coordinator)
        self._structure = structure
        last = _LAST_LOCAL_PLANS.get(self.cache_key)
        if last is not None and last.structure == structure and last.mappings == mappings:
            self._reusable = last.plan

    def create_local_plan(self) -> SavePlan:
        # DCP builds a fresh local plan every save (a write item per tensor) to compare it with the
        # one it cached: a fifth of a save of many small tensors. A plan built for the same structure
        # (names, nesting, dtypes, shapes, requires_grad, pinning) is the same plan; it is taken up
        # again only while it is still the one DCP holds for this key, i.e. the last save finished
        # its plan with it and nothing dropped DCP's cache since.
        reusable = self._reusable
        if reusable is not None and _torch_private.cached_local_plan(self.cache_key) is reusable:
            self.plan = reusable
            self.local_plan = reusable
            return SavePlan([], usable=False)
        sent = super().create_local_plan()
        self.local_plan = self.plan  # the full plan, even when caching sends an empty one
        if self._structure is not None:
            held = self.plan if sent.usable else _torch_private.cached_local_plan(self.cache_key)
            if held is not None:
                _LAST_LOCAL_PLANS[self.cache_key] = _LocalPlan(self._structure, self.mappings, held)
        return sent

    def lookup_object(self, index: MetadataIndex) -> Any:
        """A whole plain tensor without DCP's general lookup (which looks for shards first)."""
        obj = self.state_dict.get(index.fqn)
        if type(obj) in PLAIN_TENSOR_TYPES and (index.offset is None or not any(index.offset)):
            return obj
        return super().lookup_object(index)

    def replicated_digests(self, written: Sequence[StoredItem] = (), algorithm: str = "") -> dict[str, str]:
        """See replicated_digests(); computed from this rank's plan before deduplication. Nothing to
        compare in a job of one rank. ``written``: what this rank stored with checksum ``algorithm``,
        whose xxh3-64 digests are reused instead of hashing those bytes again."""
        if len(self.domain_of_rank) <= 1:
            return {}
        known = {i.fqn: i.checksum for i in written if i.dtype is not None} if algorithm == "xxh3-64" else {}
        return replicated_digests(self.local_plan, self.state_dict, known)

    def check_local_plans(self, all_plans: list[SavePlan]) -> None:
        message = plan_divergence_message(all_plans)
        if message is not None:
            raise ReplicatedValueError(message)

    def adjust_global_plan(
        self, all_plans: list[SavePlan], global_plan: list[SavePlan], metadata: Metadata
    ) -> tuple[list[SavePlan], Metadata]:
        if len(set(self.domain_of_rank)) <= 1:
            return global_plan, metadata
        canonical: dict[MetadataIndex, tuple[int, WriteItem]] = {}
        for rank, plan in enumerate(global_plan):
            for item in plan.items:
                canonical[item.index] = (rank, item)
        extra: dict[int, list[WriteItem]] = defaultdict(list)
        covered: set[tuple[MetadataIndex, int]] = {(i, self.domain_of_rank[r]) for i, (r, _) in canonical.items()}
        for rank, plan in enumerate(all_plans):
            dom = self.domain_of_rank[rank]
            for item in plan.items:
                key = (item.index, dom)
                if key not in covered:
                    covered.add(key)
                    extra[rank].append(canonical[item.index][1])
        global_plan = [replace(p, items=p.items + extra[r]) if extra.get(r) else p for r, p in enumerate(global_plan)]
        return global_plan, metadata


@dataclass(frozen=True)
class _LocalPlan:
    """A local save plan and what it was built for."""

    structure: list[tuple[Any, ...]]
    mappings: dict[str, Any]
    plan: SavePlan


#: The last local save plan of each Checkpointer, by its DCP cache key: one entry per open Checkpointer.
_LAST_LOCAL_PLANS: dict[str, _LocalPlan] = {}


def _save_structure(flat: Mapping[str, Any], is_coordinator: bool) -> list[tuple[Any, ...]] | None:
    """Everything DCP's local save plan of ``flat`` depends on, in order (a write item per value: its
    name, and for a tensor what ``TensorProperties.create_from_tensor`` and the chunk take from it);
    None if a value is planned by rules of its own (a tensor subclass such as DTensor or
    ShardedTensor, an object with ``__create_write_items__``)."""
    structure: list[tuple[Any, ...]] = [(is_coordinator,)]
    for fqn, value in flat.items():
        kind = type(value)
        if kind in PLAIN_TENSOR_TYPES:
            structure.append((fqn, value.dtype, value.shape, value.requires_grad, value.layout, value.is_pinned()))
        elif isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
            return None
        else:
            structure.append((fqn,))
    return structure


def plan_cache_key(instance: str, rank: int) -> str:
    """One Checkpointer's key in DCP's class-level caches, on one rank. The same on that rank from save
    to save (a key that changed on one rank sent the coordinator to an empty cache while another rank
    sent it an empty plan); the rank in it keeps apart ranks that share a process (threads), whose
    local plans DCP would otherwise cache under one key."""
    return f"{_cache_key_prefix(instance)}{rank}"


def _cache_key_prefix(instance: str) -> str:
    """What every rank's key of one Checkpointer starts with."""
    return f"ckptguard:{instance}@"


def forget_cached_plans(instance: str) -> None:
    """Drop DCP's class-level cached plans of one Checkpointer on every rank of this process, and what
    was derived from them (after a failed save, and at close)."""
    prefix = _cache_key_prefix(instance)
    for key in list(_LAST_LOCAL_PLANS):  # a copy taken at once: ranks that are threads forget together
        if key.startswith(prefix):
            _LAST_LOCAL_PLANS.pop(key, None)
    _torch_private.forget_cached_plans(prefix)


def replicated_digests(
    plan: SavePlan, state_dict: dict[str, Any], known: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Checksums of this rank's non-sharded values (every size), to catch values that differ across ranks.

    DCP treats every plain tensor and object as replicated and keeps one rank's
    copy: a per-rank value (an RNG state, a data-loader position, a buffer of
    any size) saved that way silently comes back as another rank's. ``known``:
    xxh3-64 digests of whole tensors already computed (by the write).
    """
    out: dict[str, str] = {}
    known = known or {}
    for item in plan.items:
        if item.type == WriteItemType.SHARD or is_per_rank_key(item.index.fqn):
            continue
        fqn = item.index.fqn
        obj = state_dict.get(fqn)
        if isinstance(obj, torch.Tensor):
            if type(obj) is torch.Tensor and fqn in known:
                out[fqn] = known[fqn]
            elif type(obj) is torch.Tensor:
                mv, _ = tensor_bytes(obj)
                out[fqn] = checksum("xxh3-64", mv)
        elif item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(obj, buf)
            out[fqn] = checksum("xxh3-64", buf.getbuffer())
    return out


def plan_divergence_message(all_plans: Sequence[SavePlan]) -> str | None:
    """The first plain value whose kind, shape, dtype or place in the nesting differs between the ranks'
    local plans; None if none. Their bytes are compared after the write (replicated_digests), but
    the same bytes can be another shape or dtype, and DCP keeps one rank's plan of a plain value
    for all: the others would load that rank's shape, dtype and nesting (or DCP fails on them)."""
    first: dict[str, tuple[int, tuple[Any, ...]]] = {}
    for rank, plan in enumerate(all_plans):
        paths = plan.planner_data if isinstance(plan.planner_data, dict) else {}
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.SHARD or is_per_rank_key(fqn):
                continue
            data = item.tensor_data
            kind = (None, None) if data is None else (list(data.size), data.properties.dtype)
            signature = (item.type, *kind, paths.get(fqn))
            seen = first.setdefault(fqn, (rank, signature))
            if seen[1] != signature:
                nesting = seen[1][3] != signature[3]
                return (
                    f"{fqn!r} is {_described(seen[1], nesting)} on rank {seen[0]} but "
                    f"{_described(signature, nesting)} on rank "
                    f"{rank}. It is a plain value, which DCP stores once for all ranks: every rank would load "
                    f"rank {seen[0]}'s. Wrap per-rank state in ckptguard.PerRank(...), or give it the same "
                    "shape, dtype and nesting on every rank."
                )
    return None


def _described(signature: tuple[Any, ...], nesting: bool) -> str:
    kind, size, dtype, path = signature
    where = f" nested as {list(path)}" if nesting and path is not None else ""
    if kind == WriteItemType.BYTE_IO:
        return f"an object{where}"
    return f"a tensor of shape {size} {str(dtype).removeprefix('torch.')}{where}"


def combined_digest(digests: dict[str, str]) -> str:
    """One digest over all of a rank's plain values: what travels to rank 0 (16 bytes per rank)."""
    text = "\n".join(f"{fqn}\0{d}" for fqn, d in sorted(digests.items()))
    return checksum("xxh3-64", text.encode())


def ranks_differing(combined: list[str]) -> list[int]:
    """Rank 0: the ranks whose plain values (or their names) differ from rank 0's (linear in the ranks)."""
    return [rank for rank, digest in enumerate(combined) if digest != combined[0]]


def divergence_message(reports: list[tuple[int, dict[str, str]]]) -> str | None:
    """The first plain value, present on several ranks, whose bytes differ between them; None if none.

    Values present on one rank only are not compared (DCP stores them from that rank).
    """
    first: dict[str, tuple[int, str]] = {}
    for rank, mine in sorted(reports):
        for fqn, digest in mine.items():
            seen = first.setdefault(fqn, (rank, digest))
            if seen[1] != digest:
                return (
                    f"{fqn!r} differs between rank {seen[0]} and rank {rank}, but it is a plain value, which "
                    f"DCP stores once for all ranks: every rank would load rank {seen[0]}'s copy. Wrap "
                    "per-rank state in ckptguard.PerRank(...) (e.g. RNG states, data loader positions), or "
                    "make it identical on every rank."
                )
    return None
