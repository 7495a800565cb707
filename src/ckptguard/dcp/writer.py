"""DCP StorageWriter for ckptguard: tensor bytes from their memory straight to new files.

Several files per rank, written by several threads, each item checksummed while
the file is flushed to disk; files are created exclusively through the storage
backend (one writer per path). The commit is ckptguard's own protocol.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from ckptguard._faults import FaultPhase, fault_point
from ckptguard._pool import ExitSafePool
from ckptguard.checksum import checksum
from ckptguard.dcp.codec import dtype_name, tensor_bytes
from ckptguard.dcp.records import FileEntry, StoredItem
from ckptguard.errors import from_os_error
from ckptguard.storage import StorageBackend, WriteStream

H = TypeVar("H")  # what the pre-write hook returns


@dataclass(frozen=True)
class WriteOutcome(Generic[H]):
    """What this rank wrote, for the commit (made by write_data once every file is written)."""

    files: tuple[FileEntry, ...] = ()
    before_write: H | None = None  # what the pre-write hook returned (None: no hook)
    stored: tuple[StoredItem, ...] = ()  # where each of this rank's items went (write_planned)


class GuardedWriter(StorageWriter, Generic[H]):
    """Writes this rank's part into ``staging_dir``: file ``index`` of this rank is at
    ``data_file(index)`` (a path relative to ``staging_dir``; every file of one rank in one directory).

    ``before_write`` runs once, before the first byte (the caller stores what belongs next to the
    data); what it returns is in ``outcome.before_write``."""

    def __init__(
        self,
        storage: StorageBackend,
        staging_dir: str,
        data_file: Callable[[int], str],
        rank: int,
        algorithm: str,
        io_threads: int = 4,
        before_write: Callable[[], H] | None = None,
        error_root: str | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__()
        self.storage = storage
        self.error_root = error_root
        self.on_bytes = on_bytes
        self.staging_dir = staging_dir
        self.data_file = data_file
        self.rank = rank
        self.algorithm = algorithm
        self.io_threads = max(1, io_threads)
        self.before_write = before_write
        self.outcome: WriteOutcome[H] = WriteOutcome()  # set by write_data (DCP's interface returns futures)
        self.metadata: Metadata | None = None  # rank 0, after planning
        self.plan: SavePlan | None = None  # this rank's part of the global plan

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def storage_meta(self) -> None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        fault_point(FaultPhase.BEFORE_WRITE, self.rank)
        hooked = self.before_write() if self.before_write is not None else None
        buffers: list[tuple[WriteItem, memoryview, Any]] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                buffers.append((item, data.getbuffer(), data))
            else:
                assert isinstance(data, torch.Tensor)
                mv, owner = tensor_bytes(data)
                buffers.append((item, mv, owner))
        buckets = _balance(buffers, self.io_threads)
        results: list[WriteResult] = []
        files: list[FileEntry] = []
        total = sum(len(b[1]) for b in buffers)
        written = [0]

        def write_bucket(index: int, bucket: list[tuple[WriteItem, memoryview, Any]]) -> None:
            rel = self.data_file(index)
            path = os.path.join(self.staging_dir, rel)
            offset = 0
            out: list[WriteResult] = []
            stream = self.storage.open_new(path)
            try:
                batch = _Batch(stream)
                placed: list[tuple[WriteItem, memoryview, Any, int]] = []
                for item, mv, owner in bucket:
                    batch.add(mv)
                    placed.append((item, mv, owner, offset))
                    offset += len(mv)
                    if index == 0 and not written[0] and offset * 2 * len(buckets) >= total:
                        batch.flush()
                        written[0] = 1
                        fault_point(FaultPhase.MID_WRITE, self.rank)
                    if self.on_bytes is not None:
                        self.on_bytes(len(mv))
                batch.flush()
                # The bytes are in the page cache now. The disk takes longer to absorb them than the
                # CPU takes to checksum them (from the same memory, which nothing changes during a
                # save): flush and checksum at the same time, and checksumming costs ~nothing.
                flushed: list[BaseException] = []
                flusher = threading.Thread(target=_sync_noting_errors, args=(stream, flushed), name="ckptguard-fsync")
                flusher.start()
                try:
                    for item, mv, owner, at in placed:
                        digest = checksum(self.algorithm, mv)
                        out.append(
                            WriteResult(
                                index=item.index,
                                size_in_bytes=len(mv),
                                storage_data=_stored(item, owner, rel, at, len(mv), digest),
                            )
                        )
                finally:
                    flusher.join()
                if flushed:
                    raise flushed[0]
            finally:
                stream.close()
            results.extend(out)
            files.append(FileEntry(rel, offset, self.rank))

        try:
            if len(buckets) <= 1:  # nothing to write on this rank (all deduplicated elsewhere), or one file
                for b in buckets:
                    write_bucket(0, b)
            else:
                with ExitSafePool(len(buckets), thread_name_prefix="ckptguard-write") as pool:
                    for f in [pool.submit(write_bucket, i, b) for i, b in enumerate(buckets)]:
                        f.result()
            if buckets:
                self.storage.sync_dir(os.path.dirname(os.path.join(self.staging_dir, self.data_file(0))))
        except OSError as e:  # with what this rank needed, which the disk-full message reports
            raise from_os_error(e, self.staging_dir, self.rank, needed_bytes=total, root=self.error_root) from e
        fault_point(FaultPhase.AFTER_WRITE, self.rank)
        self.outcome = WriteOutcome(tuple(sorted(files, key=lambda f: f.path)), hooked)
        fut: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        fut.set_result(results)
        return fut

    def write_planned(self, planner: SavePlanner) -> WriteOutcome[H]:
        """Write this rank's part of the plan made by plan_collectively(); what it wrote, and where."""
        assert self.plan is not None
        results = self.write_data(planner.finish_plan(self.plan), planner).wait()
        return replace(self.outcome, stored=tuple(r.storage_data for r in results))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # Part of DCP's interface; the commit is ckptguard's own protocol (Checkpointer._commit).
        self.metadata = metadata


def _sync_noting_errors(stream: WriteStream, errors: list[BaseException]) -> None:
    try:
        stream.sync()
    except (OSError, ValueError) as e:  # ValueError: the stream closed under it (a Ctrl-C in the writer)
        errors.append(e)


class _Batch:
    """Small items go to the file in one writev() per batch; large ones straight through.

    Written ``stable``: every item's bytes (the state's own memory, or a copy ``write_data`` holds)
    stay alive and unchanged until the stream is synced, so an object store sends them from there."""

    MAX_IOV = 512
    MAX_BYTES = 8 << 20

    def __init__(self, stream: WriteStream) -> None:
        self.stream = stream
        self.views: list[memoryview] = []
        self.bytes = 0

    def add(self, mv: memoryview) -> None:
        if len(mv) >= self.MAX_BYTES:
            self.flush()
            self.stream.write([mv], stable=True)
            return
        if not len(mv):
            return
        self.views.append(mv)
        self.bytes += len(mv)
        if len(self.views) >= self.MAX_IOV or self.bytes >= self.MAX_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.views:
            self.stream.write(self.views, stable=True)
        self.views = []
        self.bytes = 0


def _stored(item: WriteItem, owner: Any, rel: str, offset: int, length: int, digest: str) -> StoredItem:
    offsets = tuple(int(x) for x in item.index.offset) if item.index.offset is not None else None
    if item.type == WriteItemType.BYTE_IO:
        return StoredItem(item.index.fqn, offsets, rel, offset, length, digest)
    assert isinstance(owner, torch.Tensor)
    return StoredItem(
        item.index.fqn, offsets, rel, offset, length, digest, dtype=dtype_name(owner.dtype), shape=tuple(owner.shape)
    )


_MIN_BYTES_PER_FILE = 32 << 20


def _balance(buffers: list[tuple[WriteItem, memoryview, Any]], n: int) -> list[list[tuple[WriteItem, memoryview, Any]]]:
    """Split items into at most n files of similar size (largest first into the lightest).

    Small states go to one file: a thread per file only pays off once each file
    is large enough to keep the disk busy.
    """
    if not buffers:
        return []
    total = sum(len(b[1]) for b in buffers)
    n = max(1, min(n, len(buffers), -(-total // _MIN_BYTES_PER_FILE)))
    buckets: list[list[tuple[WriteItem, memoryview, Any]]] = [[] for _ in range(n)]
    sizes = [0] * n
    for b in sorted(buffers, key=lambda b: -len(b[1])):
        i = sizes.index(min(sizes))
        buckets[i].append(b)
        sizes[i] += len(b[1])
    return [b for b in buckets if b]
