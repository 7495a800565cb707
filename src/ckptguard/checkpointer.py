"""`Checkpointer`: the facade of the save/load protocol (lifecycle, settings, dispatch).

Every public method is collective when a process group is initialised: all ranks call it with the same
arguments. The protocol lives in :mod:`ckptguard.protocol`, the settings in ``settings.py``, the blocking
and background saves in ``saving.py``; this module dispatches each call and keeps what every rank agreed
is committed.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import time
from collections.abc import Collection, Mapping
from concurrent.futures import Future
from typing import Any, Unpack

from ckptguard import inflight, saving
from ckptguard._collective import collective, refuse_in_a_forked_child
from ckptguard._faults import FaultPhase, fault_point
from ckptguard.arguments import json_object
from ckptguard.dcp.planners import forget_cached_plans
from ckptguard.errors import CheckpointError, InvalidArgumentError
from ckptguard.heartbeat import heartbeat
from ckptguard.managing import Management
from ckptguard.opening import open_checkpointer
from ckptguard.protocol import load as load_protocol
from ckptguard.protocol import manage
from ckptguard.protocol import read as read_protocol
from ckptguard.protocol.decisions import Listing
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.lease import release_at_exit
from ckptguard.protocol.timing import PhaseTimer, gc_paused
from ckptguard.protocol.topology import Topology
from ckptguard.settings import CheckpointerSettings, SettingsAttributes, SettingsKwargs, combine

log = logging.getLogger("ckptguard")


class Checkpointer(Management, SettingsAttributes):
    """Race-free, crash-safe checkpoints in one root directory (a path, or ``s3://bucket/prefix``).

    ``Checkpointer("/shared/ckpts", keep_last=3)`` works with or without an initialised process group.
    Opening it is collective: the ranks probe which of them share the root, and each storage domain's
    leader takes the root's lease, which keeps a second writing job out (``read_only=True`` takes none).
    Every setting is an attribute (``ck.keep_last``); the assignable ones may be set after opening.

    Args:
        root: A directory (created where nothing exists yet) or a URL of a registered storage scheme.
        settings: The settings (default: :class:`CheckpointerSettings`'s defaults).
        **kwargs: Fields of :class:`CheckpointerSettings`, replacing those of ``settings``.

    Raises:
        TypeError: A setting of the wrong type, or an unknown keyword (naming it).
        ValueError: A setting out of its range (naming it).
        UnsupportedStorageError: ``root`` is a URL of a scheme with no backend.
        CheckpointError: ``root`` is a file; LeaseHeldError if another job holds its lease.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        settings: CheckpointerSettings | None = None,
        **kwargs: Unpack[SettingsKwargs],
    ) -> None:
        self._settings, self._session = open_checkpointer(root, combine(settings, kwargs))
        self._comm = self._session.comm
        # A job that ends without close() still hands the root over at once (bounded: see lease).
        lease = self._session.lease
        self._exit_release = None if lease is None else functools.partial(release_at_exit, lease)
        if self._exit_release is not None:
            atexit.register(self._exit_release)
        self._pid = os.getpid()  # the process it belongs to (a fork's child inherits the object, not it)
        self._closed = self._released = False  # released: close() ran to its end (a Ctrl-C may cut it short)
        self._out_of_step: str | None = None  # why this rank's collective calls are refused (_collective.py)
        self._saves = saving.Saves(
            self._session, self._settings.async_budget_bytes, lambda committed: setattr(self, "_committed", committed)
        )
        self._last_save_stats: PhaseTimer | None = None
        self._last_load_stats: PhaseTimer | None = None
        self._committed: Listing = {}
        self._relist()
        self._tags: manage.Tags = manage.read_tags(self._session)
        inflight.track(self)
        log.debug("ckptguard %s: %s", self.root, self.topology.describe())

    @property
    def root(self) -> str:
        """The root as given (a directory or a URL)."""
        return self._session.url

    def _assign(self, name: str, value: Any) -> None:
        self._settings = combine(self._settings, {name: value})
        self._session.options = self._settings.options(self._session.options.checksum)

    @property
    def last_save_stats(self) -> PhaseTimer | None:
        """The time of each phase of the last save (None before the first)."""
        return self._last_save_stats

    @property
    def last_load_stats(self) -> PhaseTimer | None:
        """The time of each phase of the last load (None before the first)."""
        return self._last_load_stats

    @property
    def topology(self) -> Topology:
        """Which ranks share storage (probed when opened), and each storage domain's leader."""
        return self._session.topo

    @collective()
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
        """Save ``state`` as checkpoint ``step``: committed whole on every storage domain, or not at all.

        A local problem on one rank (a value it cannot save, a ``files=`` path missing there) fails the save
        on every rank at its plan. A setting assigned after the call applies from the next save.

        Args:
            step: A non-negative int; an existing step is refused unless ``overwrite`` (a step a load
                found corrupt, quarantined, is replaced without it).
            state: Tensors, modules, optimizers, RNG states, ``PerRank`` values and plain values, nested.
            files: ``{key: local path}`` of files or directories stored beside the state, checksummed
                (``load(files=...)`` restores them whole).
            overwrite: Replace a committed ``step`` (a new version; the old one retired once committed).
            metadata: JSON values stored with the step (``metadata(step)`` reads them back).
            blocking: False: return once the state and ``files=`` are copied to host memory; writing and
                committing run in the background, one save at a time.
            progress: Show a progress bar on rank 0 (default: the ``progress`` setting).

        Raises:
            InvalidArgumentError: On any rank, ``step`` is not a non-negative int or ``metadata`` holds a
                value JSON cannot give back (NaN, infinity, a non-str key, nesting too deep); a ValueError.
            UnsupportedValueError: A value no load could give back (a sparse, quantized, nested or meta
                tensor, a sub-byte dtype, two values of one flattened name); ``metadata`` or ``files`` of the
                wrong type; a TypeError.
            ReplicatedValueError: A plain value, or ``step``/``overwrite``, differs across ranks.
            PathCollisionError: ``files=`` paths of two ranks overlap, or one overlaps the root.
            StepExistsError: ``step`` is committed and ``overwrite`` is False.
            DiskFullError: The storage is full (a StorageError, like the storage's other refusals).
            LeaseLostError: Another job took the root over; nothing was committed by this one.
            CheckpointError: Any other failure (PeerError: another rank failed); a background save's by
                ``wait()`` or the next call.
        """
        self.wait()
        # The previous save's removal of retired steps may go on while this one takes its host copy:
        # Saves.run waits for it before it touches storage.
        self._check_usable(writing=True, wait_cleanup=False)
        started = time.perf_counter()
        heartbeat()  # progress for `ckptguard run --hang-timeout`: a save is not a hang
        fault_point(FaultPhase.SAVE_START, self._comm.rank)
        show = (self.progress if progress is None else progress) and self._comm.rank == 0
        stats = self._last_save_stats = PhaseTimer(show)
        # A step or metadata= this rank cannot save must not skip the collectives the other ranks are about
        # to run: it is reported in the plan's agreement, where every rank raises it at once.
        argument_error: BaseException | None = None
        user_metadata: dict[str, Any] = {}
        try:
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise InvalidArgumentError(
                    f"step must be a non-negative int, got {step!r} on rank {self._comm.rank}", rank=self._comm.rank
                )
            user_metadata = json_object(metadata, self._comm.rank)
        except Exception as e:  # reported in the plan's agreement
            argument_error = e
            step = step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else -1
        call = saving.SaveCall(step, overwrite, user_metadata, frozenset(self._tags.values()), self._session.options)
        prepared = saving.prepare(self._session, state, files, stats, error=argument_error, blocking=blocking)
        if blocking or not self._saves.background(call, prepared, stats):
            self._saves.blocking(call, prepared, stats)
        stats.blocked = time.perf_counter() - started

    def pending_save(self) -> Future[None] | None:
        """The background save not yet waited for (what the at-exit check inspects).

        Returns:
            Its future, or None if no ``blocking=False`` save is in flight or unwaited.
        """
        return self._saves.inflight

    def wait(self) -> None:
        """Wait until the save started with ``blocking=False`` is committed.

        A Ctrl-C while waiting leaves the save in flight: the next ``save``, ``load`` or ``wait`` waits for it.

        Raises:
            CheckpointError: The background save failed (PeerError: a rank died; a Ctrl-C in it stays one).
        """
        refuse_in_a_forked_child(self, "wait")
        self._saves.wait(self.root)

    @collective()
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
        """Load a committed checkpoint into ``state`` in place (resharding at another world size).

        A failed load leaves ``state`` and the ``files=`` destinations exactly as they were: every byte is
        read and verified on every rank before the load is agreed, and tensors read in place get their old
        bytes back if it is not (``load_memory_bytes``, the Performance page).

        Args:
            state: The template: tensors, modules and optimizers are filled in place, plain values replaced.
            step: The step to load; None: the one committed last, falling back to older ones (with a
                warning) past a corrupt one, and listing again if it is retired while read.
            files: ``{key: destination}`` for the ``files=`` saved with the step, restored whole.
            strict: Refuse keys of ``state`` the checkpoint lacks (False: leave them as they are).
            progress: Show a progress bar on rank 0 (default: the ``progress`` setting).
            tag: Load the step this tag names (instead of ``step``).

        Returns:
            The step loaded, or None if the root holds no committed checkpoint.

        Raises:
            StepNotFoundError: ``step`` or ``tag`` names no committed step (StepRetiredError: retired while read).
            TemplateMismatchError: ``state`` does not fit the checkpoint (named key by key).
            CorruptCheckpointError: The step asked for fails its checksums.
            CheckpointError: Any other failure (PeerError when another rank failed).
        """
        self.wait()
        self._check_usable(writing=False)
        heartbeat()  # progress for `ckptguard run --hang-timeout`: a load is not a hang
        step, self._tags = manage.tagged_step(self._session, tag, step, self._tags)
        show = (self.progress if progress is None else progress) and self._comm.rank == 0
        with gc_paused():
            loaded, stats, current = load_protocol.load(self._session, step, state, files, strict, show)
        self._loaded(step, loaded, current)
        heartbeat()
        if stats is not None:
            self._last_load_stats = stats
        return loaded

    @collective()
    def read(
        self, step: int | None = None, *, tag: str | None = None, keys: Collection[str] | None = None
    ) -> dict[str, Any] | None:
        """The stored state dict of a committed checkpoint, without a template.

        Nested as saved, every value as given to ``save`` (int and tuple keys, tuples, numpy, RNG states);
        modules and optimizers as state dicts, tensors whole on the CPU; ``PerRank`` values this rank's own.
        Verified as in ``load``.

        Args:
            step: The step; None: the one committed last, falling back past a corrupt one.
            tag: Read the step this tag names.
            keys: Only these top-level keys (e.g. the small part beside a sharded rest ``load`` places).

        Returns:
            The state dict, or None if the root holds no committed checkpoint.

        Raises:
            TypeError: ``keys`` is a string.
            StepNotFoundError: ``step`` or ``tag`` names no committed step.
            CheckpointError: The checkpoint cannot be read or verified.
        """
        if isinstance(keys, str | bytes):  # a string is a collection of its characters: never meant
            raise TypeError(f"keys must be a collection of top-level keys, e.g. keys=[{keys!r}], not a string")
        self.wait()
        self._check_usable(writing=False)
        step, self._tags = manage.tagged_step(self._session, tag, step, self._tags)
        keep = None if keys is None else frozenset(keys).__contains__
        with gc_paused():
            got, state, current = read_protocol.read(self._session, step, keep)
        self._loaded(step, got, current)
        return state

    def path(self, step: int) -> str:
        """The directory (or URL) of committed ``step``'s current version. Not collective.

        Raises:
            StepNotFoundError: ``step`` is not committed.
        """
        read_protocol.require_committed(self._session, step, self._committed)
        return self._session.root.dir(CheckpointName(step, self._committed[step].version))

    @collective()
    def metadata(self, step: int) -> dict[str, Any]:
        """The ``metadata=`` given to the save of committed ``step`` (rank 0 reads it; collective). Waits
        for a save in flight first (it may be the one asked for).

        Raises:
            StepNotFoundError: ``step`` is not committed.
        """
        self.wait()
        return read_protocol.read_metadata(self._session, step, self._committed)

    def check_lease(self, acting: str = "change the root") -> None:
        """Check that this job still holds the root's lease, right before changing what sits beside the root.

        For an integration removing or replacing a checkpoint's visible copy: a job that stalled while another
        took the root over removes nothing the new holder sees. Not collective; checks nothing off a leader.

        Args:
            acting: Completes the message ("refusing to <acting>").

        Raises:
            LeaseLostError: Another job holds the root now.
            CheckpointError: The Checkpointer is read_only or closed.
        """
        if self._closed:  # (not _check_usable: the removal of retired steps may go on meanwhile)
            raise CheckpointError("this Checkpointer is closed")
        if self.read_only:
            raise CheckpointError(f"this Checkpointer on {self.root} was opened read_only=True: it holds no lease")
        lease = self._session.lease
        if lease is not None:
            lease.check(acting=acting, renew=False)

    def close(self) -> None:
        """Wait for the save in flight, then release the root's lease; the Checkpointer cannot save afterwards.

        A close() interrupted (a second Ctrl-C) finishes its release when called again. In a child forked
        from the process that made it, nothing: the lease and the saves in flight are the parent's.

        Raises:
            CheckpointError: The background save failed (the lease is released all the same).
        """
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
            self._saves.close()
            forget_cached_plans(self._session.instance)
            lease = self._session.lease
            if lease is not None:
                lease.release()
            if self._exit_release is not None:
                atexit.unregister(self._exit_release)
            self._comm.close()
            self._released = True

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_usable(self, writing: bool, wait_cleanup: bool = True) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")
        if wait_cleanup:
            self._saves.wait_cleanup()
        if writing and self.read_only:
            raise CheckpointError(f"this Checkpointer on {self.root} was opened read_only=True")
