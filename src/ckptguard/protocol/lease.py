"""A lease on a checkpoint root: one job writes to it at a time (fencing).

Two jobs started by mistake on one root would otherwise interleave saves,
delete each other's checkpoints through retention and move ``latest`` back and
forth. The lease file names the holder and carries an epoch; the holder renews
it in the background and checks it before every publish, so a job that lost its
lease (it stalled past the TTL and another job took over) fails instead of
publishing.

Every other mutating action of a leader (moving ``latest``, retention, clean-up
of staging, releasing the lease) checks the lease first as well, and the release
deletes the record only if it is still the very record this job wrote
(compare-and-delete on its version): a job that stalled and lost the root can
neither hide nor overwrite anything of the new holder's.

Takeover without waiting is allowed only when the holder is provably gone: the
same job identity (a torchrun restart, a SLURM requeue of the same job step; in a batch step,
which processes started side by side share, only a higher SLURM_RESTART_COUNT), or
the same host, boot and pid namespace with a dead pid. Otherwise the newcomer
waits for the lease to expire and fails with a clear error if the holder keeps
renewing it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from socket import gethostname as hostname

import msgspec

from ckptguard.errors import (
    CheckpointError,
    CorruptCheckpointError,
    LeaseHeldError,
    LeaseLostError,
    MalformedRecordError,
)
from ckptguard.protocol import layout, records
from ckptguard.protocol.cas import Keep, Put, Remove, SwapConflictError, swap, swap_once
from ckptguard.storage import StorageBackend

log = logging.getLogger("ckptguard")


def job_identity(explicit: str | None = None) -> str | None:
    """A name shared by every incarnation of one job, or None if we cannot tell."""
    if explicit:
        return explicit
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id.lower() not in ("none", "default", ""):
        return f"torchelastic:{run_id}"
    if os.environ.get("SLURM_JOB_ID"):
        # Concurrent `srun` steps of one allocation share SLURM_JOB_ID: they are different jobs.
        step = os.environ.get("SLURM_STEP_ID", "")
        if step:
            return f"slurm:{os.environ['SLURM_JOB_ID']}.{step}"
        # The batch step: processes started side by side by one batch script share it too; only a
        # later incarnation (a requeue raises SLURM_RESTART_COUNT) is certainly another lifetime.
        return f"slurm:{os.environ['SLURM_JOB_ID']}{_BATCH}{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return None


_BATCH = ".batch#"


def earlier_incarnation(holder_job: str | None, our_job: str | None) -> bool:
    """Is the holder certainly an earlier lifetime of our own job (so it is gone)?"""
    if not holder_job or not our_job:
        return False
    if _BATCH in holder_job or _BATCH in our_job:
        theirs, _, their_restart = holder_job.partition(_BATCH)
        ours, _, our_restart = our_job.partition(_BATCH)
        return (
            theirs == ours
            and their_restart.isdigit()
            and our_restart.isdigit()
            and int(their_restart) < int(our_restart)
        )
    return holder_job == our_job


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    """This process's pid namespace (containers on one host and boot can share hostname and boot
    id, but a pid means something only inside its own namespace)."""
    try:
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_dead_here(rec: LeaseRecord) -> bool:
    """Whether the lease's holder is provably gone: its pid is not running on this host, in this boot and
    pid namespace (elsewhere a pid says nothing, and only the TTL tells)."""
    return bool(
        rec.host == hostname()
        and rec.boot_id == _boot_id()
        and rec.pid_ns
        and rec.pid_ns == _pid_namespace()
        and not _pid_alive(rec.pid)
    )


@dataclass
class LeaseRecord:
    holder: str  # unique per job incarnation (broadcast from rank 0)
    job: str | None
    host: str
    pid: int
    boot_id: str
    epoch: int
    acquired_at: float
    renewed_at: float
    ttl_s: float
    pid_ns: str = ""  # "" when unknown (no /proc/self/ns/pid on its host): no dead-pid shortcut then

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), sort_keys=True) + "\n").encode()

    @staticmethod
    def from_bytes(data: bytes) -> LeaseRecord | None:
        try:  # newer fields: ignored
            return LeaseRecord(**msgspec.structs.asdict(records.decode(data, records.LeaseBody, layout.LEASE)))
        except MalformedRecordError:
            return None  # being written, or garbage: treated as expired after the TTL by mtime

    def describe(self) -> str:
        age = time.time() - self.renewed_at
        job = f"job {self.job}" if self.job else "a job"
        return f"{job} on host {self.host} (pid {self.pid}), lease renewed {age:.0f} s ago, TTL {self.ttl_s:.0f} s"


#: How long release() waits for the storage before it leaves the lease to expire.
RELEASE_TIMEOUT_S = 4.0
#: The same wait at interpreter exit (a job that never called close()): the process must be gone within
#: 5 s whatever the endpoint does, and finalizing an interpreter with torch loaded takes about a second more.
EXIT_RELEASE_TIMEOUT_S = 2.0


class Lease:
    """The lease on one root, held by this rank on behalf of its job (domain leaders only)."""

    def __init__(self, storage: StorageBackend, holder: str, job: str | None, ttl_s: float) -> None:
        self.storage = storage
        self.path = storage.path(layout.LEASE)
        self.holder = holder
        self.job = job
        self.ttl_s = ttl_s
        self.epoch = 0
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()  # the process that holds it (a fork's child does not)

    def _record(self, epoch: int, acquired_at: float | None = None) -> LeaseRecord:
        now = time.time()
        return LeaseRecord(
            self.holder,
            self.job,
            hostname(),
            os.getpid(),
            _boot_id(),
            epoch,
            acquired_at or now,
            now,
            self.ttl_s,
            _pid_namespace(),
        )

    def read(self) -> LeaseRecord | None:
        versioned = self._read_versioned()
        return LeaseRecord.from_bytes(versioned[0]) if versioned is not None else None

    def _read_versioned(self) -> tuple[bytes, str] | None:
        try:
            return self.storage.read_versioned(self.path)
        except CorruptCheckpointError:  # not a regular file, or absurdly large: garbage, judged by age
            return b"", "garbage"

    def _holder_gone(self, rec: LeaseRecord) -> str | None:
        """Why the current holder can be replaced right now, or None."""
        if rec.holder == self.holder:
            return "it is ours"
        if time.time() - rec.renewed_at > rec.ttl_s:
            return "it expired"
        if earlier_incarnation(rec.job, self.job):
            return f"it belongs to an earlier incarnation of this job ({self.job})"
        if holder_dead_here(rec):
            return f"its holder, pid {rec.pid} on this host, is dead"
        return None

    def acquire(self, wait_s: float, fence: Callable[[], None] | None = None) -> None:
        """Take the lease, waiting up to ``wait_s`` for a live holder to let go.

        ``fence`` runs before the lease is written: it must make any write a
        previous holder still has in flight fail (Checkpointer moves the staging
        directory away, so a stalled job's publishing rename finds no source).
        """
        self.storage.makedirs(os.path.dirname(self.path))
        deadline = time.monotonic() + wait_s
        while True:
            if not self.storage.exists(self.path):
                if fence is not None:
                    fence()
                if swap_once(self.storage, self.path, None, self._record(1).to_bytes()):
                    self.epoch = 1
                    break
            versioned = self._read_versioned()
            if versioned is None:
                continue
            rec = LeaseRecord.from_bytes(versioned[0])
            if rec is None:
                # Unreadable lease: garbage (records are replaced atomically). Judge by age.
                mtime = self.storage.mtime(self.path)
                if mtime is not None and time.time() - mtime > self.ttl_s:
                    rec = LeaseRecord("?", None, "?", 0, "", 0, mtime, mtime, self.ttl_s)
            if rec is not None and self._holder_gone(rec) is not None:
                epoch = rec.epoch + 1
                if fence is not None:
                    # The fence moves shared state: only while the record judged gone is still the one
                    # there (a newcomer that stalled here must not fence the job that took over meanwhile).
                    again = self._read_versioned()
                    if again is None or again[1] != versioned[1]:
                        continue
                    fence()
                # Compare-and-swap on the version judged gone: of two jobs taking over at once, one wins. One
                # round of swap_once, not cas.swap: cas.swap's fence asks whether this job still holds the
                # root, which a taker does not yet; the fence that guards a takeover is the version judged
                # gone (and ``fence`` above, run while it is still there); and a lost round is judged again
                # by this loop, which waits for a live holder instead of swapping again at once.
                if swap_once(self.storage, self.path, versioned, self._record(epoch).to_bytes()):
                    self.epoch = epoch
                    break
                continue
            if time.monotonic() >= deadline:
                who = rec.describe() if rec is not None else "an unreadable lease file"
                raise LeaseHeldError(
                    f"checkpoint root {self.storage.root} is in use by {who}. Two jobs must not "
                    f"write to one root. If that job is dead, this one can take over once its lease "
                    f"expires (after {self.ttl_s:.0f} s without renewal), or delete {self.path} by hand "
                    "after making sure it is dead.",
                    path=self.path,
                )
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
        self._start_renewal()

    def _start_renewal(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name="ckptguard-lease", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        interval = max(0.2, self.ttl_s / 4)
        while not self._stop.wait(interval):
            try:
                self.renew()
            except (OSError, CheckpointError) as e:
                # Transient (a full disk, an NFS hiccup): try again next time. Whether the lease
                # is still ours is decided by what the lease file says, in check().
                log.warning("ckptguard: renewing the lease on %s failed (will retry): %s", self.storage.root, e)

    def renew(self) -> None:
        """Refresh the record if it is still ours, by compare-and-swap on the version read; else note the
        lease as lost. No lock is held across the storage calls (a renewal stalled on an endpoint that
        does not answer must not hold up release() or check()): a swap that loses to a concurrent
        renewal of our own rereads a record that is still ours and swaps again."""
        if self._lost:
            return

        def decide(rec: LeaseRecord | None) -> Put[LeaseRecord, str | None] | Keep[str | None]:
            if not self._ours(rec):
                return Keep(self._who_took_it(rec))
            assert rec is not None
            return Put(self._record(self.epoch, rec.acquired_at), None)

        try:
            lost = swap(
                self.storage,
                self.path,
                decide=decide,
                decode=LeaseRecord.from_bytes,
                encode=LeaseRecord.to_bytes,
                fence=None,
                what="renew the lease",
                rounds=3,
                pause_s=0.0,
            )
        except SwapConflictError:
            # Every round lost to another write. The renewal thread and check() renew concurrently: the
            # writes that won may be this job's own, which leaves the lease ours (renewed by them).
            rec = self.read()
            lost = None if self._ours(rec) else self._who_took_it(rec)
        if lost is not None:
            with self._lock:
                self._lost = self._lost or lost

    def _ours(self, rec: LeaseRecord | None) -> bool:
        return rec is not None and rec.holder == self.holder and rec.epoch == self.epoch

    def _who_took_it(self, rec: LeaseRecord | None) -> str:
        if rec is None:
            return "the lease file is gone (removed by hand, or by another job)"
        if rec.holder == self.holder:
            # Not another job: another storage-domain leader of this one took it, so two leaders
            # write to one root. The probe split ranks that in fact share the storage.
            return (
                f"another storage-domain leader of this same job took it (epoch {rec.epoch}, host {rec.host}, "
                f"pid {rec.pid}): the storage probe put ranks that share this root into different storage "
                "domains, which happens when a shared filesystem's caches hide files for longer than the "
                "probe; check the mount options (actimeo, lookupcache)"
            )
        return f"another job took over the root: {rec.describe()}"

    def check(self, acting: str = "publish", renew: bool = True) -> None:
        """Raise LeaseLostError unless this job still holds the lease (and renew it, unless ``renew``
        is False: a read only, for checks that follow each other closely).

        Called before every save, publish, `latest` move, retirement and clean-up:
        ``acting`` says which, for the message.
        """
        rec = self.read()
        with self._lock:
            if self._lost is None and not self._ours(rec):
                self._lost = self._who_took_it(rec)
            lost = self._lost
        if lost is None and renew:
            try:  # renewals may have failed for a while (disk full): the lease is ours, refresh it now
                self.renew()
            except (OSError, CheckpointError) as e:
                log.warning("ckptguard: renewing the lease on %s failed: %s", self.storage.root, e)
        if lost:
            raise LeaseLostError(
                f"this job no longer holds the lease on {self.storage.root} ({lost}); refusing to {acting} "
                "so that two jobs never write one root.",
                path=self.path,
            )

    def release(self, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
        """Hand the root back: delete the record if it is still ours. Bounded (at exit too): if the
        storage does not answer within ``timeout_s``, the lease is left to expire after its TTL.
        Never raises. A forked child of the holder (which inherits this object, its atexit hooks and
        its Checkpointers) never releases: the lease is its parent's, still saving."""
        if os.getpid() != self._pid:
            return
        self._stop.set()
        self._thread = None  # a renewal stalled in a storage call ends on its own (a daemon thread)
        done = threading.Event()

        def run() -> None:
            try:
                self._delete_record()
            except BaseException as e:  # at exit nothing may escape: the lease expires
                log.warning(
                    "ckptguard: could not release the lease on %s (it expires %.0f s after its last renewal): %s",
                    self.storage.root,
                    self.ttl_s,
                    e,
                )
            finally:
                done.set()

        threading.Thread(target=run, name="ckptguard-lease-release", daemon=True).start()
        if not done.wait(timeout_s):
            log.warning(
                "ckptguard: releasing the lease on %s got no answer from the storage within %.1f s; it "
                "expires %.0f s after its last renewal",
                self.storage.root,
                timeout_s,
                self.ttl_s,
            )

    def _delete_record(self) -> None:
        def decide(rec: LeaseRecord | None) -> Remove[None] | Keep[None]:
            ours = rec is not None and rec.holder == self.holder and rec.epoch == self.epoch
            return Remove(None) if ours else Keep(None)

        # Compare-and-delete on the version read: a job that took the root over between the read and the
        # delete keeps its lease; a renewal of ours in between makes the swap read again.
        with contextlib.suppress(SwapConflictError):
            swap(
                self.storage,
                self.path,
                decode=LeaseRecord.from_bytes,
                encode=LeaseRecord.to_bytes,
                decide=decide,
                fence=None,
                what="release the lease",
                rounds=3,
                pause_s=0.0,
            )


def release_at_exit(lease: Lease) -> None:
    """The atexit hook of a job's lease (one bounded release; never raises)."""
    lease.release(EXIT_RELEASE_TIMEOUT_S)


def new_holder_id() -> str:
    return uuid.uuid4().hex
