"""A Checkpointer's saves: the blocking path, the background path, and the removal of retired steps.

A blocking save runs the protocol in the caller's thread (device tensors first copied in bulk into
reused pinned buffers). A background save (``blocking=False``) snapshots the state into host buffers
reused across saves, then runs the same protocol on one worker thread; one such save is in flight at a
time. Either way the settings at the call are snapshotted into the request: a setting assigned once
``save()`` returned applies from the next save. The steps a save retired are removed on another worker
while the next save takes its host copy; every save waits for that removal before it touches storage.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptguard._signals import signals_deferred
from ckptguard.comm import hostname
from ckptguard.dcp.loadmemory import auto_memory_bytes
from ckptguard.dcp.values import refuse_flat_collisions, refuse_unsavable
from ckptguard.errors import CheckpointError
from ckptguard.heartbeat import heartbeat
from ckptguard.protocol import artifacts
from ckptguard.protocol import save as save_protocol
from ckptguard.protocol.artifacts import ArtifactTarget
from ckptguard.protocol.decisions import Listing
from ckptguard.protocol.session import Options, Session
from ckptguard.protocol.timing import PhaseTimer, gc_paused
from ckptguard.staging import DeviceStager, HostStager
from ckptguard.state import prepare_state

log = logging.getLogger("ckptguard")


@dataclass(frozen=True)
class SaveCall:
    """What one ``save()`` call fixes for its request, whichever path runs it."""

    step: int
    overwrite: bool
    user_metadata: dict[str, Any]
    keep: frozenset[int]  # tagged steps: retention keeps them
    options: Options  # the settings at the call


@dataclass
class Prepared:
    """A save's state dict and ``files=`` targets; ``error``: a local problem, reported at the plan's agreement
    (never raised here: the other ranks are about to run the save's collectives)."""

    state_dict: dict[str, Any]
    targets: list[ArtifactTarget]
    error: BaseException | None = None


def prepare(
    session: Session,
    state: Mapping[str, Any],
    files: Mapping[str, Any] | None,
    stats: PhaseTimer,
    *,
    error: BaseException | None = None,
    blocking: bool = True,
) -> Prepared:
    """The state dict to save and the ``files=`` targets, or the local problem found making them.

    Args:
        session: The root's session.
        state: What ``save()`` was given.
        files: Its ``files=``.
        stats: The save's phase timer.
        error: A problem already found with the call's other arguments (reported first).
        blocking: False for a background save: what its planning would refuse is refused here, at the call.

    Returns:
        The state dict and targets, with the first local problem in ``error`` (never raised here).
    """
    rank = session.comm.rank
    prepared = Prepared({}, [], error)
    with stats.phase("state_dict"):
        try:
            made = prepare_state(state, rank)
            prepared.state_dict = made.state_dict
            # DCP gives a never-stepped optimizer a state to save (one step at learning rate 0); it is
            # saved without it (prepare_state) and left without it here (left with it, its next real
            # step was its second: Adam's bias correction changed).
            made.undo()
            refuse_unsavable(prepared.state_dict)
            if not blocking:  # planned in the background: refused here, not at wait()
                refuse_flat_collisions(prepared.state_dict)
        except Exception as e:
            prepared.error = prepared.error or e
    try:
        prepared.targets = artifacts.normalize(files, rank, hostname(), True, session.root.local_dir())
    except Exception as e:
        prepared.error = prepared.error or e
    return prepared


class Saves:
    """The saves of one Checkpointer: its stagers, its background worker and the save in flight, and the
    removal of the steps a save retired.

    Args:
        session: The root's session.
        async_budget_bytes: The host memory the stagers may keep (None: the default share of MemAvailable).
        on_committed: Called with what is committed after each save (in the thread that ran it).
    """

    def __init__(
        self, session: Session, async_budget_bytes: int | None, on_committed: Callable[[Listing], None]
    ) -> None:
        self._session = session
        self._on_committed = on_committed
        self.cleaner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptguard-cleanup")
        self._cleanup: Future[None] | None = None
        self._cleanup_lock = threading.Lock()  # the background save sets it, any call may wait for it
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptguard-save")
        self.inflight: Future[None] | None = None
        self.host_stager = HostStager(async_budget_bytes)
        topo = session.topo
        local_ranks = topo.hosts.count(topo.hosts[topo.rank])
        self.device_stager = DeviceStager(
            (lambda: async_budget_bytes)
            if async_budget_bytes is not None
            else functools.partial(auto_memory_bytes, local_ranks)
        )

    def blocking(self, call: SaveCall, prepared: Prepared, stats: PhaseTimer) -> None:
        """Run the save in this thread; device tensors are first copied in bulk to pinned host buffers."""
        state_dict = prepared.state_dict
        if prepared.error is None and self.device_stager.applies(state_dict):
            with stats.phase("device copy"):
                try:
                    state_dict = self.device_stager.stage(state_dict, self.host_stager) or state_dict
                except Exception as e:  # reported in the plan's agreement, like any local problem
                    prepared.error = e
        self.run(self._request(call, state_dict, prepared.targets, prepared.targets, prepared.error), stats)

    def background(self, call: SaveCall, prepared: Prepared, stats: PhaseTimer) -> bool:
        """Snapshot the state into host buffers and save it on the background worker.

        Returns:
            True once submitted; False if the snapshot failed (``prepared.error`` says why: the caller
            then runs the blocking path, which reports it at the plan's agreement) or the state is over
            ``async_budget_bytes`` (the caller saves it on the blocking path).
        """
        if prepared.error is not None:
            return False
        with stats.phase("snapshot"):
            try:
                staged = self.host_stager.snapshot(prepared.state_dict, prepared.targets)
            except Exception as e:  # a files= entry that cannot be read, a tensor torch cannot copy
                prepared.error = e
                return False
        if staged is None:  # over async_budget_bytes (warned once): the blocking path saves it
            return False
        state_dict, items = staged
        self.device_stager.release()  # one host copy of the state, not two
        request = self._request(call, state_dict, prepared.targets, items, None)
        try:
            with signals_deferred():  # submitted and recorded, or neither: never a save unrecorded
                self.inflight = self._background.submit(self.run, request, stats)
        except RuntimeError:  # the interpreter is exiting (a thread that outlived the main one): now
            self.run(request, stats)
        return True

    @staticmethod
    def _request(
        call: SaveCall,
        state_dict: dict[str, Any],
        targets: list[ArtifactTarget],
        items: list[Any],
        error: BaseException | None,
    ) -> save_protocol.SaveRequest:
        return save_protocol.SaveRequest(
            call.step,
            state_dict,
            targets,
            items,
            call.overwrite,
            call.user_metadata,
            error,
            keep=call.keep,
            options=call.options,
        )

    def run(self, request: save_protocol.SaveRequest, stats: PhaseTimer) -> None:
        """The protocol's save of ``request``, then the removal of what it retired, in the background."""
        self.wait_cleanup()
        with gc_paused():
            outcome = save_protocol.save(self._session, request, stats)
        self._on_committed(outcome.committed)
        heartbeat()  # progress for `ckptguard run --hang-timeout`
        try:
            # Submitted and recorded, or neither: a removal close() did not wait for would run after the
            # lease was released.
            with signals_deferred():
                cleanup = self.cleaner.submit(self.remove_retired, outcome.retired, request.step)
                with self._cleanup_lock:
                    self._cleanup = cleanup
        except RuntimeError:  # the interpreter is shutting down (a save finishing at exit): remove now
            self.remove_retired(outcome.retired, request.step)
        log.debug("ckptguard: saved step %d: %s", request.step, stats)

    def remove_retired(self, retired: list[str], step: int) -> None:
        """Remove what a save or delete took out of sight; a failure is logged (the step stays committed)."""
        for path in retired:
            try:
                self._session.root.remove_retired(path)  # under the fence: a job that lost the root removes nothing
            except (OSError, CheckpointError) as e:
                log.warning("ckptguard: step %d is committed, but removing %s failed: %s", step, path, e)

    def wait_cleanup(self) -> None:
        """Wait for the removal of the last save's retired steps."""
        with self._cleanup_lock:
            cleanup = self._cleanup
        if cleanup is None:
            return
        cleanup.result()
        with self._cleanup_lock:
            if self._cleanup is cleanup:  # not a newer one that a background save set meanwhile
                self._cleanup = None

    def wait(self, root: str) -> None:
        """Wait for the save in flight; raise its error as a CheckpointError (a Ctrl-C stays one).

        A Ctrl-C while waiting leaves the save in flight: it stays the one the next wait waits for.
        """
        inflight = self.inflight
        if inflight is None:
            return
        try:
            inflight.result()
        except BaseException as e:
            if not inflight.done():
                raise
            self.inflight = None
            if isinstance(e, CheckpointError | KeyboardInterrupt | SystemExit):
                raise
            raise CheckpointError(f"the background save to {root} failed: {type(e).__name__}: {e}") from e
        self.inflight = None

    def close(self) -> None:
        """Wait for the removals, stop the workers and free the host buffers (the save in flight is waited
        for by the caller first)."""
        self.wait_cleanup()
        self.cleaner.shutdown()
        self._background.shutdown()
        self.host_stager.release()
        self.device_stager.release()
