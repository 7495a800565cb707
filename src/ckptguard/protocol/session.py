"""What every save and load of one root shares: the ranks, the storage, the topology, the lease.

Built once by :class:`ckptguard.Checkpointer` (collectively) and handed to the
save and load transactions, which keep no state of their own between calls.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, field
from typing import Any

from ckptguard.comm import Comm
from ckptguard.errors import CheckpointError, LeaseLostError
from ckptguard.protocol import layout
from ckptguard.protocol.lease import Lease, LeaseRecord, job_identity, new_holder_id
from ckptguard.protocol.root import Root
from ckptguard.protocol.topology import Topology
from ckptguard.storage import StorageBackend


@dataclass(frozen=True)
class Options:
    keep_last: int | None
    keep_every: int | None
    io_threads: int
    checksum: str
    visibility_timeout_s: float
    #: Per rank: what a load may hold in host memory to read a checkpoint once and still leave the
    #: caller's state untouched on failure; None: the reader's default for the storage (dcp/reader.py).
    load_memory_bytes: int | None = None


class DcpJsonCache:
    """The leader's last DCP ``Metadata`` and its JSON form, kept across saves: DCP hands out the very same
    Metadata object while no rank's plan changed (its plan cache), and its JSON is then the same too, so a
    save of an unchanged structure skips encoding it again."""

    def __init__(self) -> None:
        self._last: tuple[Any, dict[str, Any]] | None = None

    def get(self, metadata: Any) -> dict[str, Any] | None:
        """The JSON of ``metadata`` if it is the very object last put (None: encode it)."""
        last = self._last
        return last[1] if last is not None and last[0] is metadata else None

    def put(self, metadata: Any, encoded: dict[str, Any]) -> None:
        """Remember ``encoded`` as the JSON of ``metadata`` (the one object kept)."""
        self._last = (metadata, encoded)


@dataclass
class Session:
    comm: Comm
    storage: StorageBackend
    root: Root
    topo: Topology
    options: Options
    instance: str  # identical on every rank: keys DCP's plan cache (with the rank)
    lease: Lease | None = None  # domain leaders of a writing Checkpointer
    holder: str | None = None  # this job incarnation's lease holder id (writing Checkpointers)
    dcp_json: DcpJsonCache = field(default_factory=DcpJsonCache)  # the leader's, across saves

    @property
    def url(self) -> str:
        return self.storage.root

    def taken_over_by(self) -> LeaseRecord | None:
        """The lease record of the job that took this root over from this one, or None (not taken
        over, not a writing Checkpointer, or unreadable). Any rank can ask: it reads the record."""
        if self.holder is None:
            return None
        try:
            rec = LeaseRecord.from_bytes(self.storage.read_bytes(self.storage.path(layout.LEASE)))
        except (OSError, CheckpointError):
            return None
        return rec if rec is not None and rec.holder != self.holder else None

    def fenced(self, err: BaseException) -> BaseException:
        """A failure inside a save may be the fence of another job's takeover (it moved our staging
        directory away): say so, rather than show the file that vanished."""
        if isinstance(err, LeaseLostError):
            return err
        rec = self.taken_over_by()
        if rec is None:
            return err
        what = f"{type(err).__name__}: {err}" if not isinstance(err, CheckpointError) else str(err)
        fenced = self._attempt_moved_away(rec, f" The failure it caused: {what}")
        fenced.__cause__ = err
        return fenced

    def stop_if_taken_over(self) -> None:
        """For waits on this save's own attempt: one that another job moved away never comes back."""
        rec = self.taken_over_by()
        if rec is not None:
            raise self._attempt_moved_away(rec, "")

    def _attempt_moved_away(self, rec: LeaseRecord, cause: str) -> LeaseLostError:
        return LeaseLostError(
            f"this job no longer holds the lease on {self.url}: {rec.describe()} took it over (this job's "
            f"lease expired: it stalled, or its renewals failed), and moved this save's attempt away; nothing "
            f"of this save was committed.{cause}",
            path=self.storage.path(layout.LEASE),
        )


def open_session(
    comm: Comm,
    root: Root,
    options: Options,
    *,
    read_only: bool,
    job_id: str | None,
    lease_ttl_s: float,
    lease_wait_s: float | None,
) -> Session:
    """Probe which ranks share the root, agree on ids, and take the lease (collective). (The four
    keyword-only parameters are the Checkpointer's own arguments, passed through unchanged.)"""
    storage = root.storage
    if not read_only:
        comm.step(
            f"create the checkpoint root {storage.root}",
            lambda: storage.makedirs(storage.path(layout.CONTROL)),
            where=storage.root,
        )
    topo = root.probe_domains(comm, write=not read_only)
    comm.set_domains([list(d) for d in topo.domains])
    # Identical on every rank (DCP's plan cache must be hit or missed by all ranks alike).
    instance, holder = comm.step(
        "agree on this Checkpointer's ids", decide_fn=lambda _: (uuid.uuid4().hex, new_holder_id())
    )
    session = Session(comm, storage, root, topo, options, instance)
    if not read_only:
        session.holder = holder

        def take_lease() -> None:
            if topo.is_leader:
                lease = Lease(storage, holder, job_identity(job_id), lease_ttl_s)
                lease.acquire(lease_wait_s if lease_wait_s is not None else lease_ttl_s * 1.5, fence=root.fence_staging)
                session.lease = lease
                root.set_fence(functools.partial(_check_lease, lease))
                root.after_lease()
                root.quarantined()  # read once now: the holder keeps them from here on (no listing per save)

        try:
            comm.step(f"take the lease on {storage.root}", take_lease, where=storage.root)
        except BaseException:
            if session.lease is not None:  # another domain's leader failed: hand ours back
                session.lease.release()
            raise
    return session


def _check_lease(lease: Lease, acting: str) -> None:
    lease.check(acting=acting, renew=False)
