"""DCP StorageReader for ckptguard: a load changes the caller's state only once every byte is verified.

A load has two phases, with an agreement of all ranks between them (protocol/load.py):

    read_data   (DCP calls it) reads this rank's items and checks every checksum.
                Within ``memory_bytes`` an item whose bytes can go straight into
                its destination (same shape, dtype, contiguous CPU memory) is read
                there, after its old bytes are copied aside (in place); other
                items go into scratch memory (staged). Beyond ``memory_bytes`` an
                item is checked in bounded chunks and its source is pinned for a
                second read: the file kept open (POSIX), or, where an open handle
                does not keep the bytes (object stores) or no more files may be
                kept open, its verified bytes are spilled to an unlinked local
                temporary file (verified only)
    apply       once every rank verified its part: staged items are copied into
                place, verified-only items read again from their pinned source and
                checked again; objects are placed
    close       without a successful apply (this rank's or another's failure), the
                old bytes of every item read in place are put back

So a corrupt byte anywhere, on any rank, leaves the caller's state as it was. In
place and staged items cost one memory copy and one read of storage; verified-only
items a second read of a source retention cannot delete (an open file, or the local
spill). Storage is read once whatever the budget: an object deleted or replaced by
retention between the phases is never fetched again. The second read can only
disagree with the first if a checkpoint file was modified in place during the load
(never by ckptguard): that is reported as a TornLoadError, which says so.
"""

from __future__ import annotations

import io
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ckptguard._faults import FaultPhase, fault_point
from ckptguard._pool import ExitSafePool
from ckptguard._signals import signals_deferred
from ckptguard.dcp.coverage import check_coverage
from ckptguard.dcp.loadmemory import (
    auto_memory_bytes,
    keepable_files,
    load_budget,
)
from ckptguard.dcp.loadplanner import ReaderPlanner, decode_object, reader_planner
from ckptguard.dcp.readjob import (
    IN_PLACE,
    STAGED,
    VERIFIED,
    Arena,
    ReadJob,
    Spill,
    Stopped,
    assign_modes,
    detached,
    follows,
    follows_at,
    no_in_place_for_aliases,
    torn_if_it_fails,
)
from ckptguard.dcp.records import StoredItem
from ckptguard.dcp.wholereads import in_storage_order
from ckptguard.errors import CheckpointError, CorruptCheckpointError
from ckptguard.storage import ReadHandle, StorageBackend

_MAX_IOV = 512  # items per vectored read
#: Reads are hashed in pieces of about this size, each while it is still in the CPU's cache. Measured
#: here (512 MiB, xxh3-64): read into a reused buffer and hashed, 0.15 s in 8 MiB pieces, 0.11 s in
#: 1 MiB ones, and cold no slower; read into place and hashed, 0.20 s in 64 MiB reads, 0.14-0.16 s in
#: 1 MiB ones, the copy alone 0.12 s.
_HOT_BYTES = 1 << 20
#: Where every read is a request (an object store's ranged GET: ``cheap_small_reads`` False), reads from
#: storage are not split for the cache: verified-only items are checked in chunks of this size, items
#: read into memory go in batches of up to ``_REQUEST_BATCH`` bytes, each hashed after its read.
_REQUEST_CHUNK = 8 << 20
_REQUEST_BATCH = 64 << 20
_WHOLE = 1 << 62  # a piece size that never splits a read

_Work = TypeVar("_Work")  # what one file's work on a reading thread is given


class GuardedReader(StorageReader):
    """``memory_bytes`` None: on storage that keeps open files (POSIX), 0 (verify everything, then read
    it again into place from the files kept open) while this rank's bytes fit the page cache
    (:func:`page_cache_fits`), else ``POSIX_MEMORY_BYTES``; on other storage :func:`auto_memory_bytes`
    of ``local_ranks``. ``backup=False`` when the destinations are fresh buffers of the reader's
    caller (nothing to put back on failure)."""

    def __init__(
        self,
        storage: StorageBackend,
        checkpoint_dir: str,
        metadata: Metadata | None,
        algorithm: str,
        rank: int,
        io_threads: int = 4,
        on_bytes: Callable[[int], None] | None = None,
        memory_bytes: int | None = None,
        local_ranks: int = 1,
        backup: bool = True,
        domain_count: int = 1,
    ) -> None:
        super().__init__()
        self.domain_count = domain_count  # > 1: the manifest holds one storage domain's items of several
        self.storage = storage
        self.on_bytes = on_bytes
        self.checkpoint_dir = checkpoint_dir
        self.metadata = metadata
        self.algorithm = algorithm
        self.rank = rank
        self.io_threads = max(1, io_threads)
        if memory_bytes is None and not storage.keeps_open_files:
            memory_bytes = auto_memory_bytes(local_ranks)
        self.memory_bytes = memory_bytes  # None: decided once the load's size is known (_budget)
        # The first pass's reads from storage: in cache-sized pieces where a read is a syscall, as before
        # where each is a request (the second pass reads local files: always in cache-sized pieces).
        cheap = storage.cheap_small_reads
        self._piece = _HOT_BYTES if cheap else _WHOLE
        self._chunk = _HOT_BYTES if cheap else _REQUEST_CHUNK
        self._batch_cap = _HOT_BYTES if cheap else _REQUEST_BATCH
        self.local_ranks = local_ranks
        self.backup = backup
        self.storage_data: dict[MetadataIndex, StoredItem] = metadata.storage_data if metadata is not None else {}
        self._jobs: list[ReadJob] = []
        self._open: dict[str, ReadHandle] = {}
        self._arena: Arena | None = None
        self._spill: Spill | None = None
        self._pinned: torch.Tensor | None = None  # see _device_scratch
        self._done = False
        #: Every item of this rank is in place (apply() succeeded): the caller's state holds the step.
        self.applied = False
        self.staged_bytes = 0  # held in host memory between the phases (scratch, or old bytes of in-place items)
        self.verified_only_bytes = 0  # read twice: from storage, then from a pinned source
        self.spilled_bytes = 0  # of those, read again from the local spill file

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        assert self.metadata is not None, "the metadata is given to set_up_storage_reader"
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """``metadata``: what this load plans with (a load builds only its template's names)."""
        self.metadata = metadata
        self.storage_data = metadata.storage_data
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    # -- phase 1: read and verify; the caller's state is put back as it was unless apply() succeeds ----
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        try:
            jobs = self._plan_jobs(plan, reader_planner(planner))
            self._read_and_verify(jobs)
        except BaseException:
            self.close()
            raise
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut

    def _plan_jobs(self, plan: LoadPlan, planner: ReaderPlanner) -> list[ReadJob]:
        # Grouped by the stored item's identity (one object per item of the metadata): cheaper than
        # hashing every field of it.
        by_item: dict[int, tuple[StoredItem, list[ReadItem]]] = {}
        for req in plan.items:
            # Whole tensors planned from the manifest's item table carry their stored item.
            stored = planner.stored_item(req) or self.storage_data.get(req.storage_index)
            if stored is None and self.domain_count == 1:  # the manifest holds every item: it contradicts itself
                raise CorruptCheckpointError(
                    f"rank {self.rank}: the checkpoint's metadata in {self.checkpoint_dir} lists a chunk of "
                    f"{req.storage_index.fqn} at offset {list(req.storage_index.offset or [])} that no stored "
                    "item holds: the manifest is corrupt",
                    path=self.checkpoint_dir,
                )
            if stored is None:
                raise CheckpointError(
                    f"rank {self.rank}: {req.storage_index.fqn} (offset {list(req.storage_index.offset or [])}) "
                    f"is not stored in {self.checkpoint_dir}. If this checkpoint lives on node-local disks, "
                    "a rank can only read what its own node wrote: load at the same world size and layout, "
                    "or copy the checkpoint to shared storage to reshard it."
                )
            group = by_item.get(id(stored))
            if group is None:
                by_item[id(stored)] = (stored, [req])
            else:
                group[1].append(req)
        check_coverage(plan, planner, self.metadata, self.rank, self.checkpoint_dir)
        # Destinations resolved on this thread (the planner is not ours to call concurrently): views.
        jobs: list[ReadJob] = []
        for stored, reqs in by_item.values():
            if reqs[0].type == LoadItemType.BYTE_IO:
                job = ReadJob(stored, reqs, [], mode=STAGED)  # objects are decoded (and checked) now
            else:
                job = ReadJob(stored, reqs, [detached(planner.resolve_tensor(r)) for r in reqs])
                job.check_fits()
            jobs.append(job)
        jobs = in_storage_order(jobs, planner.whole_reads())
        no_in_place_for_aliases(jobs)
        rank_bytes = sum(job.stored.length for job in jobs)
        modes = assign_modes(jobs, load_budget(self.memory_bytes, rank_bytes, self.local_ranks), self.backup)
        self.staged_bytes += modes.staged_bytes
        self.verified_only_bytes += modes.verified_only_bytes
        self._arena = Arena(modes.arena_bytes)
        self._jobs = jobs
        return jobs

    def _read_and_verify(self, jobs: list[ReadJob]) -> None:
        by_file: dict[str, list[ReadJob]] = defaultdict(list)
        for job in jobs:
            by_file[job.stored.file].append(job)
        files = sorted(by_file.items())
        # Files a second read comes from: kept open where an open handle keeps the bytes (a rename or
        # unlink by retention changes nothing for it), as many as the descriptor limit allows; the
        # verified bytes of the others are spilled to a local temporary file.
        second = [rel for rel, fj in files if any(j.mode == VERIFIED for j in fj)]
        keep = set(second[: keepable_files(len(second))]) if self.storage.keeps_open_files else set()
        if len(keep) < len(second):
            self._spill = Spill()
            self.spilled_bytes = sum(
                j.stored.length for rel, fj in files if rel not in keep for j in fj if j.mode == VERIFIED
            )
        first = [True]
        lock = threading.Lock()
        stop = threading.Event()

        def read_file(rel: str, file_jobs: list[ReadJob]) -> None:
            if stop.is_set():
                return
            path = os.path.join(self.checkpoint_dir, rel)
            fd = self.storage.open_read(path)
            kept = False
            try:
                kept = self._read_file(fd, path, file_jobs, rel in keep, first, lock, stop)
            finally:
                if kept:
                    with lock:
                        self._open[rel] = fd
                else:
                    fd.close()

        self._on_threads(files, read_file, stop, "ckptguard-read")
        for job in jobs:
            if job.is_object:
                assert job.raw is not None
                job.obj = decode_object(job.reqs[0].dest_index.fqn, io.BytesIO(job.raw))
                job.raw = None

    def _read_file(
        self,
        fd: ReadHandle,
        path: str,
        file_jobs: list[ReadJob],
        keep: bool,
        first: list[bool],
        lock: threading.Lock,
        stop: threading.Event,
    ) -> bool:
        """Phase 1 for one file's items, in offset order; whether ``fd`` is kept for the second read."""
        arena = self._arena
        assert arena is not None
        batch: list[tuple[ReadJob, memoryview]] = []
        batch_bytes = 0
        checks: list[ReadJob] = []  # consecutive verified-only items, read together into `chunk`
        checks_bytes = 0
        chunk: memoryview | None = None

        def flush() -> None:
            nonlocal batch, batch_bytes, checks, checks_bytes
            if stop.is_set():
                raise Stopped()
            if batch:
                for job, _ in batch:
                    if job.mode == IN_PLACE and self.backup:
                        job.save_old(arena)  # just before its bytes change: what close() puts back
                self._read_batch(fd, batch, batch[0][0].stored.offset, self._piece, path)
                if self.on_bytes is not None:
                    self.on_bytes(batch_bytes)
                batch, batch_bytes = [], 0
            if checks:
                assert chunk is not None
                fd.read_into([chunk[:checks_bytes]], checks[0].stored.offset)
                pos = 0
                for job in checks:
                    view = chunk[pos : pos + job.stored.length]
                    job.verify(view, path, self.algorithm)
                    if not keep:
                        assert self._spill is not None
                        job.spill_at = self._spill.append(view)
                    pos += job.stored.length
                if self.on_bytes is not None:
                    self.on_bytes(checks_bytes)
                checks, checks_bytes = [], 0

        for job in file_jobs:  # in offset order
            if job.mode != VERIFIED:
                view = job.destination(arena)
                # Consecutive items read into memory: one preadv() for many of them.
                if checks or (
                    batch
                    and (len(batch) >= _MAX_IOV or batch_bytes >= self._batch_cap or not follows(batch[-1][0], job))
                ):
                    flush()
                batch.append((job, view))
                batch_bytes += len(view)
            else:
                if chunk is None:
                    chunk = memoryview(bytearray(self._chunk))
                if batch or (
                    checks and (checks_bytes + job.stored.length > self._chunk or not follows(checks[-1], job))
                ):
                    flush()
                if job.stored.length > self._chunk:
                    job.verify_streaming(fd, path, self.algorithm, chunk, None if keep else self._spill)
                    if self.on_bytes is not None:
                        self.on_bytes(job.stored.length)
                else:
                    checks.append(job)
                    checks_bytes += job.stored.length
            if first[0]:
                with lock:
                    was_first, first[0] = first[0], False
                if was_first:
                    flush()
                    fault_point(FaultPhase.MID_LOAD, self.rank)
        flush()
        return keep

    # -- phase 2: once every rank verified its part ----------------------------------------------
    def apply(self, planner: LoadPlanner) -> None:
        """Copy what was verified into the caller's state (collectively agreed to be safe)."""
        # Every rank agreed: a Ctrl-C meanwhile is delivered once every byte is in place, never
        # halfway (the verified-only items' old bytes are not kept: a state half placed is torn).
        with signals_deferred():
            self._apply(reader_planner(planner))

    def _apply(self, planner: ReaderPlanner) -> None:
        commit = planner.commits  # DCP's default planner does nothing on commit_tensor: not called then
        try:
            self._read_direct_into_place()
            for job in self._jobs:
                if job.is_object:
                    for req in job.reqs:
                        planner.place_object(req, job.obj)
                    continue
                if job.placed or job.mode == IN_PLACE:
                    pass
                elif job.mode == VERIFIED:
                    self._read_into_place(job)
                else:
                    job.copy_into_place()
                if commit:
                    for req, target in zip(job.reqs, job.targets, strict=True):
                        planner.commit_tensor(req, target)
                if job.scratch is not None:
                    job.release()  # its scratch memory, now: the rest goes at close()
            self.applied = self._done = True
        finally:
            self.close()

    def _read_batch(
        self, fd: ReadHandle, batch: list[tuple[ReadJob, memoryview]], at: int, piece: int, path: str
    ) -> None:
        """Read consecutive items from ``at`` into their views and check each: one vectored read for
        several, one item alone in pieces of ``piece`` bytes (:meth:`ReadJob.read_verified`)."""
        if len(batch) == 1:
            batch[0][0].read_verified(fd, at, batch[0][1], piece, path, self.algorithm)
            return
        fd.read_into([v for _, v in batch], at)
        for job, view in batch:
            job.verify(view, path, self.algorithm)

    def _second_source(self, rel: str, path: str) -> tuple[ReadHandle, bool]:
        """Where a verified-only item of ``rel`` is read again: its file kept open, or the spill (True)."""
        fd = self._open.get(rel)
        if fd is not None:
            return fd, False
        assert self._spill is not None, f"{path}: neither kept open nor spilled"
        return self._spill, True

    def _read_direct_into_place(self) -> None:
        """Verified-only items that go straight into their destinations: one preadv() for many, the
        files on the reading threads at once (a copy from the page cache and a hash: CPU work that
        one thread does at half the speed of two here)."""
        by_file: dict[str, list[tuple[ReadJob, memoryview]]] = defaultdict(list)
        for job in self._jobs:
            if job.mode == VERIFIED and job.direct is not None:
                by_file[job.stored.file].append((job, job.direct))
        stop = threading.Event()
        self._on_threads(
            list(by_file.items()), lambda rel, items: self._place_file(rel, items, stop), stop, "ckptguard-place"
        )

    def _on_threads(
        self, files: Sequence[tuple[str, _Work]], work: Callable[[str, _Work], None], stop: threading.Event, name: str
    ) -> None:
        """``work`` for each file, on up to ``io_threads`` threads; the first failure sets ``stop`` (the
        others stop at their next batch) and is raised once every thread has left."""
        if len(files) <= 1 or self.io_threads == 1:
            for rel, what in files:
                work(rel, what)
            return
        pool = ExitSafePool(min(self.io_threads, len(files)), thread_name_prefix=name)
        try:
            futures = [pool.submit(work, rel, what) for rel, what in files]
            for f in futures:
                f.result()
        except BaseException:
            stop.set()
            raise
        finally:
            # Whatever interrupts the caller (Ctrl-C), the threads that write its memory are seen
            # stopped before it goes on: putting back old bytes while one still reads would tear them.
            with signals_deferred():
                pool.shutdown(wait=True)

    def _place_file(self, rel: str, items: list[tuple[ReadJob, memoryview]], stop: threading.Event) -> None:
        path = os.path.join(self.checkpoint_dir, rel)
        fd, spilled = self._second_source(rel, path)
        batches: list[list[tuple[ReadJob, memoryview]]] = []
        batch_bytes = 0
        for job, view in items:
            if (
                not batches
                or len(batches[-1]) >= _MAX_IOV
                or batch_bytes >= _HOT_BYTES
                or not follows_at(batches[-1][-1][0], job, spilled)
            ):
                batches.append([])
                batch_bytes = 0
            batches[-1].append((job, view))
            batch_bytes += len(view)
        for batch in batches:
            if stop.is_set():
                return  # another file failed: this load is torn already, and reported by that file
            head = batch[0][0]
            at = head.spill_at if spilled else head.stored.offset
            with torn_if_it_fails(self.rank, path):
                self._read_batch(fd, batch, at, _HOT_BYTES, path)
            for job, _ in batch:
                job.placed = True

    def _read_into_place(self, job: ReadJob) -> None:
        path = os.path.join(self.checkpoint_dir, job.stored.file)
        fd, spilled = self._second_source(job.stored.file, path)
        view = job.allocate_scratch(self._device_scratch(job.scratch_bytes) if job.to_devices else None)
        with torn_if_it_fails(self.rank, path):
            job.read_verified(
                fd, job.spill_at if spilled else job.stored.offset, view, _HOT_BYTES, path, self.algorithm
            )
        job.copy_into_place()

    def _device_scratch(self, nbytes: int) -> torch.Tensor:
        """Pinned host memory reused by every item read again for device destinations (one at a time,
        each copied into place before the next is read): no fresh pages to fault in per item, and the
        copy to the device runs at the DMA's speed instead of through the driver's bounce buffer."""
        if self._pinned is None or self._pinned.numel() < nbytes:
            self._pinned = None
            self._pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self._pinned

    def close(self) -> None:
        """Put back the old bytes of every item read in place unless apply() succeeded; release the
        files kept open, the spill and the scratch memory."""
        try:
            if not self._done and self.backup:
                with signals_deferred():  # all the old bytes back, or a state half old, half new
                    for job in reversed(self._jobs):  # reversed: aliasing views end with the oldest bytes
                        job.restore_old()
        finally:
            self._done = True
            handles, self._open = self._open, {}
            for fd in handles.values():
                fd.close()
            if self._spill is not None:
                self._spill.close()
                self._spill = None
            for job in self._jobs:
                job.release()
            self._pinned = None
            if self._arena is not None:
                self._arena.close()
                self._arena = None
