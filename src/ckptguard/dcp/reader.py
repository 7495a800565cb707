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

import contextlib
import io
import math
import os
import resource
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor

from ckptguard._faults import FaultPhase, fault_point
from ckptguard._pool import ExitSafePool
from ckptguard._signals import signals_deferred
from ckptguard.dcp.planners import decode_object
from ckptguard.dcp.readjob import (
    IN_PLACE,
    STAGED,
    VERIFIED,
    Arena,
    ReadJob,
    Spill,
    follows,
    follows_at,
    no_in_place_for_aliases,
)
from ckptguard.dcp.records import StoredItem
from ckptguard.dcp.values import PLAIN_TENSOR_TYPES
from ckptguard.errors import CheckpointError, CorruptCheckpointError, TornLoadError
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
_ALIGN = 64  # scratch slots in the arena start at this alignment (any dtype, vector loads)
_FD_MARGIN = 256  # descriptors left to the rest of the process when files are kept open for a load

#: Share of MemAvailable a load may hold per rank of this host when ``memory_bytes`` is None, on
#: storage where a second read is not cheap (object stores: a spill to local disk).
MEMORY_SHARE = 0.5
#: What a load holds per rank when MemAvailable cannot be read.
FALLBACK_MEMORY_BYTES = 256 << 20
#: What a load holds per rank by default on POSIX storage when its bytes would not stay in the page
#: cache between the passes (see ``page_cache_bytes``).
POSIX_MEMORY_BYTES = 256 << 20
#: Share of MemAvailable the bytes of one load (this rank's, times the ranks of the host) may take for
#: the page cache to be trusted to keep them between the verifying pass and the placing one.
PAGE_CACHE_SHARE = 0.5

_Work = TypeVar("_Work")  # what one file's work on a reading thread is given


def available_bytes() -> int | None:
    """MemAvailable now (free memory plus what the kernel can reclaim, the page cache included), or
    None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def auto_memory_bytes(local_ranks: int) -> int:
    """The verified-bytes budget of one rank: a share of the memory available now on this host,
    split between the ranks of the host (the loads of a restarted job run at once)."""
    available = available_bytes()
    if available is None:
        return FALLBACK_MEMORY_BYTES
    return int(available * MEMORY_SHARE) // max(1, local_ranks)


def page_cache_fits(rank_bytes: int, local_ranks: int) -> bool:
    """Whether a load of ``rank_bytes`` on each of ``local_ranks`` ranks of this host can count on the
    page cache keeping what the first pass read until the second: then verifying everything first
    and reading it again into place from the files kept open costs a memory copy from the cache,
    which measured cheaper than holding the bytes in fresh host memory (the Performance page)."""
    available = available_bytes()
    return available is not None and rank_bytes * max(1, local_ranks) <= available * PAGE_CACHE_SHARE


class GuardedReader(StorageReader):
    """``memory_bytes`` None: on storage that keeps open files (POSIX), 0 (verify everything, then read
    it again into place from the files kept open) while this rank's bytes fit the page cache
    (:func:`page_cache_fits`), else ``POSIX_MEMORY_BYTES``; on other storage :func:`auto_memory_bytes`
    of ``local_ranks``. ``backup=False`` when the destinations are fresh buffers of the reader's
    caller (nothing to put back on failure)."""

    def __init__(self, storage: StorageBackend, checkpoint_dir: str, metadata: Metadata | None, algorithm: str,
                 rank: int, io_threads: int = 4, on_bytes: Callable[[int], None] | None = None,
                 memory_bytes: int | None = None, local_ranks: int = 1, backup: bool = True,
                 domain_count: int = 1) -> None:
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
            jobs = self._plan_jobs(plan, planner)
            self._read_and_verify(jobs)
        except BaseException:
            self.close()
            raise
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut

    def _plan_jobs(self, plan: LoadPlan, planner: LoadPlanner) -> list[ReadJob]:
        # Grouped by the stored item's identity (one object per item of the metadata): cheaper than
        # hashing every field of it.
        by_item: dict[int, tuple[StoredItem, list[ReadItem]]] = {}
        # Whole tensors planned from the manifest's item table carry their stored item (SafeLoadPlanner).
        stored_item: Callable[[ReadItem], StoredItem | None] = getattr(planner, "stored_item", lambda _: None)
        for req in plan.items:
            stored = stored_item(req) or self.storage_data.get(req.storage_index)
            if stored is None and self.domain_count == 1:  # the manifest holds every item: it contradicts itself
                raise CorruptCheckpointError(
                    f"rank {self.rank}: the checkpoint's metadata in {self.checkpoint_dir} lists a chunk of "
                    f"{req.storage_index.fqn} at offset {list(req.storage_index.offset or [])} that no stored "
                    "item holds: the manifest is corrupt", path=self.checkpoint_dir)
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
        self._check_coverage(plan, planner)
        # Resolve destinations on this thread (the planner is not ours to call concurrently); resolving
        # only returns views of the caller's tensors.
        jobs: list[ReadJob] = []
        for stored, reqs in sorted(by_item.values(), key=lambda kv: (kv[0].file, kv[0].offset)):
            if reqs[0].type == LoadItemType.BYTE_IO:
                job = ReadJob(stored, reqs, [], mode=STAGED)  # objects are decoded (and checked) now
            else:
                job = ReadJob(stored, reqs, [_detached(planner.resolve_tensor(r)) for r in reqs])
                job.check_fits()
            jobs.append(job)
        no_in_place_for_aliases(jobs)
        budget = self._budget(jobs)
        arena_bytes = 0
        for job in jobs:
            length = job.stored.length
            if job.stored.shape is None:  # an object: always staged (decoded in this phase)
                budget -= length
                self.staged_bytes += length
                continue
            if job.direct is not None and not self.backup:
                job.mode = IN_PLACE  # fresh destinations: nothing to put back, nothing to hold
                continue
            if length <= budget:
                job.mode = IN_PLACE if job.direct is not None else STAGED
                budget -= length
                self.staged_bytes += length
                job.slot = arena_bytes
                arena_bytes += -(-length // _ALIGN) * _ALIGN
            else:
                job.mode = VERIFIED
                self.verified_only_bytes += length
        self._arena = Arena(arena_bytes)
        self._jobs = jobs
        return jobs

    def _check_coverage(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Every element of every destination tensor the checkpoint holds a value for is read exactly
        once. DCP plans a destination's reads from the chunks the metadata lists and reads nothing
        where they leave a gap: a manifest whose chunk list disagrees with what it stores (corrupt, or
        re-sealed by hand) would load part of a tensor, or give back uninitialised memory, and succeed.
        A whole tensor read by the planner's direct path is covered by construction."""
        direct: dict[int, Any] = getattr(planner, "_direct_targets", {})
        reads: dict[str, list[ReadItem]] = defaultdict(list)
        for req in plan.items:
            if req.type != LoadItemType.BYTE_IO and id(req) not in direct:
                reads[req.dest_index.fqn].append(req)
        whole = {entry[0].dest_index.fqn for entry in direct.values()}
        stored = self.metadata.state_dict_metadata if self.metadata is not None else {}
        state: dict[str, Any] = getattr(planner, "state_dict", {})
        for fqn, value in state.items():
            if fqn in whole or fqn not in stored or not isinstance(value, torch.Tensor):
                continue
            local = _local_tensor(value)
            if local is None:
                continue
            got = reads.get(fqn, [])
            covered = sum(math.prod(r.lengths) for r in got)
            if covered != local.numel() or (len(got) > 1 and _boxes_overlap(got)):
                raise CorruptCheckpointError(
                    f"rank {self.rank}: the checkpoint's metadata in {self.checkpoint_dir} does not cover "
                    f"{fqn} exactly once ({covered} of its {local.numel()} elements on this rank, from "
                    f"{len(got)} chunk(s)): its chunk list disagrees with what it stores; the manifest is "
                    "corrupt. Nothing was changed", path=self.checkpoint_dir)

    def _budget(self, jobs: list[ReadJob]) -> int:
        """The verified-bytes budget of this load: the one given, else (POSIX) 0 when the page cache
        can keep this rank's bytes between the passes, ``POSIX_MEMORY_BYTES`` when it cannot."""
        if self.memory_bytes is not None:
            return self.memory_bytes
        rank_bytes = sum(job.stored.length for job in jobs)
        return 0 if page_cache_fits(rank_bytes, self.local_ranks) else POSIX_MEMORY_BYTES

    def _read_and_verify(self, jobs: list[ReadJob]) -> None:
        by_file: dict[str, list[ReadJob]] = defaultdict(list)
        for job in jobs:
            by_file[job.stored.file].append(job)
        files = sorted(by_file.items())
        # Files a second read comes from: kept open where an open handle keeps the bytes (a rename or
        # unlink by retention changes nothing for it), as many as the descriptor limit allows; the
        # verified bytes of the others are spilled to a local temporary file.
        second = [rel for rel, fj in files if any(j.mode == VERIFIED for j in fj)]
        keep = set(second[:_keepable(len(second))]) if self.storage.keeps_open_files else set()
        if len(keep) < len(second):
            self._spill = Spill()
            self.spilled_bytes = sum(j.stored.length for rel, fj in files if rel not in keep
                                     for j in fj if j.mode == VERIFIED)
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
            if job.reqs[0].type == LoadItemType.BYTE_IO:
                assert job.raw is not None
                job.obj = decode_object(job.reqs[0].dest_index.fqn, io.BytesIO(job.raw))
                job.raw = None

    def _read_file(self, fd: ReadHandle, path: str, file_jobs: list[ReadJob], keep: bool, first: list[bool],
                   lock: threading.Lock, stop: threading.Event) -> bool:
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
                raise _Stopped()
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
                    view = chunk[pos:pos + job.stored.length]
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
                if checks or (batch and (len(batch) >= _MAX_IOV or batch_bytes >= self._batch_cap or
                                         not follows(batch[-1][0], job))):
                    flush()
                batch.append((job, view))
                batch_bytes += len(view)
            else:
                if chunk is None:
                    chunk = memoryview(bytearray(self._chunk))
                if batch or (checks and (checks_bytes + job.stored.length > self._chunk
                                         or not follows(checks[-1], job))):
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
        place_object = getattr(planner, "place_object", None)
        # DCP's default planner does nothing on commit_tensor: not called then, once per item.
        commit = type(planner).commit_tensor is not DefaultLoadPlanner.commit_tensor
        # Every rank agreed: a Ctrl-C meanwhile is delivered once every byte is in place, never
        # halfway (the verified-only items' old bytes are not kept: a state half placed is torn).
        with signals_deferred():
            self._apply(planner, place_object, commit)

    def _apply(self, planner: LoadPlanner, place_object: Callable[[ReadItem, Any], None] | None,
               commit: bool) -> None:
        try:
            self._read_direct_into_place()
            for job in self._jobs:
                if job.reqs[0].type == LoadItemType.BYTE_IO:
                    for req in job.reqs:
                        if place_object is not None:
                            place_object(req, job.obj)
                        else:  # a planner without the split: hand it the bytes again
                            buf = io.BytesIO()
                            torch.save(job.obj, buf)
                            buf.seek(0)
                            planner.load_bytes(req, buf)
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

    def _read_batch(self, fd: ReadHandle, batch: list[tuple[ReadJob, memoryview]], at: int, piece: int,
                    path: str) -> None:
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
        self._on_threads(list(by_file.items()), lambda rel, items: self._place_file(rel, items, stop), stop,
                         "ckptguard-place")

    def _on_threads(self, files: Sequence[tuple[str, _Work]], work: Callable[[str, _Work], None],
                    stop: threading.Event, name: str) -> None:
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
            if not batches or len(batches[-1]) >= _MAX_IOV or batch_bytes >= _HOT_BYTES \
                    or not follows_at(batches[-1][-1][0], job, spilled):
                batches.append([])
                batch_bytes = 0
            batches[-1].append((job, view))
            batch_bytes += len(view)
        for batch in batches:
            if stop.is_set():
                return  # another file failed: this load is torn already, and reported by that file
            head = batch[0][0]
            at = head.spill_at if spilled else head.stored.offset
            with _torn_if_it_fails(self.rank, path):
                self._read_batch(fd, batch, at, _HOT_BYTES, path)
            for job, _ in batch:
                job.placed = True

    def _read_into_place(self, job: ReadJob) -> None:
        path = os.path.join(self.checkpoint_dir, job.stored.file)
        fd, spilled = self._second_source(job.stored.file, path)
        view = job.allocate_scratch(self._device_scratch(job.scratch_bytes) if job.to_devices else None)
        with _torn_if_it_fails(self.rank, path):
            job.read_verified(fd, job.spill_at if spilled else job.stored.offset, view, _HOT_BYTES, path,
                              self.algorithm)
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


def _local_tensor(value: torch.Tensor) -> torch.Tensor | None:
    """The part of a destination this rank holds: a plain tensor, a DTensor's local shard; None for
    other kinds (DCP's own planning handles them)."""
    if type(value) in PLAIN_TENSOR_TYPES:
        return value
    if isinstance(value, DTensor):
        local: torch.Tensor = value.to_local()
        return local
    return None


def _boxes_overlap(reads: list[ReadItem]) -> bool:
    """Whether two of these reads write one element of their destination (boxes of dest_offsets and
    lengths; a read of no element overlaps nothing)."""
    lo = np.array([list(r.dest_offsets) for r in reads], dtype=np.int64).reshape(len(reads), -1)
    hi = lo + np.array([list(r.lengths) for r in reads], dtype=np.int64).reshape(len(reads), -1)
    keep = (hi > lo).all(axis=1)
    lo, hi = lo[keep], hi[keep]
    if lo.shape[1] == 1:  # one dimension: sorted, each ends where or before the next starts
        order = np.argsort(lo[:, 0], kind="stable")
        return bool((lo[order[1:], 0] < hi[order[:-1], 0]).any())
    for start in range(0, len(lo), 256):  # pairs, a block of rows at a time
        a_lo, a_hi = lo[start:start + 256, None, :], hi[start:start + 256, None, :]
        meet = (np.maximum(a_lo, lo[None]) < np.minimum(a_hi, hi[None])).all(axis=2)
        meet[np.arange(len(a_lo)), np.arange(start, start + len(a_lo))] = False
        if meet.any():
            return True
    return False


def _detached(t: torch.Tensor) -> torch.Tensor:
    """A destination written without autograd (a new view only where autograd would see the write)."""
    return t.detach() if t.requires_grad else t


class _Stopped(Exception):
    """Another file of the same load failed: this one stops reading."""


def _keepable(wanted: int) -> int:
    """How many files may be kept open for a second read: the soft descriptor limit is raised toward
    the hard one when ``wanted`` needs it; ``_FD_MARGIN`` descriptors stay free for the rest."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + 2 * _FD_MARGIN
    if need > soft:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = _FD_MARGIN
    return max(0, min(wanted, soft - in_use - _FD_MARGIN))


@contextlib.contextmanager
def _torn_if_it_fails(rank: int, path: str) -> Iterator[None]:
    """The second read of bytes verified moments before: whatever fails there (a checksum, a file
    truncated, an I/O error) fails once destinations may already hold part of the checkpoint, so it
    is a TornLoadError, never a corrupt checkpoint to fall back from."""
    try:
        yield
    except (CheckpointError, OSError) as e:
        raise TornLoadError(
            f"{e} The same bytes were verified moments before, so the file was modified in place during "
            "this load (ckptguard never does that). Part of this checkpoint may already be in the state "
            "being loaded: load again.", rank=rank, path=path) from None
