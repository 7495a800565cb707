"""A save's commit phase: one manifest published per storage domain, then `latest`, retention and clean-up.

Each leader writes its domain's manifest while it checks every file visible with its size, then
publishes the attempt (``commit_when_visible``). Once every domain has published, ``finish`` moves
`latest` and retires what retention drops, each action after a check that this job still holds the
root's lease. A commit another domain failed is rolled back where this leader published.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptguard._faults import FaultPhase, fault_point
from ckptguard._pool import ExitSafePool
from ckptguard._signals import signals_deferred
from ckptguard.comm import agreed_failures, with_suffix
from ckptguard.errors import CheckpointError, LeaseLostError
from ckptguard.protocol.decisions import DomainListing, Listing, agreed_listing, retention, stray_versions
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import Manifest
from ckptguard.protocol.root import Root
from ckptguard.protocol.saveplan import SaveOutcome, SavePlan
from ckptguard.protocol.session import Options, Session

log = logging.getLogger("ckptguard")


@dataclass
class _Publication:
    """The commit's publish step, as the failure handling after it needs to know it."""

    published: bool = False
    listing: DomainListing = field(default_factory=dict)  # this domain's listing right after it (finish reuses it)


def commit(
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
