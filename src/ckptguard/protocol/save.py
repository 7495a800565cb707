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
from dataclasses import dataclass, field
from typing import Any

from ckptguard._faults import FaultPhase, fault_point
from ckptguard._pool import ExitSafePool
from ckptguard._signals import signals_deferred
from ckptguard.comm import agreed_failures, with_suffix
from ckptguard.dcp.drive import plan_collectively
from ckptguard.dcp.planners import (
    DomainSavePlanner,
    combined_digest,
    divergence_message,
    forget_cached_plans,
    ranks_differing,
)
from ckptguard.dcp.writer import GuardedWriter, WriteOutcome
from ckptguard.errors import CheckpointError, LeaseLostError, ReplicatedValueError
from ckptguard.progress import ByteProgress
from ckptguard.protocol import artifacts, layout
from ckptguard.protocol.artifacts import ArtifactTarget
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
    retention,
    stray_versions,
)
from ckptguard.protocol.itemtable import ItemTable
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import Artifact, FileEntry, Manifest
from ckptguard.protocol.root import Root
from ckptguard.protocol.session import Options, Session
from ckptguard.protocol.timing import PhaseTimer
from ckptguard.state import state_nbytes

log = logging.getLogger("ckptguard")

#: What a rank's files= artifacts became in the attempt: their records, and their files.
StoredArtifacts = tuple[list[Artifact], list[FileEntry]]


@dataclass(frozen=True)
class SavePlan:
    step: int
    name: CheckpointName
    attempt: str
    staging: str
    targets: list[ArtifactTarget]
    previous: int | None  # newest agreed step before this save, for error messages
    seq: int  # commit sequence number of this save
    quarantined: frozenset[int] = frozenset()  # agreed steps a load found corrupt (retention drops them first)

    @property
    def intact(self) -> str:
        if self.previous is None:
            return " Nothing was committed."
        return f" Nothing was committed; the previous checkpoint, step {self.previous}, is intact."

    def kept_after_failure(self, url: str) -> str:
        """What is true when this leader published the step and could not take it back."""
        return (
            f" Step {self.step} was published in {url} and could not be taken back: it may be committed; "
            f"`ckptguard ls {url}` lists it if it is, `ckptguard verify {url}` checks it."
        )

    def fenced_during_commit(self, url: str) -> str:
        """What is true of the step when this job lost the root during its commit: a leader may have
        published it first (then it is committed, and that leader's message says so)."""
        return (
            f" This job lost the root while committing step {self.step}: unless a storage domain's leader "
            f"says above that it had published it (then it is committed), nothing was committed; "
            f"`ckptguard ls {url}` lists the step if it is."
        )


@dataclass(frozen=True)
class SaveRequest:
    step: int
    state_dict: dict[str, Any]
    targets: list[ArtifactTarget]
    file_items: list[Any]  # the targets themselves, or their contents snapshotted for an async save
    overwrite: bool
    user_metadata: dict[str, Any]
    local_error: BaseException | None  # a local problem found before the save (reported at the plan)
    keep: frozenset[int] = field(default=frozenset(), kw_only=True)  # steps retention keeps whatever the policy
    options: Options = field(kw_only=True)  # the settings at the call, snapshotted (a background save's too)


@dataclass(frozen=True)
class Written:
    """What this rank's write step produced, for the commit: a failure is reported at its first agreement."""

    outcome: WriteOutcome[StoredArtifacts] = field(default_factory=WriteOutcome)  # files, artifacts, items
    digests: dict[str, str] = field(default_factory=dict)  # replicated values' digests (per-rank divergence)
    metadata: Any = None  # DCP's metadata of the whole checkpoint (rank 0 only)
    error: BaseException | None = None

    def report(self) -> RankWrites:
        """This rank's files, artifacts and item table, for the leader's manifests."""
        arts, art_files = self.outcome.before_write or ([], [])
        files = [*self.outcome.files, *art_files]
        return RankWrites(files, arts, ItemTable.from_items(list(self.outcome.stored), [f.path for f in files]))


@dataclass
class _Publication:
    """The commit's publish step, as the failure handling after it needs to know it."""

    published: bool = False
    listing: DomainListing = field(default_factory=dict)  # this domain's listing right after it (finish reuses it)


@dataclass(frozen=True)
class SaveOutcome:
    committed: Listing  # what is committed now, agreed by every rank
    retired: list[str]  # what this leader took out of sight, to be removed in the background


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
            return _commit(session, plan, mine, request.keep, request.options)
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


def _commit(
    session: Session, plan: SavePlan, mine: Manifest | None, keep: frozenset[int], options: Options
) -> SaveOutcome:
    """Commit one manifest per storage domain (``mine``: this domain's, on its leader), then finish
    (collective). A commit another domain failed is rolled back where this leader published."""
    comm, topo = session.comm, session.topo
    pub = _Publication()

    def publish() -> DomainListing | None:
        if not topo.is_leader:
            return None
        assert mine is not None and session.lease is not None
        session.lease.check()
        lease = session.lease

        def last_check() -> None:
            fault_point(FaultPhase.BEFORE_PUBLISH, comm.rank)
            lease.check(renew=False)  # as close to the commit point as it gets (the manifest write may have stalled)

        # NFS: every file visible here with its size before the commit names it. Where a write that
        # returned is visible to all (S3), each rank's completed upload already proved its objects:
        # N * F lookups by one leader would cost more than the save at thousands of ranks.
        commit_when_visible(
            session.root,
            plan.staging,
            mine,
            not session.storage.visible_once_written,
            options.visibility_timeout_s,
            last_check,
        )
        pub.published = True
        # A stall between that check and the rename (a frozen VM; on NFS, a handle to the staging
        # directory the new holder moved away still works) published into a root another job owns
        # by now: look again, and take it back (rolled back below, as when another domain fails).
        try:
            session.lease.check(acting="keep what it published", renew=False)
        except LeaseLostError as e:
            raise _fenced_after_publish(session, plan, e) from e
        fault_point(FaultPhase.AFTER_PUBLISH, comm.rank)
        pub.listing = session.root.listing()
        return pub.listing

    def after_publish(listings: list[DomainListing | None]) -> tuple[list[int], Listing]:
        agreed = agreed_listing(listings)
        doomed = retention(agreed, plan.step, options.keep_last, options.keep_every, plan.quarantined)
        return [s for s in doomed if s not in keep], agreed

    try:
        # No suffix here: whether "nothing was committed" is true depends on the failure (below).
        # (session.fenced says "nothing was committed": only true before this leader's commit point.)
        doomed, agreed = comm.step(
            f"commit step {plan.step}",
            publish,
            after_publish,
            where=session.url,
            on_error=lambda err: err if pub.published else session.fenced(err),
        )
    except BaseException as e:
        kept = pub.published  # this leader's publish stands unless it is taken back here
        if pub.published and agreed_failures(e):  # another domain failed: not committed anywhere, roll back
            try:  # under the fence, like every removal: a job that lost the root takes nothing back
                session.root.invalidate(session.root.dir(plan.name))
                kept = False
            except (OSError, CheckpointError) as rollback:
                log.warning("ckptguard: could not roll back %s: %s", session.root.dir(plan.name), rollback)
        if kept and not isinstance(e, LeaseLostError):
            _tell(e, plan.kept_after_failure(session.url))
        elif not kept:  # (a leader that published and lost the root said what became of it in its message)
            _tell(e, plan.fenced_during_commit(session.url) if isinstance(e, LeaseLostError) else plan.intact)
        raise
    lost: LeaseLostError | None = None
    retired: list[str] = []
    if topo.is_leader:
        try:
            retired = finish(session, plan, doomed, agreed, pub.listing)
        except LeaseLostError as e:
            lost = e
    # Agreed, so that every rank of a job that lost the root raises (and no later save is tried).
    comm.step(f"finish step {plan.step}", lambda: _raise(lost), where=session.url)
    return SaveOutcome({s: v for s, v in agreed.items() if s not in doomed}, retired)


def commit_when_visible(
    root: Root, staging: str, manifest: Manifest, check_visible: bool, timeout: float, last_check: Callable[[], None]
) -> CheckpointName:
    """``root.commit`` of ``manifest``, with (``check_visible``) every file it names checked visible
    with its size (``root.wait_files_visible``) before the commit point.

    The check runs in a thread while the commit encodes, writes and syncs the manifest (listings,
    stats and fsync release the GIL: at 16,384 ranks each takes a few tenths of a second), and is
    awaited right before ``last_check``, that is before the publish. Either failing stops the
    commit with nothing published. A failed write still waits for the check, and where both fail
    the check's error is raised: the errors are those of the check run first, then the write."""
    if not check_visible:
        return root.commit(staging, manifest, last_check)
    with signals_deferred():  # a Ctrl-C between the submit and the shutdown left the worker idle for good
        pool = ExitSafePool(1, thread_name_prefix="ckptguard-visible")
        check = pool.submit(root.wait_files_visible, staging, manifest.files, timeout)
        pool.shutdown(wait=False)  # the thread ends once the check has run

    def visible_then_last_check() -> None:
        check.result()
        last_check()

    try:
        return root.commit(staging, manifest, visible_then_last_check)
    except BaseException:
        check.result()  # the check's own failure first, as when it ran before the write
        raise


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


def _fenced_after_publish(session: Session, plan: SavePlan, err: LeaseLostError) -> LeaseLostError:
    """The takeover learned of after this leader's commit point. The job that took the root over
    decides what becomes of the step (it keeps one it finds published): look, and say which."""
    try:
        listed: bool | None = plan.name.version in session.root.listing().get(plan.step, {})
    except (OSError, CheckpointError):
        listed = None
    published = f"Step {plan.step} was published before this job learned that"
    if listed:
        outcome = (
            f"{published}, and it is listed in {session.url}: it is committed (the job that holds the root "
            "now keeps it, until its own retention or delete)"
        )
    elif listed is None:
        outcome = (
            f"{published}; whether it is still listed could not be read: `ckptguard ls {session.url}` "
            f"lists it if it is committed, `ckptguard verify {session.url}` checks it"
        )
    else:
        outcome = (
            f"{published}, but it is no longer listed in {session.url} (the job that holds the root now "
            "took it out): nothing of this save is committed"
        )
    return LeaseLostError(f"{err} {outcome}.", path=err.path)


def _tell(err: BaseException, text: str) -> None:
    """Append what became of the save to the error a commit raised (a note on a foreign exception)."""
    if isinstance(err, CheckpointError):
        err.args = (with_suffix(str(err), text), *err.args[1:])
    elif isinstance(err, Exception):
        err.add_note(text.strip())


def _raise(err: BaseException | None) -> None:
    if err is not None:
        raise err


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


def finish(session: Session, plan: SavePlan, doomed: list[int], agreed: Listing, mine: DomainListing) -> list[str]:
    """After a commit (leaders): move `latest`, retire what is no longer needed; what to remove.
    ``mine`` is this domain's listing taken right after the publish (only this job writes the root).

    Retiring (an atomic rename into trash) of old checkpoints, superseded
    versions and leftovers of crashed attempts happens now, so that when
    save() returns the retention policy holds and no attempt is left in
    staging. Removing the bytes takes as long as the storage needs: the caller
    does that in the background (``session.root.remove_retired``).

    Every action is taken only after checking that this job still holds the
    root's lease (compare-and-swap on the lease record's version): a job that
    stalled after its commit while another job took the root over stops here
    with LeaseLostError, before it moves `latest` or retires anything of the
    new holder's. The checkpoint itself is committed either way.
    """
    root, lease = session.root, session.lease
    assert lease is not None
    retired: list[str] = []

    def retire(path: str) -> None:
        retired_path = root.retire(path)  # checks the fence right before it acts
        if retired_path is not None:
            retired.append(retired_path)

    try:
        lease.check(acting="move `latest`")
        root.move_latest(plan.name, plan.seq)
        fault_point(FaultPhase.AFTER_COMMIT, session.comm.rank)
        lease.check(acting="apply retention", renew=False)
        doomed_dirs = [root.dir(CheckpointName(s, v)) for s in doomed for v in mine.get(s, {})]
        stray = [root.dir(n) for n in stray_versions(mine, agreed) if n.step not in doomed]
        garbage = root.garbage()
        for path in doomed_dirs + stray + garbage.staging + garbage.probes:
            retire(path)
        retired.extend(garbage.trash)
        # Quarantine records of what is gone now (the replaced version of a quarantined step included).
        gone = set(doomed_dirs + stray)
        root.prune_quarantine(
            {
                s: {v: q for v, q in versions.items() if root.dir(CheckpointName(s, v)) not in gone}
                for s, versions in mine.items()
            }
        )
    except LeaseLostError as e:
        e.args = (f"step {plan.step} is committed, but {e}",)
        raise
    except (OSError, CheckpointError) as e:
        log.warning("ckptguard: step %d is committed, but retention in %s failed: %s", plan.step, session.url, e)
    return retired
