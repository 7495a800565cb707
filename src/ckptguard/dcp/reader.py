"""DCP StorageReader for ckptguard: ranged reads straight into destination tensors, every byte checked.

Items stored whole and contiguous are read straight into their destination
(one vectored read for many of them); the rest go through a scratch tensor and
DCP's resharding. Every byte read is checked against its checksum.
"""

from __future__ import annotations

import io
import os
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ckptguard._faults import FaultPhase, fault_point
from ckptguard.checksum import checksum
from ckptguard.dcp.codec import dtype_from_name, dtype_name, narrow, tensor_bytes
from ckptguard.dcp.records import StoredItem
from ckptguard.errors import CheckpointError, CorruptCheckpointError
from ckptguard.storage import ReadHandle, StorageBackend

_MAX_IOV = 512  # items per vectored read


class GuardedReader(StorageReader):
    def __init__(self, storage: StorageBackend, checkpoint_dir: str, metadata: Metadata, algorithm: str,
                 rank: int, io_threads: int = 4, on_bytes: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.storage = storage
        self.on_bytes = on_bytes
        self.checkpoint_dir = checkpoint_dir
        self.metadata = metadata
        self.algorithm = algorithm
        self.rank = rank
        self.io_threads = max(1, io_threads)
        self.storage_data: dict[MetadataIndex, StoredItem] = metadata.storage_data

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
        # Resolve destinations on this thread; the planner is not ours to call concurrently.
        jobs: list[_ReadJob] = []
        for stored, reqs in by_item.items():
            if reqs[0].type == LoadItemType.BYTE_IO:
                jobs.append(_ReadJob(stored, reqs, []))
            else:
                jobs.append(_ReadJob(stored, reqs, [planner.resolve_tensor(r).detach() for r in reqs]))
        by_file: dict[str, list[_ReadJob]] = defaultdict(list)
        for job in jobs:
            by_file[job.stored.file].append(job)
        first = [True]

        def read_file(rel: str, file_jobs: list[_ReadJob]) -> None:
            path = os.path.join(self.checkpoint_dir, rel)
            fd = self.storage.open_read(path)
            try:
                batch: list[tuple[_ReadJob, memoryview]] = []
                batch_bytes = 0

                def flush() -> None:
                    nonlocal batch, batch_bytes
                    if batch:
                        _read_batch(fd, path, batch, self.algorithm)
                        if self.on_bytes is not None:
                            self.on_bytes(batch_bytes)
                        batch, batch_bytes = [], 0

                for job in sorted(file_jobs, key=lambda j: j.stored.offset):
                    view = job.direct_view()
                    if view is not None:
                        # Contiguous items whose bytes go straight into their destination tensors:
                        # one preadv() for many of them.
                        if batch and (len(batch) >= _MAX_IOV or batch_bytes >= 64 << 20 or
                                      batch[-1][0].stored.offset + batch[-1][0].stored.length != job.stored.offset):
                            flush()
                        batch.append((job, view))
                        batch_bytes += len(view)
                    else:
                        flush()
                        job.run(fd, path, self.algorithm)
                        if self.on_bytes is not None:
                            self.on_bytes(job.stored.length)
                    if first[0]:
                        first[0] = False
                        flush()
                        fault_point(FaultPhase.MID_LOAD, self.rank)
                flush()
            finally:
                fd.close()

        files = sorted(by_file.items())
        if len(files) <= 1 or self.io_threads == 1:
            for rel, fj in files:
                read_file(rel, fj)
        else:
            with ThreadPoolExecutor(min(self.io_threads, len(files)), thread_name_prefix="ckptguard-read") as pool:
                for f in [pool.submit(read_file, rel, fj) for rel, fj in files]:
                    f.result()
        for job in jobs:
            for i, req in enumerate(job.reqs):
                if req.type == LoadItemType.BYTE_IO:
                    assert job.raw is not None
                    planner.load_bytes(req, io.BytesIO(job.raw))
                else:
                    planner.commit_tensor(req, job.targets[i])
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut


def _read_batch(fd: ReadHandle, path: str, batch: list[tuple[_ReadJob, memoryview]], algorithm: str) -> None:
    fd.read_into([v for _, v in batch], batch[0][0].stored.offset)
    for job, view in batch:
        job.verify(view, path, algorithm)


@dataclass
class _ReadJob:
    stored: StoredItem
    reqs: list[ReadItem]
    targets: list[torch.Tensor]
    raw: bytes | None = None

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
        """The destination's bytes, if this item can be read straight into them."""
        target = self._direct_target()
        if target is None or not target.numel():
            return None
        view, _ = tensor_bytes(target)
        return view if len(view) == self.stored.length else None

    def run(self, fd: ReadHandle, path: str, algorithm: str) -> None:
        s = self.stored
        if s.shape is None:  # serialized object
            buf = bytearray(s.length)
            fd.read_into([memoryview(buf)], s.offset)
            self.verify(memoryview(buf), path, algorithm)
            self.raw = bytes(buf)
            return
        direct = self._direct_target()
        if direct is not None:
            view, _ = tensor_bytes(direct) if direct.numel() else (memoryview(b""), direct)
            if len(view) != s.length:
                raise CheckpointError(f"{path}: {s.fqn} has {s.length} bytes stored, destination needs {len(view)}",
                                      path=path)
            fd.read_into([view], s.offset)
            self.verify(view, path, algorithm)
            return
        src = torch.empty(s.shape, dtype=dtype_from_name(s.dtype or ""))
        view, _ = tensor_bytes(src) if src.numel() else (memoryview(b""), src)
        if len(view) != s.length:
            raise CheckpointError(f"{path}: {s.fqn} stored length {s.length} does not match its shape {list(s.shape)}",
                                  path=path)
        fd.read_into([view], s.offset)
        self.verify(view, path, algorithm)
        for req, target in zip(self.reqs, self.targets, strict=True):
            piece = narrow(src, req.storage_offsets, req.lengths)
            if target.shape != piece.shape:
                raise CheckpointError(f"{s.fqn}: stored piece {list(piece.shape)} does not fit destination "
                                      f"{list(target.shape)}")
            target.copy_(piece)

    def verify(self, view: memoryview, path: str, algorithm: str) -> None:
        got = checksum(algorithm, view)
        if got != self.stored.checksum:
            s = self.stored
            raise CorruptCheckpointError(
                f"checksum mismatch in {path}, bytes {s.offset}..{s.offset + s.length} ({s.fqn}): "
                f"expected {s.checksum}, read {got}. The checkpoint is corrupt.",
                path=path,
            )
