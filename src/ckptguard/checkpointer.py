"""`Checkpointer`: save, load, list, retention, around the commit protocol.

Every public method is collective when a process group is initialised: all
ranks call it with the same arguments. Each step of the protocol is a local
action followed by an agreement, so a failure on any rank makes every rank raise
the same CheckpointError, which names the rank that failed first.

    plan      leaders read their root (lease, existing versions); rank 0 decides
              the attempt name, the version and checks that no two ranks' paths
              collide: nothing is written before this is agreed
    stage     leaders create a fresh attempt directory in .ckptguard/staging
    write     every rank writes and fsyncs its part (DCP plans, our writer does I/O)
    commit    rank 0 builds one manifest per storage domain; each leader waits
              until every file is visible with its size, writes the manifest,
              renames the attempt into place and fsyncs the parent
    finish    once every domain has published: `latest` moves, retention and
              clean-up of leftovers run, by leaders only
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import logging
import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptguard import artifacts, layout
from ckptguard._faults import fault_point
from ckptguard.artifacts import ArtifactTarget
from ckptguard.checksum import ALGORITHMS, DEFAULT_ALGORITHM
from ckptguard.comm import (
    Comm,
    agree,
    default_comm,
    describe_error,
    gather_failures,
    hostname,
    local_failure,
    order_failures,
    raise_failures,
    with_suffix,
)
from ckptguard.dcp_io import (
    DomainSavePlanner,
    GuardedReader,
    GuardedWriter,
    SafeLoadPlanner,
    check_replicated,
    forget_cached_plans,
    metadata_from_json,
    metadata_to_json,
    plan_collectively,
    read_locally,
)
from ckptguard.errors import CheckpointError, CorruptCheckpointError
from ckptguard.layout import CheckpointName
from ckptguard.lease import Lease, LeaseRecord, job_identity, new_holder_id
from ckptguard.manifest import Artifact, FileEntry, Manifest, StoredItem
from ckptguard.progress import ByteProgress
from ckptguard.root import CheckpointRoot
from ckptguard.staging import HostStager, stage_files, state_nbytes
from ckptguard.state import prepare_state
from ckptguard.storage.posix import PosixStorage, explain_os_error, read_ahead
from ckptguard.topology import Topology, host_domains, probe_storage_domains

log = logging.getLogger("ckptguard")


@dataclass
class _SavePlan:
    step: int
    name: CheckpointName
    attempt: str
    staging: str
    targets: list[ArtifactTarget]
    previous: int | None  # newest agreed step before this save, for error messages


@dataclass
class _RankWrites:
    """What one rank wrote, sent to rank 0 for the manifests."""

    files: list[FileEntry] = field(default_factory=list)
    artifacts: list[Artifact] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)  # small plain values, to catch per-rank ones
    items: list[StoredItem] = field(default_factory=list)  # where each of its items is stored


class Checkpointer:
    """Race-free, crash-safe checkpoints in one root directory.

    ``Checkpointer("/shared/ckpts", keep_last=3)`` works with or without an
    initialised process group. Constructing it is collective: the ranks probe
    which of them share the root, and each storage domain's leader takes the
    root's lease (pass ``read_only=True`` to only load and list).
    ``process_group`` (default: all ranks, through a gloo group ckptguard
    creates) must be a gloo group if given; every member calls every method.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        process_group: Any = None,
        read_only: bool = False,
        job_id: str | None = None,
        lease_ttl_s: float = 30.0,
        lease_wait_s: float | None = None,
        io_threads: int = 4,
        checksum: str = DEFAULT_ALGORITHM,
        visibility_timeout_s: float = 60.0,
        async_budget_bytes: int | None = None,
        progress: bool = False,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1 (the newest checkpoint is always kept)")
        if keep_every is not None and keep_every < 1:
            raise ValueError("keep_every must be >= 1")
        if checksum not in ALGORITHMS:
            raise ValueError(f"checksum must be one of {ALGORITHMS}")
        self.keep_last = keep_last
        self.progress = progress
        self.keep_every = keep_every
        self.read_only = read_only
        self.io_threads = io_threads
        self.checksum = checksum
        self.visibility_timeout_s = visibility_timeout_s
        self._comm: Comm = default_comm(process_group)
        self._storage = PosixStorage(os.fspath(root))
        self._root = CheckpointRoot(self._storage)
        self._lease: Lease | None = None
        self._closed = False
        self._cleaner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptguard-cleanup")
        self._cleanup: Future[None] | None = None
        # Saves with blocking=False: one at a time, from host buffers reused across saves.
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptguard-save")
        self._inflight: Future[None] | None = None
        self._stager = HostStager(async_budget_bytes)
        self._warned_budget = False
        self.last_save_stats: PhaseTimer | None = None
        self.last_load_stats: PhaseTimer | None = None
        if read_only:
            self._topo: Topology = host_domains(self._comm)
        else:
            err: BaseException | None = None
            try:
                self._storage.makedirs(self._storage.path(layout.CONTROL))
            except OSError as e:
                err = explain_os_error(e, self._storage.root, self._comm.rank)
            except Exception as e:  # every failure must reach the agreement, or the others wait forever
                err = e
            agree(self._comm, err, f"create the checkpoint root {self._storage.root}")
            self._topo = probe_storage_domains(self._comm, self._storage)
        self._comm.set_domains([list(d) for d in self._topo.domains])
        # Identical on every rank (DCP's plan cache must be hit or missed by all ranks alike).
        self._instance = self._comm.broadcast(uuid.uuid4().hex if self._comm.rank == 0 else None)
        if not read_only:
            holder = self._comm.broadcast(new_holder_id() if self._comm.rank == 0 else None)
            self._holder = holder
            err = None
            if self._topo.is_leader:
                self._lease = Lease(self._storage, holder, job_identity(job_id), lease_ttl_s)
                try:
                    self._lease.acquire(lease_wait_s if lease_wait_s is not None else lease_ttl_s * 1.5,
                                        fence=self._root.fence_staging)
                    # A job that ends without close() still hands the root over at once.
                    atexit.register(self._lease.release)
                except Exception as e:  # every failure must reach the agreement
                    err = e
            agree(self._comm, err, f"take the lease on {self._storage.root}")
        self._committed: dict[int, int] = self._agreed_current()
        log.debug("ckptguard %s: %s", self._storage.root, self._topo.describe())

    # -- public API ---------------------------------------------------------------------
    @property
    def root(self) -> str:
        return self._storage.root

    @property
    def topology(self) -> Topology:
        return self._topo

    def steps(self, *, refresh: bool = False) -> list[int]:
        """Committed steps, oldest first, agreed by all ranks (committed in every storage domain).

        Not collective: the answer is the one agreed at construction and updated by
        every save and load, so rank 0 alone may call it for logging. While this
        job holds the root's lease nobody else writes to it. ``refresh=True``
        lists the root again and is collective (all ranks must call it).
        """
        if refresh:
            self.wait()
            self._committed = self._agreed_current()
        return sorted(self._committed)

    def latest(self, *, refresh: bool = False) -> int | None:
        """The newest committed step, or None (see steps() for when this is collective)."""
        steps = self.steps(refresh=refresh)
        return steps[-1] if steps else None

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        files: Mapping[str, str | os.PathLike[str]] | None = None,
        overwrite: bool = False,
        metadata: Mapping[str, Any] | None = None,
        blocking: bool = True,
        progress: bool | None = None,
    ) -> None:
        """Save ``state`` as checkpoint ``step``.

        With ``blocking=True`` it returns once the checkpoint is committed on
        every storage domain. With ``blocking=False`` it returns once the state
        (and the ``files=`` contents) are copied into host memory; writing and
        committing run in the background. ``wait()`` and the next call surface
        a background failure as CheckpointError. ``progress=True`` shows a
        progress bar on rank 0 (default: the Checkpointer's ``progress``).
        """
        self.wait()
        self._check_usable(writing=True)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        user_metadata = _json_object(metadata)
        started = time.perf_counter()
        fault_point("save_start", self._comm.rank)
        stats = self.last_save_stats = PhaseTimer()
        stats.show_progress = (self.progress if progress is None else progress) and self._comm.rank == 0
        with stats.phase("state_dict"):
            prepared = prepare_state(state, self._comm.rank)
        # A local problem (a files= path missing on this rank) must not skip the collectives
        # the other ranks are about to run: it is reported in the plan's agreement instead.
        local_error: BaseException | None = None
        targets: list[ArtifactTarget] = []
        try:
            targets = artifacts.normalize(files, self._comm.rank, hostname(), must_exist=True)
        except Exception as e:  # reported in the plan's agreement
            local_error = e
        if not blocking:
            with stats.phase("snapshot"):
                staged = self._snapshot(prepared.state_dict, targets, local_error)
            if staged is not None:
                state_dict, file_items = staged
                self._inflight = self._background.submit(
                    self._save_in_background, step, state_dict, targets, file_items, overwrite, user_metadata,
                    stats, local_error)
                stats.blocked = time.perf_counter() - started
                return
        with _gc_paused():
            self._save_now(step, prepared.state_dict, targets, targets, overwrite, user_metadata, stats,
                           local_error)
        stats.blocked = time.perf_counter() - started

    def wait(self) -> None:
        """Wait until the save started with ``blocking=False`` is committed; raise its error if it failed."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.result()

    def _snapshot(self, state_dict: dict[str, Any], targets: list[ArtifactTarget],
                  local_error: BaseException | None) -> tuple[dict[str, Any], list[Any]] | None:
        """Host copies of the state and files= contents, or None if they exceed the staging budget."""
        file_bytes = sum(os.path.getsize(p) for t in targets for p in _artifact_paths(t.path)) \
            if local_error is None else 0
        if not self._stager.fits(state_dict, file_bytes):
            if not self._warned_budget:
                self._warned_budget = True
                warnings.warn(f"ckptguard: the state ({state_nbytes(state_dict) + file_bytes:,} bytes) exceeds "
                              f"async_budget_bytes={self._stager.budget_bytes:,}; saving synchronously instead",
                              stacklevel=3)
            return None
        snapshot = self._stager.stage(state_dict)
        files = stage_files(targets) if local_error is None else []
        return snapshot, files

    def _save_in_background(self, *args: Any) -> None:
        with _gc_paused():
            self._save_now(*args)

    def _save_now(self, step: int, state_dict: dict[str, Any], targets: list[ArtifactTarget],
                  file_items: list[Any], overwrite: bool, user_metadata: dict[str, Any], stats: PhaseTimer,
                  local_error: BaseException | None) -> None:
        """The collective part of a save (in the caller's thread, or in the background)."""
        with stats.phase("plan"):
            plan = self._plan_save(step, targets, overwrite, local_error)
        with stats.phase("stage"):
            self._stage(plan)
        try:
            with stats.phase("write"), ByteProgress(stats.show_progress, f"saving step {step}",
                                                    state_nbytes(state_dict)) as bar:
                writer = self._write(plan, state_dict, file_items, bar.callback)
            stats.bytes = sum(f.size for f in writer.outcome.files)
            with stats.phase("commit"):
                self._commit(plan, writer, user_metadata)
        except CheckpointError:
            # Every rank got the same error at the same agreement point, so no rank is still
            # writing into the attempt: remove it now, or a disk-full save keeps the disk full.
            # DCP's plan cache may now differ between ranks (some cached, some not): drop it.
            self._discard_attempt(plan)
            forget_cached_plans(self._instance)
            raise
        log.debug("ckptguard: saved step %d: %s", step, stats)

    def load(
        self,
        state: Mapping[str, Any],
        *,
        step: int | None = None,
        files: Mapping[str, str | os.PathLike[str]] | None = None,
        strict: bool = True,
        progress: bool | None = None,
    ) -> int | None:
        """Load a committed checkpoint into ``state`` in place; returns its step, or None if there is none.

        With ``step=None`` the newest committed checkpoint is loaded; if it turns
        out corrupt, older ones are tried, with a warning. Loading at a different
        world size reshards.
        """
        self.wait()
        self._check_usable(writing=False)
        current = self._committed = self._agreed_current()
        if step is not None:
            if step not in current:
                raise CheckpointError(
                    f"step {step} is not a committed checkpoint in {self.root}; committed steps: "
                    f"{sorted(current) or 'none'}")
            candidates = [step]
        else:
            candidates = sorted(current, reverse=True)
        show = (self.progress if progress is None else progress) and self._comm.rank == 0
        with _gc_paused():
            return self._load_first_intact(candidates, current, state, files, strict, fallback=step is None,
                                           show_progress=show)

    def _load_first_intact(self, candidates: list[int], current: dict[int, int], state: Mapping[str, Any],
                           files: Any, strict: bool, fallback: bool, show_progress: bool) -> int | None:
        errors: list[str] = []
        for s in candidates:
            try:
                self._load_one(CheckpointName(s, current[s]), state, files, strict, show_progress)
                return s
            except CorruptCheckpointError as e:
                if not fallback:
                    raise
                errors.append(f"step {s}: {e}")
                if self._comm.rank == 0:
                    warnings.warn(f"ckptguard: checkpoint step {s} in {self.root} is corrupt ({e}); "
                                  "falling back to the previous committed checkpoint", stacklevel=3)
        if errors:
            raise CorruptCheckpointError(f"every committed checkpoint in {self.root} is corrupt: " + "; ".join(errors))
        return None

    def close(self) -> None:
        """Release the root's lease. The Checkpointer cannot save afterwards."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._wait_cleanup()
            self._cleaner.shutdown()
            self._background.shutdown()
            self._stager.release()
            forget_cached_plans(self._instance)
            if self._lease is not None:
                self._lease.release()
                atexit.unregister(self._lease.release)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- agreement on what is committed -------------------------------------------------
    def _leader_listing(self) -> dict[int, int] | None:
        if not self._topo.is_leader:
            return None
        return {s: n.version for s, n in self._root.current().items()}

    def _agreed_current(self) -> dict[int, int]:
        """{step: version} committed identically in every storage domain (collective)."""
        err: BaseException | None = None
        listing = None
        try:
            listing = self._leader_listing()
        except Exception as e:  # every failure must reach the agreement
            err = e
        gathered = self._comm.gather((local_failure(err), listing))
        decision = None
        if self._comm.rank == 0:
            assert gathered is not None
            failures = order_failures([g[0] for g in gathered])
            decision = (failures, _intersect([g[1] for g in gathered if g[1] is not None]))
        failures, agreed = self._comm.broadcast(decision)
        raise_failures(failures, f"list the checkpoints in {self.root}")
        return agreed

    # -- save phases ----------------------------------------------------------------------
    def _plan_save(self, step: int, targets: list[ArtifactTarget], overwrite: bool,
                   local_error: BaseException | None) -> _SavePlan:
        comm, topo = self._comm, self._topo
        err: BaseException | None = local_error
        leader_view = None
        try:
            if topo.is_leader:
                assert self._lease is not None
                self._lease.check()
                leader_view = ([n.version for n in self._root.committed() if n.step == step],
                               self._leader_listing())
        except Exception as e:  # every failure must reach the agreement
            err = err or e
        gathered = comm.gather((local_failure(err), targets, leader_view))
        decision = None
        if comm.rank == 0:
            assert gathered is not None
            decision = decide_plan(self.root, step, overwrite, gathered)
        error, attempt, version, uncertain, previous = comm.broadcast(decision)
        if error is not None:
            raise CheckpointError(error[0], rank=error[1])
        if uncertain:
            self._probe_shared_paths(uncertain, attempt)
        name = CheckpointName(step, version)
        return _SavePlan(step, name, attempt, self._root.staging_dir(step, attempt), targets, previous)

    def _probe_shared_paths(self, pairs: list[tuple[ArtifactTarget, ArtifactTarget]], nonce: str) -> None:
        """Same path on different hosts: a collision only if the path is on shared storage. Look."""
        comm = self._comm
        markers: list[str] = []
        err: BaseException | None = None
        try:
            for a, _ in pairs:
                if a.rank == comm.rank:
                    anchor = artifacts.probe_anchor(a.path)
                    marker = os.path.join(anchor, f".ckptguard-probe-{nonce}-{a.rank}")
                    if not os.path.exists(marker):
                        with open(marker, "x") as f:
                            f.write(nonce)
                    markers.append(marker)
        except Exception as e:  # every failure must reach the agreement
            err = e
        agree(comm, err, "leave a probe marker next to its files= path")
        seen = []
        for a, b in pairs:
            if b.rank == comm.rank:
                marker = os.path.join(artifacts.probe_anchor(a.path), f".ckptguard-probe-{nonce}-{a.rank}")
                if os.path.exists(marker):
                    seen.append((a, b))
        gathered = comm.gather(seen)
        collisions = comm.broadcast([p for g in gathered for p in g] if gathered is not None else None)
        for m in markers:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(m)
        if collisions:
            a, b = collisions[0]
            raise CheckpointError(artifacts.collision_message(a, b) + " (the path is on storage both hosts share)",
                                  rank=a.rank)

    def _stage(self, plan: _SavePlan) -> None:
        err: BaseException | None = None
        if self._topo.is_leader:
            try:
                self._root.make_staging(plan.step, plan.attempt)
            except OSError as e:
                err = explain_os_error(e, plan.staging, self._comm.rank, root=self.root)
            except Exception as e:  # every failure must reach the agreement
                err = e
        agree(self._comm, err, f"create the attempt directory for step {plan.step}", self._intact(plan))

    def _write(self, plan: _SavePlan, state_dict: dict[str, Any], file_items: list[Any],
               on_bytes: Callable[[int], None] | None = None) -> GuardedWriter:
        rank = self._comm.rank

        def before_write() -> tuple[list[Artifact], list[FileEntry]]:
            # The leader created the attempt directory; on NFS another node may not see it yet.
            self._storage.wait_visible(os.path.join(plan.staging, layout.DATA_DIR),
                                       timeout=self.visibility_timeout_s)
            try:
                return artifacts.store(file_items, plan.staging, self.checksum)
            except OSError as e:
                raise explain_os_error(e, plan.staging, rank, root=self.root) from None

        writer = GuardedWriter(plan.staging, rank, self.checksum, self.io_threads, before_write,
                               error_root=self.root, on_bytes=on_bytes)
        planner = DomainSavePlanner([self._topo.domain_of(r) for r in range(self._comm.world_size)],
                                    cache_key=self._instance)
        plan_collectively(state_dict, writer, planner, self._comm,
                          suffix=self._intact(plan), what=f"plan step {plan.step}")
        # A failure while writing is not raised here: it travels in the commit's first gather,
        # which is the agreement on the write phase.
        try:
            writer.write_planned(planner)
            writer.digests = planner.replicated_digests()
        except Exception as e:  # every failure must reach the agreement
            writer.error = self._fenced_or(e)
        return writer

    def _commit(self, plan: _SavePlan, writer: GuardedWriter, user_metadata: dict[str, Any]) -> None:
        comm, topo = self._comm, self._topo
        arts, art_files = writer.outcome.extra or ([], [])
        mine_writes = _RankWrites(writer.outcome.files + art_files, arts, writer.digests, writer.stored)
        gathered = comm.gather((local_failure(writer.error), mine_writes))
        manifests: list[Any] | None = None
        if comm.rank == 0:
            assert gathered is not None
            failures = order_failures([g[0] for g in gathered])
            diverged = None if failures else check_replicated([g[1].digests for g in gathered])
            if failures:
                manifests = [("failed", failures)] * comm.world_size
            elif diverged is not None:
                manifests = [("diverged", diverged)] * comm.world_size
            else:
                assert writer.metadata is not None
                built = build_manifests(topo, plan.name, plan.attempt, self.checksum,
                                        [g[1] for g in gathered], user_metadata, metadata_to_json(writer.metadata))
                manifests = [built.get(r) for r in range(comm.world_size)]
        # Rank 0 keeps its own part: pickling a manifest of 20,000 items to send it to itself
        # cost ~0.07 s of every save.
        own = manifests[0] if manifests is not None else None
        mine: Any = comm.scatter([None, *manifests[1:]] if manifests is not None else None)
        if comm.rank == 0:
            mine = own
        if isinstance(mine, tuple):
            kind, detail = mine
            if kind == "failed":
                raise_failures(detail, f"write its part of step {plan.step}", self._intact(plan))
            raise CheckpointError(with_suffix(detail, self._intact(plan)))
        err: BaseException | None = None
        listing = None
        published = False
        if topo.is_leader:
            assert mine is not None and self._lease is not None
            try:
                self._lease.check()
                self._root.wait_files_visible(plan.staging, mine.files, self.visibility_timeout_s)
                self._root.write_manifest(plan.staging, mine)
                fault_point("before_publish", comm.rank)
                self._root.publish(plan.staging, plan.name)
                published = True
                fault_point("after_publish", comm.rank)
                listing = self._leader_listing()
            except OSError as e:
                err = self._fenced_or(explain_os_error(e, plan.staging, comm.rank, root=self.root))
            except Exception as e:  # every failure must reach the agreement
                err = self._fenced_or(e)
        gathered2 = comm.gather((local_failure(err), listing))
        decision = None
        if comm.rank == 0:
            assert gathered2 is not None
            failures = order_failures([g[0] for g in gathered2])
            agreed = _intersect([g[1] for g in gathered2 if g[1] is not None]) if not failures else {}
            decision = (failures, retention(agreed, plan.step, self.keep_last, self.keep_every), agreed)
        failures, doomed, agreed = comm.broadcast(decision)
        if failures:
            if published:  # another domain failed: this step is not committed anywhere, roll back
                try:
                    self._root.invalidate(self._root.dir(plan.name))
                except OSError as e:
                    log.warning("ckptguard: could not roll back %s: %s", self._root.dir(plan.name), e)
            raise_failures(failures, f"commit step {plan.step}", self._intact(plan))
        self._committed = {s: v for s, v in agreed.items() if s not in doomed}
        if topo.is_leader:
            self._finish(plan, doomed)

    def _fenced_or(self, err: BaseException) -> BaseException:
        """A failure inside a save may be the fence of another job's takeover (it moved our
        staging directory away): say so, rather than show the file that vanished."""
        if isinstance(err, CheckpointError) and "no longer holds the lease" in str(err):
            return err
        holder = getattr(self, "_holder", None)
        if holder is None:
            return err
        try:
            rec = LeaseRecord.from_bytes(self._storage.read_bytes(self._storage.path(layout.LEASE)))
        except OSError:
            return err
        if rec is not None and rec.holder != holder:
            fenced = CheckpointError(
                f"this job no longer holds the lease on {self.root}: {rec.describe()} took it over (this "
                f"job's lease expired: it stalled, or its renewals failed), and moved this save's attempt "
                f"away; nothing of this save was committed. The failure it caused: {describe_error(err)}",
                path=self._storage.path(layout.LEASE))
            fenced.__cause__ = err
            return fenced
        return err

    def _discard_attempt(self, plan: _SavePlan) -> None:
        if self._topo.is_leader:
            try:
                self._root.invalidate(plan.staging)
            except (OSError, CheckpointError) as e:
                log.warning("ckptguard: could not remove the failed attempt %s: %s", plan.staging, e)

    def _finish(self, plan: _SavePlan, doomed: list[int]) -> None:
        """After a commit: move `latest`, retire what is no longer needed, free it in the background.

        Retiring (an atomic rename into trash) of old checkpoints, superseded
        versions and leftovers of crashed attempts happens now, so that when
        save() returns the retention policy holds and no attempt is left in
        staging. Removing the bytes takes as long as the filesystem needs: that
        runs in a background thread, which every later call waits for first.
        """
        retired: list[str] = []
        try:
            self._root.move_latest(plan.name)
            fault_point("after_commit", self._comm.rank)
            doomed_dirs = [self._root.dir(n) for n in self._root.committed()
                           if n.step in doomed or (n.step == plan.step and n.version < plan.name.version)]
            garbage = self._root.garbage()
            for path in doomed_dirs + garbage.staging + garbage.superseded + garbage.probes:
                retired_path = self._root.retire(path)
                if retired_path is not None:
                    retired.append(retired_path)
            retired.extend(garbage.trash)
        except (OSError, CheckpointError) as e:
            log.warning("ckptguard: step %d is committed, but retention in %s failed: %s", plan.step, self.root, e)
        self._cleanup = self._cleaner.submit(self._remove_retired, retired, plan.step)

    def _remove_retired(self, retired: list[str], step: int) -> None:
        for path in retired:
            try:
                self._storage.remove_tree(path)
            except (OSError, CheckpointError) as e:
                log.warning("ckptguard: step %d is committed, but removing %s failed: %s", step, path, e)

    def _wait_cleanup(self) -> None:
        if self._cleanup is not None:
            self._cleanup.result()
            self._cleanup = None

    def _intact(self, plan: _SavePlan) -> str:
        if plan.previous is None:
            return " Nothing was committed."
        return f" Nothing was committed; the previous checkpoint, step {plan.previous}, is intact."

    # -- load -----------------------------------------------------------------------------
    def _load_one(self, name: CheckpointName, state: Mapping[str, Any],
                  files: Mapping[str, Any] | None, strict: bool, show_progress: bool = False) -> None:
        comm, topo = self._comm, self._topo
        self.last_load_stats = PhaseTimer()
        started = time.perf_counter()
        err: BaseException | None = None
        raw: bytes | None = None
        stop_read_ahead: Callable[[], None] | None = None
        if topo.is_leader:
            try:
                raw = self._root.read_manifest_bytes(name)
            except Exception as e:  # every failure must reach the agreement
                err = e
        # The leader reads; every rank of the domain parses and checks the same bytes at once
        # (bytes travel far faster than a pickled object graph of one entry per tensor chunk).
        raw = comm.domain_broadcast(raw, list(topo.domain))
        if raw is not None:
            # A rank mostly reads what the rank of its number wrote: read those files into the
            # page cache while the manifest is checked and the load planned, and stop once the
            # real reads start (not before the manifest was read: it would wait behind them).
            data_prefix = layout.data_file_prefix(comm.rank)
            stop_read_ahead = read_ahead(os.path.join(self._root.dir(name), os.path.dirname(data_prefix)),
                                         os.path.basename(data_prefix))
        try:
            self._load_from_manifest(name, raw, err, state, files, strict, show_progress, started,
                                     on_planned=stop_read_ahead)
        finally:
            if stop_read_ahead is not None:
                stop_read_ahead()

    def _load_from_manifest(self, name: CheckpointName, raw: bytes | None, err: BaseException | None,
                            state: Mapping[str, Any], files: Mapping[str, Any] | None, strict: bool,
                            show_progress: bool, started: float,
                            on_planned: Callable[[], None] | None) -> None:
        """The rest of `_load_one`, once the leader's manifest bytes (or its error) reached every rank."""
        comm, topo, stats = self._comm, self._topo, self.last_load_stats
        manifest: Manifest | None = None
        if raw is not None:
            try:
                manifest = self._root.parse_manifest(name, raw)
                if topo.is_leader:
                    self._root.check_files(name, manifest)
            except Exception as e:  # every failure must reach the agreement
                err = e
        agree(comm, err, f"read checkpoint {name.dirname} in {self.root}")
        assert manifest is not None
        err = None
        targets: list[ArtifactTarget] = []
        try:
            targets = artifacts.normalize(files, comm.rank, hostname(), must_exist=False)
            if targets and manifest.world_size != comm.world_size:
                raise CheckpointError(
                    f"step {name.step} was saved by {manifest.world_size} ranks and this job has "
                    f"{comm.world_size}: per-rank files= artifacts cannot be resharded", rank=comm.rank)
        except Exception as e:  # every failure must reach the agreement
            err = e
        gathered = comm.gather((local_failure(err), targets))
        verdict = None
        if comm.rank == 0:
            assert gathered is not None
            failures = order_failures([g[0] for g in gathered])
            certain, _ = artifacts.find_collisions([t for g in gathered for t in g[1]])
            verdict = (failures, artifacts.collision_message(*certain[0]) if certain else None)
        failures, collision = comm.broadcast(verdict)
        raise_failures(failures, f"load step {name.step}")
        if collision:
            raise CheckpointError(collision.replace("on save and on restore", "on restore"))
        stats.seconds["manifest"] = time.perf_counter() - started
        with stats.phase("metadata"):
            metadata = metadata_from_json(manifest.dcp, manifest.items)
            prepared = prepare_state(state, comm.rank)
        err = None
        with ByteProgress(show_progress, f"loading step {name.step}", None) as bar:
            reader = GuardedReader(self._root.dir(name), metadata, manifest.checksum_algorithm, comm.rank,
                                   self.io_threads, on_bytes=bar.callback)
            try:
                read_locally(prepared.state_dict, reader, SafeLoadPlanner(allow_partial_load=not strict),
                             is_coordinator=comm.rank == 0, stats=stats, before_read=on_planned)
            except Exception as e:  # every failure must reach the agreement
                err = e
        agree(comm, err, f"load step {name.step}")
        # files= artifacts in two phases: every rank stages verified copies, then all rename them
        # into place, so a corrupt artifact anywhere changes nothing before load falls back.
        err = None
        staged: list[tuple[str, str]] = []
        try:
            staged = artifacts.stage_restore(targets, manifest, self._root.dir(name))
        except OSError as e:
            err = explain_os_error(e, self._root.dir(name), comm.rank)
        except Exception as e:  # every failure must reach the agreement
            err = e
        failures = gather_failures(comm, err)
        if failures:
            artifacts.abort_restore(staged)
            raise_failures(failures, f"restore its files= artifacts from step {name.step}")
        err = None
        try:
            artifacts.commit_restore(staged)
        except OSError as e:
            err = explain_os_error(e, self._root.dir(name), comm.rank)
        except Exception as e:  # every failure must reach the agreement
            err = e
        agree(comm, err, f"move its restored files= artifacts of step {name.step} into place")
        with stats.phase("apply"):
            prepared.apply()
        stats.bytes = sum(i.length for i in manifest.items)
        log.debug("ckptguard: loaded step %d: %s", name.step, stats)

    # -- helpers ----------------------------------------------------------------------------
    def _check_usable(self, writing: bool) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")
        self._wait_cleanup()
        if writing and self.read_only:
            raise CheckpointError(f"this Checkpointer on {self.root} was opened read_only=True")


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_was_enabled = True


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic GC during a save or load (reference-counted: background saves nest with the caller's).

    A save allocates many small objects (plans, write items, manifest rows); with
    a large heap (a model, its optimizer), each generation-2 collection they
    trigger walks everything, which cost ~10% of a save of 20,000 tensors. The
    pause lasts one save; reference counting frees everything acyclic meanwhile.
    """
    global _gc_depth, _gc_was_enabled
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_enabled:
                gc.enable()


class PhaseTimer:
    """Wall time per phase of the last save or load (``Checkpointer.last_save_stats``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.bytes = 0
        self.blocked = 0.0  # how long save() kept the caller waiting
        self.show_progress = False

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def __repr__(self) -> str:
        parts = ", ".join(f"{k} {v:.3f}s" for k, v in self.seconds.items())
        return (f"{self.total:.3f}s ({parts}), caller blocked {self.blocked:.3f}s, "
                f"{self.bytes} bytes on this rank")


def decide_plan(root: str, step: int, overwrite: bool, gathered: list[Any]) -> tuple[Any, ...]:
    """Rank 0: the verdict on a save before anything is written.

    ``gathered[r]`` is rank r's (failure, files= targets, leader view); the
    verdict is (error, attempt id, version, uncertain collisions, previous step).
    """
    failures = order_failures([g[0] for g in gathered])
    listings = [g[2][1] for g in gathered if g[2] is not None]
    agreed = _intersect(listings)
    previous = max(agreed) if agreed else None
    if failures:
        f = failures[0]
        return ((f"rank {f.rank} on {f.host} cannot save step {step}: {f.message}", f.rank),
                None, 0, [], previous)
    versions = [v for g in gathered if g[2] is not None for v in g[2][0]]
    if step in agreed and not overwrite:
        return ((f"step {step} is already committed in {root} "
                 f"({CheckpointName(step, agreed[step]).dirname}); committed checkpoints are never "
                 "modified. Pass overwrite=True to replace it atomically.", None), None, 0, [], previous)
    all_targets = [t for g in gathered for t in g[1]]
    certain, uncertain = artifacts.find_collisions(all_targets)
    if certain:
        a, b = certain[0]
        return ((artifacts.collision_message(a, b), a.rank), None, 0, [], previous)
    version = max(versions) + 1 if versions else 1
    return (None, uuid.uuid4().hex, version, uncertain, previous)


def retention(agreed: dict[int, int], new_step: int, keep_last: int | None, keep_every: int | None) -> list[int]:
    """Rank 0: which committed steps to delete now that ``new_step`` is committed everywhere."""
    steps = sorted(agreed)
    if keep_last is None or new_step not in agreed:
        keep = set(steps)
    else:
        keep = set(steps[-keep_last:])
        if keep_every:
            keep |= {s for s in steps if s % keep_every == 0}
        keep.add(new_step)
    return [s for s in steps if s not in keep]


def _artifact_paths(path: str) -> list[str]:
    if os.path.isdir(path):
        return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if os.path.isfile(os.path.join(d, f))]
    return [path] if os.path.isfile(path) else []


def _intersect(listings: list[dict[int, int]]) -> dict[int, int]:
    """Steps committed with the same version in every domain."""
    if not listings:
        return {}
    common = set(listings[0].items())
    for other in listings[1:]:
        common &= set(other.items())
    return dict(common)


def _json_object(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    try:
        text = json.dumps(dict(metadata), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"metadata must be JSON-serializable: {e}") from None
    return json.loads(text)


def build_manifests(
    topo: Topology,
    name: CheckpointName,
    attempt: str,
    algorithm: str,
    writes: list[_RankWrites],
    user_metadata: dict[str, Any],
    dcp_json: dict[str, Any],
) -> dict[int, Manifest]:
    """Rank 0: one manifest per storage domain, keyed by the domain leader's rank.

    Each domain's manifest lists only the files its ranks wrote (replicated
    tensors were written once per domain), with DCP's metadata shared by all.
    """
    now = time.time()
    out: dict[int, Manifest] = {}
    for index, domain in enumerate(topo.domains):
        items: list[StoredItem] = []
        files: list[FileEntry] = []
        arts: list[Artifact] = []
        for r in domain:
            items.extend(writes[r].items)
            files.extend(writes[r].files)
            arts.extend(writes[r].artifacts)
        out[domain[0]] = Manifest(
            step=name.step, version=name.version, attempt=attempt, created_at=now,
            world_size=topo.world_size, domain_index=index, domain_count=len(topo.domains),
            domain_ranks=list(domain), hosts=list(topo.hosts), checksum_algorithm=algorithm,
            dcp=dcp_json, files=files, items=items, artifacts=arts, user_metadata=user_metadata,
        )
    return out
