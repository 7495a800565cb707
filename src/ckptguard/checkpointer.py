"""`Checkpointer`: the facade of the save/load protocol (lifecycle, sync and async dispatch).

Every public method is collective when a process group is initialised: all
ranks call it with the same arguments. The protocol itself lives in
:mod:`ckptguard.protocol` (``save.py``, ``load.py``, rank 0's decisions in
``decisions.py``); this module only checks arguments (``arguments.py``), prepares the state,
runs saves in the caller's thread or in the background, and keeps what every
rank agreed is committed.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from ckptguard import inflight
from ckptguard._faults import FaultPhase, fault_point
from ckptguard._signals import signals_deferred
from ckptguard.arguments import Settings, check_kinds, checksum_name, count, json_object, required, seconds
from ckptguard.comm import DEFAULT_TIMEOUT_S, Comm, LocalTransport, default_comm, hostname, was_agreed
from ckptguard.dcp.planners import forget_cached_plans
from ckptguard.dcp.reader import auto_memory_bytes
from ckptguard.dcp.values import refuse_flat_collisions, refuse_unsavable
from ckptguard.errors import CheckpointError, InvalidArgumentError
from ckptguard.heartbeat import heartbeat
from ckptguard.protocol import artifacts, manage
from ckptguard.protocol import load as load_protocol
from ckptguard.protocol import read as read_protocol
from ckptguard.protocol import save as save_protocol
from ckptguard.protocol.artifacts import ArtifactTarget
from ckptguard.protocol.decisions import Listing, commit_order
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.lease import release_at_exit
from ckptguard.protocol.root import open_root
from ckptguard.protocol.session import Options, Session, open_session
from ckptguard.protocol.timing import PhaseTimer, gc_paused
from ckptguard.protocol.topology import Topology
from ckptguard.staging import DeviceStager, HostStager
from ckptguard.state import prepare_state

log = logging.getLogger("ckptguard")


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _collective(only_with: str | None = None) -> Callable[[_Method], _Method]:
    """A collective call (only when keyword ``only_with`` is true, if given): refused once this
    rank's calls are out of step with the others', and marks them so when a Ctrl-C (or another
    exception that is not an Exception) leaves it on this rank at a point the others did not agree
    on: they may still be inside it, and the next collective here would pair with a different one
    there (a load's with a save's: a hang, or another call's answers)."""

    def wrap(method: _Method) -> _Method:
        @functools.wraps(method)
        def call(self: Checkpointer, *args: Any, **kwargs: Any) -> Any:
            if only_with is not None and not kwargs.get(only_with):
                return method(self, *args, **kwargs)
            self._refuse_in_a_forked_child(method.__name__)
            if self._out_of_step is not None:
                raise CheckpointError(self._out_of_step, rank=self._comm.rank)
            try:
                return method(self, *args, **kwargs)
            except BaseException as e:
                if not isinstance(e, Exception) and self._comm.world_size > 1 and not was_agreed(e):
                    self._out_of_step = (
                        f"rank {self._comm.rank}: a {type(e).__name__} ended {method.__name__}() on this rank "
                        "at a point the other ranks did not agree on; they may still be inside it, so this "
                        "Checkpointer's ranks are out of step (its next collective would pair with a different "
                        "one on another rank). The others raise PeerError within collective_timeout_s. Create "
                        "a new Checkpointer on every rank, or end the job.")
                raise
        return call  # type: ignore[return-value]
    return wrap


class Checkpointer(Settings):
    """Race-free, crash-safe checkpoints in one root directory.

    ``Checkpointer("/shared/ckpts", keep_last=3)`` works with or without an
    initialised process group. Constructing it is collective: the ranks probe
    which of them share the root, and each storage domain's leader takes the
    root's lease (pass ``read_only=True`` to only load and list).
    ``root`` may be ``s3://bucket/prefix`` (S3 or an S3-compatible store;
    ``storage_options={"endpoint_url": ...}`` or the usual AWS settings).
    ``checksum`` defaults to xxh3-64 on filesystems and crc32c on object stores.
    ``process_group`` (default: all ranks, through a gloo group ckptguard
    creates) must be a gloo group if given; every member calls every method.
    ``process_group="local"`` makes it rank-local: no collective at all, for code
    that checkpoints from one rank (``if rank == 0: ...``, Lightning's
    ``CheckpointIO``); the lease still keeps a second writer out of the root.
    ``collective_timeout_s`` bounds how long ranks wait for a rank that died or
    stalled, on the group ckptguard creates (a group passed in keeps its own).
    ``load_memory_bytes`` (per rank) is how much of a load is read once, verified, and held
    (scratch, or the old bytes of tensors read in place) until every rank agreed;
    the rest is verified in a first pass and read into place in a second from
    the files kept open or a local spill (docs/performance.md). Default None: on
    filesystems 0 while the rank's bytes times the host's ranks fit half of
    MemAvailable (the page cache serves the second pass: measured faster than
    holding bytes in fresh memory), else 256 MiB; on object stores half of
    MemAvailable shared by the host's ranks.
    A blocking save of CUDA tensors copies them in one bulk copy into pinned host buffers kept
    between saves (the async saves' buffers where those fit): one host copy of the rank's device
    tensors, at most ``async_budget_bytes`` (default: half of MemAvailable shared by the host's
    ranks); a state over it is copied tensor by tensor as it is written.
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
        checksum: str | None = None,
        visibility_timeout_s: float = 60.0,
        async_budget_bytes: int | None = None,
        load_memory_bytes: int | None = None,
        progress: bool = False,
        collective_timeout_s: float = DEFAULT_TIMEOUT_S,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        keep_last = count("keep_last", keep_last, 1, "the newest checkpoint is always kept", optional=True)
        keep_every = count("keep_every", keep_every, 1, optional=True)
        io_threads = required(count("io_threads", io_threads, 1))
        load_memory_bytes = count("load_memory_bytes", load_memory_bytes, 0, optional=True)
        async_budget_bytes = count("async_budget_bytes", async_budget_bytes, 0, optional=True)
        visibility_timeout_s = seconds("visibility_timeout_s", visibility_timeout_s)
        lease_ttl_s = seconds("lease_ttl_s", lease_ttl_s)
        collective_timeout_s = seconds("collective_timeout_s", collective_timeout_s)
        if lease_wait_s is not None:
            lease_wait_s = seconds("lease_wait_s", lease_wait_s, allow_zero=True)
        check_kinds(root, read_only=read_only, progress=progress, job_id=job_id, process_group=process_group)
        croot = open_root(root, storage_options)  # refuses unknown URL schemes before any collective
        storage = croot.storage
        checksum = checksum_name(checksum if checksum is not None else croot.default_checksum)
        location = croot.location()
        if location == "not a directory":
            raise CheckpointError(f"the root {storage.root} is a file, not a directory: a checkpoint root is a "
                                  "directory (a new one is created where nothing exists yet). Give the directory "
                                  "the checkpoints are in, or load a single file with ckptguard.load_file",
                                  path=storage.root)
        if read_only and location == "missing":
            log.warning("ckptguard: the read_only root %s does not exist: there is nothing to load or list "
                        "(a typo in the path?)", storage.root)
        self._progress = progress
        self._read_only = read_only
        options = Options(keep_last, keep_every, io_threads, checksum, visibility_timeout_s, load_memory_bytes)
        comm = Comm(LocalTransport()) if isinstance(process_group, str) and process_group == "local" \
            else default_comm(process_group, collective_timeout_s)
        self._session: Session = open_session(comm, croot, options, read_only=read_only, job_id=job_id,
                                              lease_ttl_s=lease_ttl_s, lease_wait_s=lease_wait_s)
        self._comm = self._session.comm
        self._exit_release: Callable[[], None] | None = None
        if self._session.lease is not None:
            # A job that ends without close() still hands the root over at once (bounded: see lease).
            self._exit_release = functools.partial(release_at_exit, self._session.lease)
            atexit.register(self._exit_release)
        self._pid = os.getpid()  # the process it belongs to (a fork's child inherits the object, not it)
        self._closed = False
        self._released = False  # close() ran to its end (it can be interrupted and called again)
        self._out_of_step: str | None = None  # why this rank's collective calls are refused (see _collective)
        self._cleaner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptguard-cleanup")
        self._cleanup: Future[None] | None = None
        self._cleanup_lock = threading.Lock()  # the background save sets it, any call may wait for it
        # Saves with blocking=False: one at a time, from host buffers reused across saves.
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptguard-save")
        self._inflight: Future[None] | None = None
        self._stager = HostStager(async_budget_bytes)
        # Blocking saves of device tensors: one bulk copy into reused pinned buffers (see DeviceStager).
        local_ranks = self.topology.hosts.count(self.topology.hosts[self.topology.rank])
        self._device_stager = DeviceStager(
            (lambda: async_budget_bytes) if async_budget_bytes is not None else
            functools.partial(auto_memory_bytes, local_ranks))
        self._last_save_stats: PhaseTimer | None = None
        self._last_load_stats: PhaseTimer | None = None
        self._committed: Listing = save_protocol.agreed_current(self._session)
        self._tags: manage.Tags = manage.read_tags(self._session)
        inflight.track(self)
        log.debug("ckptguard %s: %s", self.root, self.topology.describe())

    @property
    def last_save_stats(self) -> PhaseTimer | None:
        """The time of each phase of the last save (None before the first)."""
        return self._last_save_stats

    @property
    def last_load_stats(self) -> PhaseTimer | None:
        """The time of each phase of the last load (None before the first)."""
        return self._last_load_stats

    # -- public API ---------------------------------------------------------------------
    @property
    def topology(self) -> Topology:
        return self._session.topo

    @_collective(only_with="refresh")
    def steps(self, *, refresh: bool = False) -> list[int]:
        """Committed steps in commit order (the last one was committed last: the one load() resumes),
        agreed by all ranks (committed in every storage domain).

        Commit order is not step order after a rollback: ``load(step=100)`` and a
        save of step 110 while 200 and 300 exist give ``[100, 200, 300, 110]``.

        Not collective: the answer is the one agreed at construction and updated by
        every save and load, so rank 0 alone may call it for logging. While this
        job holds the root's lease nobody else writes to it. ``refresh=True``
        lists the root again and is collective (all ranks must call it).
        """
        if refresh:
            self.wait()
            self._committed = save_protocol.agreed_current(self._session)
        return commit_order(self._committed)

    def latest(self, *, refresh: bool = False) -> int | None:
        """The step committed last, or None (see steps() for when this is collective)."""
        steps = self.steps(refresh=refresh)
        return steps[-1] if steps else None

    @_collective()
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
        # The previous save's removal of retired steps may go on while this one takes its host copy:
        # the save itself (_save_now) waits for it before it touches storage.
        self._check_usable(writing=True, wait_cleanup=False)
        started = time.perf_counter()
        heartbeat()  # progress for `ckptguard run --hang-timeout`: a save is not a hang
        fault_point(FaultPhase.SAVE_START, self._comm.rank)
        show = (self.progress if progress is None else progress) and self._comm.rank == 0
        stats = self._last_save_stats = PhaseTimer(show)
        # A local problem (a step, metadata= or value this rank cannot save, a files= path missing on this
        # rank) must not skip the collectives the other ranks are about to run: it is reported in the
        # plan's agreement, where every rank raises it at once.
        local_error: BaseException | None = None
        user_metadata: dict[str, Any] = {}
        try:
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise InvalidArgumentError(f"step must be a non-negative int, got {step!r} on rank {self._comm.rank}",
                                           rank=self._comm.rank)
            user_metadata = json_object(metadata, self._comm.rank)
        except Exception as e:  # reported in the plan's agreement
            local_error = e
            step = step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else -1
        state_dict: dict[str, Any] = {}
        with stats.phase("state_dict"):
            try:
                prepared = prepare_state(state, self._comm.rank)
                state_dict = prepared.state_dict
                # DCP gives a never-stepped optimizer a state to save (one step at learning rate 0); it is
                # saved without it (prepare_state) and left without it here (left with it, its next real
                # step was its second: Adam's bias correction changed).
                prepared.undo()
                refuse_unsavable(state_dict)
                if not blocking:  # planned in the background: refused here, not at wait()
                    refuse_flat_collisions(state_dict)
            except Exception as e:  # reported in the plan's agreement
                local_error = local_error or e
        targets: list[ArtifactTarget] = []
        try:
            targets = artifacts.normalize(files, self._comm.rank, hostname(), True, self._session.root.local_dir())
        except Exception as e:  # reported in the plan's agreement
            local_error = local_error or e
        staged = None
        if not blocking and local_error is None:
            with stats.phase("snapshot"):
                try:
                    staged = self._stager.snapshot(state_dict, targets)
                except Exception as e:  # a files= entry that cannot be read, a tensor torch cannot copy:
                    local_error = e    # reported in the plan's agreement, as by a blocking save
            if staged is not None:
                self._device_stager.release()  # one host copy of the state, not two
                # The settings at the call: one changed once save() returned applies from the next save.
                request = save_protocol.SaveRequest(step, staged[0], targets, staged[1], overwrite, user_metadata,
                                                    local_error, frozenset(self._tags.values()),
                                                    self._session.options)
                try:
                    with signals_deferred():  # submitted and recorded, or neither: never a save unrecorded
                        self._inflight = self._background.submit(self._save_now, request, stats)
                except RuntimeError:  # the interpreter is exiting (a thread that outlived the main one): now
                    self._save_now(request, stats)
                stats.blocked = time.perf_counter() - started
                return
        if local_error is None and self._device_stager.applies(state_dict):
            with stats.phase("device copy"):
                try:
                    state_dict = self._device_stager.stage(state_dict, self._stager) or state_dict
                except Exception as e:  # reported in the plan's agreement, like any local problem
                    local_error = e
        request = save_protocol.SaveRequest(step, state_dict, targets, targets, overwrite, user_metadata,
                                            local_error, frozenset(self._tags.values()))
        self._save_now(request, stats)
        stats.blocked = time.perf_counter() - started

    def pending_save(self) -> Future[None] | None:
        """The background save not yet waited for, if any (what the at-exit check inspects)."""
        return self._inflight

    def wait(self) -> None:
        """Wait until the save started with ``blocking=False`` is committed; raise its error if it failed.

        Every failure is a CheckpointError (a rank that died is a PeerError); a
        KeyboardInterrupt in the background save stays one. A Ctrl-C while waiting
        leaves the save in flight: the next ``save``, ``load`` or ``wait`` waits for it.
        """
        self._refuse_in_a_forked_child("wait")
        inflight = self._inflight
        if inflight is None:
            return
        try:
            inflight.result()
        except BaseException as e:
            if not inflight.done():
                # A Ctrl-C while waiting: the save goes on, and stays the one the next save, load or
                # wait() waits for (forgotten, a save after it ran beside it and committed first).
                raise
            self._inflight = None
            if isinstance(e, CheckpointError | KeyboardInterrupt | SystemExit):
                raise
            raise CheckpointError(f"the background save to {self.root} failed: {type(e).__name__}: {e}") from e
        self._inflight = None

    @_collective()
    def load(
        self,
        state: Mapping[str, Any],
        *,
        step: int | None = None,
        files: Mapping[str, str | os.PathLike[str]] | None = None,
        strict: bool = True,
        progress: bool | None = None,
        tag: str | None = None,
    ) -> int | None:
        """Load a committed checkpoint into ``state`` in place; returns its step, or None if there is none.

        With ``step=None`` the checkpoint committed last is loaded; if it turns
        out corrupt, older ones are tried, with a warning; if it is retired while
        being read (a read-only job next to a writer's retention), the root is
        listed again and the newest loaded. ``load(step=N)`` raises
        StepRetiredError then. ``tag="best"`` loads the step the tag names.
        Loading at a different world size reshards.

        A failed load leaves ``state`` (and ``files=`` destinations) exactly as
        they were: every byte is read and verified on every rank before the load is
        agreed, and tensors read in place get their old bytes back if it is not
        (see ``load_memory_bytes`` in docs/performance.md).
        """
        self.wait()
        self._check_usable(writing=False)
        heartbeat()  # progress for `ckptguard run --hang-timeout`: a load is not a hang
        step, self._tags = manage.tagged_step(self._session, tag, step, self._tags)
        show = (self.progress if progress is None else progress) and self._comm.rank == 0
        with gc_paused():
            loaded, stats, current = load_protocol.load(self._session, step, state, files, strict, show)
        self._committed = current
        heartbeat()
        if stats is not None:
            self._last_load_stats = stats
        return loaded

    @_collective()
    def read(self, step: int | None = None, *, tag: str | None = None,
             keys: Collection[str] | None = None) -> dict[str, Any] | None:
        """The stored state dict of a committed checkpoint, without a template; None if there is none.

        Nested as saved, every value as given to ``save`` (int and tuple keys, tuples, numpy, RNG
        states); modules and optimizers as state dicts, tensors whole on the CPU; ``PerRank`` values
        this rank's own. Verified as in ``load``; ``step=None`` falls back past a corrupt newest one.
        ``keys``: only these top-level keys (e.g. the small part beside a sharded rest that ``load``
        puts into the modules).
        """
        if isinstance(keys, str | bytes):  # a string is a collection of its characters: never meant
            raise TypeError(f"keys must be a collection of top-level keys, e.g. keys=[{keys!r}], not a string")
        self.wait()
        self._check_usable(writing=False)
        step, self._tags = manage.tagged_step(self._session, tag, step, self._tags)
        keep = None if keys is None else frozenset(keys).__contains__
        with gc_paused():
            _, state, self._committed = read_protocol.read(self._session, step, keep)
        return state

    def path(self, step: int) -> str:
        """The directory of committed ``step`` (its current version). Not collective."""
        read_protocol.require_committed(self._session, step, self._committed)
        return self._session.root.dir(CheckpointName(step, self._committed[step].version))

    @_collective()
    def metadata(self, step: int) -> dict[str, Any]:
        """The ``metadata=`` given to the save of committed ``step``; collective (rank 0 reads it).
        Waits for a save in flight first, as ``read`` does (it may be the one asked for)."""
        self.wait()
        return read_protocol.read_metadata(self._session, step, self._committed)

    @_collective()
    def delete(self, step: int) -> None:
        """Delete committed ``step`` (every version) on every storage domain; collective.

        The step disappears for every reader at once (renamed into the trash, then
        removed); ``latest`` moves back to the newest step left if it named this one.
        A tagged step is refused: move or remove its tag first.
        """
        self.wait()
        self._check_usable(writing=True)
        current = self._committed = save_protocol.agreed_current(self._session)
        self._tags = manage.read_tags(self._session)
        self._committed, retired = manage.delete_step(self._session, step, current, self._tags)
        self._remove_retired(retired, step)

    @_collective()
    def tag(self, name: str, step: int, *, expect: Any = ...) -> int | None:
        """Point tag ``name`` (e.g. ``"best"``) at committed ``step``; the step it named before (or None).

        Stored durably in every storage domain and moved by compare-and-swap;
        ``expect=N`` moves it only if it names step N now (``expect=None``: only if
        it does not exist yet). A tagged step is kept by retention. Collective.
        """
        self.wait()
        self._check_usable(writing=True)
        current = self._committed = save_protocol.agreed_current(self._session)
        before = manage.set_tag(self._session, name, step, current, expect)
        self._tags = manage.read_tags(self._session)
        return before

    @_collective()
    def untag(self, name: str) -> int | None:
        """Remove tag ``name``; the step it named (or None). Collective."""
        self.wait()
        self._check_usable(writing=True)
        before = manage.set_tag(self._session, name, None, self._committed)
        self._tags = manage.read_tags(self._session)
        return before

    @_collective(only_with="refresh")
    def tags(self, *, refresh: bool = False) -> dict[str, int]:
        """{tag: step}, agreed by all ranks; like steps(), collective only with ``refresh=True``."""
        if refresh:
            self.wait()
            self._tags = manage.read_tags(self._session)
        return dict(sorted(self._tags.items()))

    def check_lease(self, acting: str = "change the root") -> None:
        """Raise LeaseLostError (as a fenced save does) unless this job still holds the root's lease.

        For code that changes what sits beside the root (an integration removing or replacing the
        visible copy of a checkpoint, clearing its staging directory): call it right before each such
        step, so that a job that stalled while another job took the root over removes nothing the new
        holder can see. ``acting`` completes the message ("refusing to <acting>"). Not collective;
        on a rank that is not its storage domain's leader (which holds the lease) it checks nothing.
        A read_only or closed Checkpointer raises CheckpointError.
        """
        if self._closed:  # (not _check_usable: the removal of retired steps may go on meanwhile)
            raise CheckpointError("this Checkpointer is closed")
        if self.read_only:
            raise CheckpointError(f"this Checkpointer on {self.root} was opened read_only=True: it holds no lease")
        lease = self._session.lease
        if lease is not None:
            lease.check(acting=acting, renew=False)

    def close(self) -> None:
        """Release the root's lease. The Checkpointer cannot save afterwards. A close() interrupted
        (a second Ctrl-C) finishes its release when called again. In a child forked from the process that
        made it, nothing: the lease and the saves in flight are the parent's."""
        if self._released:
            return
        if os.getpid() != self._pid:
            self._closed = self._released = True
            return
        try:
            if not self._closed:
                self.wait()
        finally:
            self._closed = True
            self._wait_cleanup()
            self._cleaner.shutdown()
            self._background.shutdown()
            self._stager.release()
            self._device_stager.release()
            forget_cached_plans(self._session.instance)
            lease = self._session.lease
            if lease is not None:
                lease.release()
            if self._exit_release is not None:
                atexit.unregister(self._exit_release)
            self._released = True

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- saving -------------------------------------------------------------------------
    def _save_now(self, request: save_protocol.SaveRequest, stats: PhaseTimer) -> None:
        self._wait_cleanup()
        with gc_paused():
            outcome = save_protocol.save(self._session, request, stats)
        self._committed = outcome.committed
        heartbeat()
        try:
            # Submitted and recorded, or neither: a Ctrl-C between the two (or inside the pool's start of
            # its worker) left a removal that close() did not wait for, which ran after the lease was
            # released and found it gone (an outside review, holding Ctrl-C down).
            with signals_deferred():
                cleanup = self._cleaner.submit(self._remove_retired, outcome.retired, request.step)
                with self._cleanup_lock:
                    self._cleanup = cleanup
        except RuntimeError:  # the interpreter is shutting down (a save finishing at exit): remove now
            self._remove_retired(outcome.retired, request.step)
        log.debug("ckptguard: saved step %d: %s", request.step, stats)

    def _remove_retired(self, retired: list[str], step: int) -> None:
        for path in retired:
            try:
                self._session.root.remove_retired(path)  # under the fence: a job that lost the root removes nothing
            except (OSError, CheckpointError) as e:
                log.warning("ckptguard: step %d is committed, but removing %s failed: %s", step, path, e)

    def _wait_cleanup(self) -> None:
        with self._cleanup_lock:
            cleanup = self._cleanup
        if cleanup is None:
            return
        cleanup.result()
        with self._cleanup_lock:
            if self._cleanup is cleanup:  # not a newer one that a background save set meanwhile
                self._cleanup = None

    def _refuse_in_a_forked_child(self, call: str) -> None:
        """A forked child shares its parent's Checkpointer object but none of its threads: its collective
        calls rewrote the lease with the child's pid (another job then took the root over once the child
        exited) and its waits for the parent's background work never ended (an outside attack)."""
        if os.getpid() != self._pid:
            raise CheckpointError(
                f"{call}(): this Checkpointer on {self.root} was made by process {self._pid}; process "
                f"{os.getpid()} is a child forked from it and may not use it (the lease and the saves in "
                "flight are the parent's). Open a Checkpointer of its own in the child (on another root: "
                "this one is held), or use it in the parent only.", path=self.root)

    def _check_usable(self, writing: bool, wait_cleanup: bool = True) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")
        if wait_cleanup:
            self._wait_cleanup()
        if writing and self.read_only:
            raise CheckpointError(f"this Checkpointer on {self.root} was opened read_only=True")
