"""DCP StorageReader for ckptguard: every byte verified before any of it reaches the caller's state.

A load has two phases, with an agreement of all ranks between them (protocol/load.py):

    read_data   (DCP calls it) reads this rank's items and checks every checksum,
                without writing a byte into the caller's tensors or objects:
                items go into scratch buffers while they fit in ``memory_bytes``
                (staged); the rest is read and checked in bounded chunks, and its
                files are kept open (verified only)
    apply       once every rank verified its part: staged items are copied into
                place, verified-only items read again straight into place from
                the files kept open, and checked again; objects are placed

So a corrupt byte anywhere, on any rank, leaves the caller's state exactly as it
was. Staged items cost one memory copy; verified-only ones a second read (from
the page cache when memory allows), which is what bounds memory for states
larger than ``memory_bytes``. The second read can only disagree with the first
if a file of a committed checkpoint was modified in place during the load (never
by ckptguard): that is reported as a TornLoadError, which says so.
"""

from __future__ import annotations

import io
import os
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ckptguard._faults import FaultPhase, fault_point
from ckptguard.checksum import Hasher, checksum
from ckptguard.dcp.codec import dtype_from_name, dtype_name, narrow, tensor_bytes
from ckptguard.dcp.planners import decode_object
from ckptguard.dcp.records import StoredItem
from ckptguard.errors import CheckpointError, CorruptCheckpointError, TornLoadError
from ckptguard.storage import ReadHandle, StorageBackend

_MAX_IOV = 512  # items per vectored read
_CHUNK = 8 << 20  # verified-only items are checked in chunks of this size
_MAX_KEPT_OPEN = 256  # files of verified-only items kept open between the two phases


class GuardedReader(StorageReader):
    def __init__(self, storage: StorageBackend, checkpoint_dir: str, metadata: Metadata, algorithm: str,
                 rank: int, io_threads: int = 4, on_bytes: Callable[[int], None] | None = None,
                 memory_bytes: int = 256 << 20) -> None:
        super().__init__()
        self.storage = storage
        self.on_bytes = on_bytes
        self.checkpoint_dir = checkpoint_dir
        self.metadata = metadata
        self.algorithm = algorithm
        self.rank = rank
        self.io_threads = max(1, io_threads)
        self.memory_bytes = memory_bytes
        self.storage_data: dict[MetadataIndex, StoredItem] = metadata.storage_data
        self._jobs: list[_ReadJob] = []
        self._open: dict[str, ReadHandle] = {}
        self.staged_bytes = 0  # held in scratch buffers between the phases
        self.verified_only_bytes = 0  # read twice

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    # -- phase 1: read and verify, touching nothing of the caller's ---------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        by_item: dict[StoredItem, list[ReadItem]] = defaultdict(list)
        for req in plan.items:
            stored = self.storage_data.get(req.storage_index)
            if stored is None:
                raise CheckpointError(
                    f"rank {self.rank}: {req.storage_index.fqn} (offset {list(req.storage_index.offset or [])}) "
                    f"is not stored in {self.checkpoint_dir}. If this checkpoint lives on node-local disks, "
                    "a rank can only read what its own node wrote: load at the same world size and layout, "
                    "or copy the checkpoint to shared storage to reshard it."
                )
            by_item[stored].append(req)
        # Resolve destinations on this thread (the planner is not ours to call concurrently); resolving
        # only returns views of the caller's tensors, nothing is written to them in this phase.
        jobs: list[_ReadJob] = []
        budget = self.memory_bytes
        for stored, reqs in sorted(by_item.items(), key=lambda kv: (kv[0].file, kv[0].offset)):
            if reqs[0].type == LoadItemType.BYTE_IO:
                job = _ReadJob(stored, reqs, [], staged=True)  # objects are decoded (and checked) now
            else:
                job = _ReadJob(stored, reqs, [planner.resolve_tensor(r).detach() for r in reqs])
                job.check_fits()
                job.staged = stored.length <= budget
            if job.staged:
                budget -= stored.length
                self.staged_bytes += stored.length
            else:
                self.verified_only_bytes += stored.length
            jobs.append(job)
        self._jobs = jobs
        by_file: dict[str, list[_ReadJob]] = defaultdict(list)
        for job in jobs:
            by_file[job.stored.file].append(job)
        first = [True]
        lock = threading.Lock()

        def read_file(rel: str, file_jobs: list[_ReadJob]) -> None:
            path = os.path.join(self.checkpoint_dir, rel)
            fd = self.storage.open_read(path)
            keep = False
            try:
                batch: list[tuple[_ReadJob, memoryview]] = []
                batch_bytes = 0
                checks: list[_ReadJob] = []  # consecutive verified-only items, read together into `chunk`
                checks_bytes = 0
                chunk: memoryview | None = None

                def flush() -> None:
                    nonlocal batch, batch_bytes, checks, checks_bytes
                    if batch:
                        fd.read_into([v for _, v in batch], batch[0][0].stored.offset)
                        for job, view in batch:
                            job.verify(view, path, self.algorithm)
                        if self.on_bytes is not None:
                            self.on_bytes(batch_bytes)
                        batch, batch_bytes = [], 0
                    if checks:
                        assert chunk is not None
                        fd.read_into([chunk[:checks_bytes]], checks[0].stored.offset)
                        pos = 0
                        for job in checks:
                            job.verify(chunk[pos:pos + job.stored.length], path, self.algorithm)
                            pos += job.stored.length
                        if self.on_bytes is not None:
                            self.on_bytes(checks_bytes)
                        checks, checks_bytes = [], 0

                for job in file_jobs:  # in offset order
                    if job.staged:
                        view = job.allocate()
                        # Consecutive staged items: one preadv() for many of them.
                        if checks or (batch and (len(batch) >= _MAX_IOV or batch_bytes >= 64 << 20 or
                                                 not _follows(batch[-1][0], job))):
                            flush()
                        batch.append((job, view))
                        batch_bytes += len(view)
                    else:
                        keep = True
                        if chunk is None:
                            chunk = memoryview(bytearray(_CHUNK))
                        if batch or (checks and (checks_bytes + job.stored.length > _CHUNK
                                                 or not _follows(checks[-1], job))):
                            flush()
                        if job.stored.length > _CHUNK:
                            job.verify_streaming(fd, path, self.algorithm, chunk)
                            if self.on_bytes is not None:
                                self.on_bytes(job.stored.length)
                        else:
                            checks.append(job)
                            checks_bytes += job.stored.length
                    if first[0]:
                        first[0] = False
                        flush()
                        fault_point(FaultPhase.MID_LOAD, self.rank)
                flush()
            except BaseException:
                fd.close()
                raise
            if keep:
                with lock:
                    if len(self._open) < _MAX_KEPT_OPEN:
                        # Read again in the apply phase through this very handle: retention renaming
                        # or deleting the checkpoint meanwhile does not change what it reads.
                        self._open[rel] = fd
                        return
            fd.close()

        files = sorted(by_file.items())
        try:
            if len(files) <= 1 or self.io_threads == 1:
                for rel, fj in files:
                    read_file(rel, fj)
            else:
                with ThreadPoolExecutor(min(self.io_threads, len(files)), thread_name_prefix="ckptguard-read") as pool:
                    for f in [pool.submit(read_file, rel, fj) for rel, fj in files]:
                        f.result()
            for job in jobs:
                if job.reqs[0].type == LoadItemType.BYTE_IO:
                    assert job.raw is not None
                    job.obj = decode_object(job.reqs[0].dest_index.fqn, io.BytesIO(job.raw))
                    job.raw = None
        except BaseException:
            self.close()
            raise
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut

    # -- phase 2: once every rank verified its part ----------------------------------------------
    def apply(self, planner: LoadPlanner) -> None:
        """Copy what was verified into the caller's state (collectively agreed to be safe)."""
        place_object = getattr(planner, "place_object", None)
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
                if job.placed:
                    pass
                elif not job.staged:
                    self._read_into_place(job)
                else:
                    job.copy_into_place()
                for req, target in zip(job.reqs, job.targets, strict=True):
                    planner.commit_tensor(req, target)
                job.release()
        finally:
            self.close()

    def _read_direct_into_place(self) -> None:
        """Verified-only items that go straight into their destinations: one preadv() for many."""
        by_file: dict[str, list[tuple[_ReadJob, memoryview]]] = defaultdict(list)
        for job in self._jobs:
            if not job.staged and job.reqs[0].type != LoadItemType.BYTE_IO:
                view = job.direct_view()
                if view is not None:
                    by_file[job.stored.file].append((job, view))
        for rel, items in by_file.items():
            batches: list[list[tuple[_ReadJob, memoryview]]] = []
            batch_bytes = 0
            for job, view in items:
                if not batches or len(batches[-1]) >= _MAX_IOV or batch_bytes >= 64 << 20 \
                        or not _follows(batches[-1][-1][0], job):
                    batches.append([])
                    batch_bytes = 0
                batches[-1].append((job, view))
                batch_bytes += len(view)
            path = os.path.join(self.checkpoint_dir, rel)
            fd = self._open.get(rel)
            own = fd is None
            if fd is None:
                fd = self.storage.open_read(path)
            try:
                for batch in batches:
                    fd.read_into([v for _, v in batch], batch[0][0].stored.offset)
                    for job, view in batch:
                        try:
                            job.verify(view, path, self.algorithm)
                        except CorruptCheckpointError as e:
                            raise _torn(e, self.rank, path) from None
                        job.placed = True
            finally:
                if own:
                    fd.close()

    def _read_into_place(self, job: _ReadJob) -> None:
        path = os.path.join(self.checkpoint_dir, job.stored.file)
        fd = self._open.get(job.stored.file)
        own = fd is None
        if fd is None:
            fd = self.storage.open_read(path)
        try:
            job.read_into_place(fd, path, self.algorithm)
        except CorruptCheckpointError as e:
            raise _torn(e, self.rank, path) from None
        finally:
            if own:
                fd.close()

    def close(self) -> None:
        """Release the files kept open between the phases."""
        handles, self._open = self._open, {}
        for fd in handles.values():
            fd.close()


def _follows(prev: _ReadJob, job: _ReadJob) -> bool:
    return prev.stored.offset + prev.stored.length == job.stored.offset


def _torn(err: CorruptCheckpointError, rank: int, path: str) -> TornLoadError:
    return TornLoadError(
        f"{err} The same bytes were verified moments before, so the file was modified in place during "
        "this load (ckptguard never does that). Part of this checkpoint may already be in the state "
        "being loaded: load again.", rank=rank, path=path)


@dataclass
class _ReadJob:
    stored: StoredItem
    reqs: list[ReadItem]
    targets: list[torch.Tensor]
    staged: bool = False
    raw: bytearray | None = None  # an object's bytes, until decoded
    obj: Any = None  # an object, decoded
    scratch: torch.Tensor | None = field(default=None, repr=False)
    scratch_view: memoryview | None = field(default=None, repr=False)
    placed: bool = False  # read straight into its destination in the apply phase

    def check_fits(self) -> None:
        """Every destination can take its piece (checked before anything is copied)."""
        s = self.stored
        if s.shape is None:
            raise CheckpointError(f"{s.fqn}: a tensor is expected where the checkpoint stores an object")
        for req, target in zip(self.reqs, self.targets, strict=True):
            if tuple(target.shape) != tuple(req.lengths):
                raise CheckpointError(f"{s.fqn}: stored piece {list(req.lengths)} does not fit destination "
                                      f"{list(target.shape)}")

    def allocate(self) -> memoryview:
        """A scratch buffer for the stored bytes (a tensor of the stored shape, or bytes of an object)."""
        s = self.stored
        if s.shape is None:
            buf = bytearray(s.length)
            self.raw = buf
            return memoryview(buf)
        self.scratch = torch.empty(s.shape, dtype=dtype_from_name(s.dtype or ""))
        view, _ = tensor_bytes(self.scratch) if self.scratch.numel() else (memoryview(b""), self.scratch)
        if len(view) != s.length:
            raise CorruptCheckpointError(f"{s.fqn}: stored length {s.length} does not match its shape "
                                         f"{list(s.shape)}")
        self.scratch_view = view
        return view

    def copy_into_place(self) -> None:
        assert self.scratch is not None
        direct = self.direct_view()
        if direct is not None and self.scratch_view is not None and len(self.scratch_view) == len(direct):
            direct[:] = self.scratch_view  # a plain memcpy: far cheaper than a torch op per small tensor
            return
        for req, target in zip(self.reqs, self.targets, strict=True):
            target.copy_(narrow(self.scratch, req.storage_offsets, req.lengths))

    def release(self) -> None:
        self.scratch = None
        self.scratch_view = None
        self.obj = None

    def _direct_target(self) -> torch.Tensor | None:
        """The destination tensor if the stored bytes can be read straight into it."""
        if len(self.reqs) != 1 or self.stored.shape is None:
            return None
        t, req = self.targets[0], self.reqs[0]
        if (t.device.type != "cpu" or not t.is_contiguous() or dtype_name(t.dtype) != self.stored.dtype
                or tuple(t.shape) != self.stored.shape or any(req.storage_offsets)
                or tuple(req.lengths) != self.stored.shape):
            return None
        return t

    def direct_view(self) -> memoryview | None:
        """The destination's own bytes, if the stored bytes can go straight into them."""
        direct = self._direct_target()
        if direct is None or not direct.numel():
            return None
        view, _ = tensor_bytes(direct)
        return view if len(view) == self.stored.length else None

    def read_into_place(self, fd: ReadHandle, path: str, algorithm: str) -> None:
        """The second read of a verified-only item that cannot go straight into its destination."""
        view = self.allocate()
        fd.read_into([view], self.stored.offset)
        self.verify(view, path, algorithm)
        self.copy_into_place()

    def verify_streaming(self, fd: ReadHandle, path: str, algorithm: str, chunk: memoryview) -> None:
        """Check an item's checksum reading it in chunks (nothing kept)."""
        s = self.stored
        hasher = Hasher(algorithm)
        pos = 0
        while pos < s.length:
            n = min(len(chunk), s.length - pos)
            fd.read_into([chunk[:n]], s.offset + pos)
            hasher.update(chunk[:n])
            pos += n
        self._compare(hasher.hexdigest(), path)

    def verify(self, view: memoryview, path: str, algorithm: str) -> None:
        self._compare(checksum(algorithm, view), path)

    def _compare(self, got: str, path: str) -> None:
        if got != self.stored.checksum:
            s = self.stored
            raise CorruptCheckpointError(
                f"checksum mismatch in {path}, bytes {s.offset}..{s.offset + s.length} ({s.fqn}): "
                f"expected {s.checksum}, read {got}. The checkpoint is corrupt.",
                path=path,
            )
