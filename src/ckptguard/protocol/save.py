"""One save, phase by phase; every phase a local action followed by an agreement (``Comm.step``).

    plan      leaders read their root (lease, existing versions); rank 0 decides
              the attempt name, the version and checks that no two ranks' paths
              collide: nothing is written before this is agreed
    stage     leaders create a fresh attempt directory in .ckptguard/staging
    write     every rank writes and syncs its part (DCP plans, our writer does I/O)
    commit    rank 0 builds one manifest per storage domain; each leader writes
              the manifest while it checks every file visible with its size, then
              publishes the attempt and syncs the parent
    finish    once every domain has published: `latest` moves, retention and
              clean-up of leftovers run, by leaders only, each action after a
              check that this job still holds the root's lease

A failure on any rank makes every rank raise at the same step; the previous
checkpoint is untouched and the attempt is removed.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from ckptguard.comm import agreed_failures
from ckptguard.dcp.drive import plan_collectively
from ckptguard.dcp.planners import (
    DomainSavePlanner,
    combined_digest,
    divergence_message,
    forget_cached_plans,
    ranks_differing,
)
from ckptguard.dcp.writer import GuardedWriter
from ckptguard.errors import CheckpointError, LeaseLostError, ReplicatedValueError
from ckptguard.progress import ByteProgress
from ckptguard.protocol import artifacts, layout
from ckptguard.protocol.commit import commit, commit_when_visible, finish
from ckptguard.protocol.decisions import (
    DomainListing,
    LeaderView,
    Listing,
    PlanDecision,
    PlanReport,
    RankWrites,
    agreed_listing,
    build_manifests,
    decide_plan,
)
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import Manifest
from ckptguard.protocol.saveplan import SaveOutcome, SavePlan, SaveRequest, StoredArtifacts, Written
from ckptguard.protocol.session import Options, Session
from ckptguard.protocol.timing import PhaseTimer
from ckptguard.state import state_nbytes

log = logging.getLogger("ckptguard")

__all__ = [
    "SaveOutcome",
    "SavePlan",
    "SaveRequest",
    "StoredArtifacts",
    "Written",
    "agreed_current",
    "commit_when_visible",
    "finish",
    "leader_listing",
    "save",
]


def leader_listing(session: Session) -> DomainListing | None:
    if not session.topo.is_leader:
        return None
    return session.root.listing()


def agreed_current(session: Session) -> Listing:
    """{step: (version, seq)} committed in every storage domain, the newest version every domain has
    (collective)."""
    listing: Listing = session.comm.step(
        f"list the checkpoints in {session.url}", lambda: leader_listing(session), agreed_listing
    )
    return listing


def save(session: Session, request: SaveRequest, stats: PhaseTimer) -> SaveOutcome:
    """The collective part of a save (in the caller's thread, or in the background)."""
    with stats.phase("plan"):
        plan = _plan(session, request)
    with stats.phase("stage"):
        _stage(session, plan)
    try:
        total = state_nbytes(request.state_dict) if stats.show_progress else None  # a walk of the whole state
        with stats.phase("write"), ByteProgress(stats.show_progress, f"saving step {plan.step}", total) as bar:
            written = _write(session, plan, request, bar.callback)
        stats.bytes = sum(f.size for f in written.outcome.files)
        with stats.phase("commit"):
            mine = _agree_writes(session, plan, written, request.user_metadata, request.options)
            return commit(session, plan, mine, request.keep, request.options)
    except BaseException as e:
        if agreed_failures(e):
            # Every rank got the error at the same agreement, so no rank is still writing into the
            # attempt: remove it now, or a disk-full save keeps the disk full. DCP's plan cache may
            # now differ between ranks (some cached, some not): drop it.
            _discard_attempt(session, plan)
            forget_cached_plans(session.instance)
        raise


def _plan(session: Session, request: SaveRequest) -> SavePlan:
    comm, topo = session.comm, session.topo

    def report() -> PlanReport:
        if request.local_error is not None:
            raise request.local_error
        view = None
        if topo.is_leader:
            assert session.lease is not None
            session.lease.check()
            listing = session.root.listing()
            seen = [q for versions in listing.values() for q in versions.values() if q is not None]
            taken = set(listing.get(request.step, {})) | set(session.root.taken_versions(request.step))
            view = LeaderView(
                sorted(taken), listing, max([*seen, session.root.latest_seq()]), session.root.quarantined()
            )
        return PlanReport(request.targets, view, (request.step, request.overwrite))

    decision: PlanDecision = comm.step(
        f"save step {request.step}",
        report,
        lambda reports: decide_plan(session.url, request.step, request.overwrite, reports),
        where=session.url,
    )
    if decision.uncertain:
        artifacts.probe_shared_paths(comm, decision.uncertain, decision.attempt)
    name = CheckpointName(request.step, decision.version)
    return SavePlan(
        request.step,
        name,
        decision.attempt,
        session.root.staging_dir(request.step, decision.attempt),
        request.targets,
        decision.previous,
        decision.seq,
        decision.quarantined,
    )


def _stage(session: Session, plan: SavePlan) -> None:
    def make() -> None:
        if session.topo.is_leader:
            session.root.make_staging(plan.step, plan.attempt)

    session.comm.step(
        f"create the attempt directory for step {plan.step}",
        make,
        suffix=plan.intact,
        where=session.url,
        on_error=session.fenced,
    )


def _write(session: Session, plan: SavePlan, request: SaveRequest, on_bytes: Callable[[int], None] | None) -> Written:
    """Plan (agreed) and write this rank's part; a write failure is reported at the commit's agreement."""
    comm, options, storage = session.comm, request.options, session.storage

    def before_write() -> StoredArtifacts:
        # The leader created the attempt directory; on NFS another node may not see it yet.
        storage.wait_visible(
            os.path.join(plan.staging, layout.DATA_DIR),
            timeout=options.visibility_timeout_s,
            stop_if=session.stop_if_taken_over,
        )
        return artifacts.store(storage, request.file_items, plan.staging, options.checksum)

    writer = GuardedWriter(
        storage,
        plan.staging,
        functools.partial(layout.data_file, comm.rank),
        comm.rank,
        options.checksum,
        options.io_threads,
        before_write,
        error_root=session.url,
        on_bytes=on_bytes,
    )
    planner = DomainSavePlanner(
        [session.topo.domain_of(r) for r in range(comm.world_size)], cache_key=session.instance, rank=comm.rank
    )
    plan_collectively(request.state_dict, writer, planner, comm, suffix=plan.intact, what=f"plan step {plan.step}")
    try:
        outcome = writer.write_planned(planner)
        digests = planner.replicated_digests(list(outcome.stored), options.checksum)
    except BaseException as e:  # reported in the commit's first agreement
        return Written(metadata=writer.metadata, error=e)
    return Written(outcome, digests, writer.metadata)


def _agree_writes(
    session: Session, plan: SavePlan, written: Written, user_metadata: dict[str, Any], options: Options
) -> Manifest | None:
    """Agree that every rank wrote its part (and no plain value differs across ranks); the leader builds
    one manifest per storage domain. Returns this domain's manifest on its leader, None elsewhere."""
    comm, topo = session.comm, session.topo

    def report_written() -> str:
        if written.error is not None:
            raise written.error
        return combined_digest(written.digests)

    # The write phase's agreement; and a plain value that differs across ranks (DCP would keep one
    # rank's copy for all) found from one digest per rank, whatever the values' sizes.
    differing: list[int] = comm.step(
        f"write its part of step {plan.step}",
        report_written,
        ranks_differing,
        suffix=plan.intact,
        where=session.url,
        on_error=session.fenced,
    )
    if differing:
        _refuse_divergence(session, plan, written.digests, differing)

    def manifests(writes: list[RankWrites]) -> list[Manifest | None]:
        md = written.metadata
        assert md is not None
        built = build_manifests(
            topo,
            plan.name,
            plan.attempt,
            options.checksum,
            writes,
            user_metadata,
            session.dcp_json.get(md) or md,
            plan.seq,
        )
        if built:
            session.dcp_json.put(md, next(iter(built.values())).dcp)
        return [built.get(r) for r in range(comm.world_size)]

    mine: Manifest | None = comm.step(
        f"report its part of step {plan.step}",
        written.report,
        manifests,
        scatter=True,
        suffix=plan.intact,
        where=session.url,
    )
    return mine


def _refuse_divergence(session: Session, plan: SavePlan, digests: dict[str, str], differing: list[int]) -> None:
    """Rank 0 and the ranks whose digest differed send their per-value digests; rank 0 names the value
    that differs, or lets the save go on if only the sets of names differ (a value on one rank only)."""
    comm = session.comm
    involved = {0, *differing}

    def mine() -> tuple[int, dict[str, str]] | None:
        return (comm.rank, digests) if comm.rank in involved else None

    def refuse(reports: list[tuple[int, dict[str, str]] | None]) -> None:
        message = divergence_message([r for r in reports if r is not None])
        if message is not None:
            raise ReplicatedValueError(message + plan.intact)

    comm.step(f"compare its plain values of step {plan.step}", mine, refuse)


def _discard_attempt(session: Session, plan: SavePlan) -> None:
    """Remove a failed attempt's data, unless this job lost the root (the new holder may have adopted it,
    and clears leftovers itself) or the attempt may be committed after all (an unknown outcome)."""
    if session.topo.is_leader:
        try:
            session.root.discard_attempt(plan.staging, plan.name, plan.attempt)
        except LeaseLostError as e:
            log.info("ckptguard: the failed attempt %s is left to the job that holds the root now: %s", plan.staging, e)
        except (OSError, CheckpointError) as e:
            log.warning(
                "ckptguard: the failed attempt %s is kept (it is settled by the next save): %s", plan.staging, e
            )
