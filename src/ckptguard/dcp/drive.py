"""dcp.save's and dcp.load's planning, driven by ckptguard's own agreement steps.

dcp.save and dcp.load run collectives of their own (gather the local plans,
scatter the global ones, gather the write results, broadcast the metadata).
The commit needs less, and every agreement must go through ``Comm.step`` so
that a failure on any rank reaches every rank; the planner calls here are
dcp's, in dcp's order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from ckptguard.comm import Comm
from ckptguard.dcp.planners import DomainSavePlanner, SafeLoadPlanner
from ckptguard.dcp.reader import GuardedReader
from ckptguard.dcp.wholereads import WholeReads
from ckptguard.dcp.writer import GuardedWriter


def read_locally(
    state_dict: dict[str, Any],
    reader: GuardedReader,
    planner: DefaultLoadPlanner,
    is_coordinator: bool,
    stats: Any = None,
    before_read: Callable[[], None] | None = None,
    metadata_for: Callable[[Collection[str]], Metadata] | None = None,
    whole_reads_for: Callable[[dict[str, Any]], WholeReads] | None = None,
) -> None:
    """dcp.load's planning and reading, without its two collectives.

    dcp.load gathers every rank's load plan on the coordinator and scatters them
    back, but its default global load plan changes nothing: for 10,000 tensors
    per rank that round trip of pickled plans cost more than the reads. Every
    rank here plans (DCP's planner: resharding included) and reads on its own;
    the caller agrees on the outcome. ``before_read`` runs once the plan is made. ``metadata_for``:
    the checkpoint's metadata for the names of the planner's (flattened) state, instead of the
    reader's metadata of every name. ``whole_reads_for``: the names of the planner's state that a
    SafeLoadPlanner reads whole from their stored items, without DCP's metadata or plan
    (wholereads.find_whole_reads); the metadata is then built for the other names only.
    """
    with stats.phase("plan") if stats is not None else contextlib.nullcontext():
        planner.set_up_planner(state_dict, reader.metadata, is_coordinator)
        names: Collection[str] = planner.state_dict.keys()
        if whole_reads_for is not None and isinstance(planner, SafeLoadPlanner):
            whole = whole_reads_for(planner.state_dict)
            planner.read_whole(whole)
            if whole:
                planned = set(whole.fqns)
                names = [k for k in names if k not in planned]
        metadata = metadata_for(names) if metadata_for is not None else reader.metadata
        assert metadata is not None
        planner.metadata = metadata
        reader.set_up_storage_reader(metadata, is_coordinator)
        plan = reader.prepare_local_plan(planner.create_local_plan())
        plan = planner.finish_plan(plan)
    if before_read is not None:
        before_read()
    with stats.phase("read") if stats is not None else contextlib.nullcontext():
        reader.read_data(plan, planner).wait()


def plan_collectively(
    state_dict: dict[str, Any],
    writer: GuardedWriter[Any],
    planner: DomainSavePlanner,
    comm: Comm,
    what: str,
    suffix: str = "",
) -> None:
    """DCP's save planning (deduplication, global metadata, plan caching), with our collectives.

    dcp.save also gathers every rank's write results and broadcasts the global
    metadata back to every rank after writing; the commit needs the results on
    rank 0 only, and no rank needs the metadata but rank 0. For 20,000 tensors
    that broadcast alone cost ~0.2 s per save. The planner calls are dcp.save's,
    in its order. Afterwards ``writer.plan`` is this rank's part, and on rank 0
    ``writer.metadata`` the checkpoint's metadata.
    """

    def local_plan() -> SavePlan:
        planner.set_up_planner(state_dict=state_dict, storage_meta=None, is_coordinator=comm.rank == 0)
        writer.set_up_storage_writer(comm.rank == 0)
        return writer.prepare_local_plan(planner.create_local_plan())

    def global_plan(local_plans: list[SavePlan]) -> list[SavePlan]:
        global_plans, metadata = planner.create_global_plan(local_plans)
        writer.metadata = metadata  # rank 0 only: the commit needs it there and nowhere else
        return writer.prepare_global_plan(global_plans)

    writer.plan = comm.step(what, local_plan, global_plan, scatter=True, suffix=suffix)
