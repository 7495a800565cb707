"""The data path: DCP StorageWriter/StorageReader and planners for ckptguard checkpoints.

DCP plans what each rank writes and reads (deduplication, resharding); these
classes do the I/O. Tensor bytes go from the tensor's memory straight to the
file with os.write (no serialized copy), several files per rank written by
several threads, each item checksummed in the same pass. Reads go straight into
the destination tensor where the stored chunk matches it, and every byte read is
checked against its checksum. DCP's metadata travels as JSON in our manifest;
serialized objects are loaded with ``torch.load(weights_only=True)`` only.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    LoadPlan,
    LoadPlanner,
    Metadata,
    SavePlan,
    SavePlanner,
    StorageReader,
    StorageWriter,
)

# DCP's own helper for writing a loaded object back into the nested state dict.
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ckptguard import layout
from ckptguard._faults import fault_point
from ckptguard.checksum import checksum
from ckptguard.comm import Comm, local_failure, order_failures, raise_failures
from ckptguard.errors import CheckpointError, CorruptCheckpointError
from ckptguard.manifest import FileEntry, StoredItem
from ckptguard.storage.posix import explain_os_error, fsync_dir, retry_stale, write_all

_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}


_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                 torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata") from None


def narrow(t: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
        if o != 0 or n != t.size(dim):
            t = t.narrow(dim, o, n)
    return t


def tensor_bytes(t: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """The raw bytes of a tensor without copying where possible (and the tensor that owns them)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b""), t
    if t.dtype in _NUMPY_DTYPES:
        return memoryview(t.numpy()).cast("B"), t
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()), t


# -- DCP metadata <-> JSON --------------------------------------------------------------


def metadata_to_json(md: Metadata) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            sd[fqn] = {"type": "bytes"}
        elif isinstance(entry, TensorStorageMetadata):
            props = entry.properties
            if props.layout != torch.strided:
                raise CheckpointError(f"{fqn}: tensors with layout {props.layout} are not supported")
            sd[fqn] = {
                "type": "tensor",
                "dtype": dtype_name(props.dtype),
                "requires_grad": bool(props.requires_grad),
                "size": list(entry.size),
                # Flat [offsets..., sizes..., offsets..., sizes...]: one list per tensor, not three
                # per chunk (a tensor sharded over 16,384 ranks has 16,384 chunks).
                "chunks": [x for c in entry.chunks for x in (*c.offsets, *c.sizes)],
            }
        else:
            raise CheckpointError(f"{fqn}: unsupported DCP storage metadata {type(entry).__name__}")
    planner_data = md.planner_data if isinstance(md.planner_data, dict) else {}
    return {
        "version": md.version,
        "state_dict": sd,
        "planner_data": {k: list(v) for k, v in planner_data.items()},
    }


def metadata_from_json(obj: dict[str, Any], items: Sequence[StoredItem]) -> Metadata:
    props: dict[tuple[str, bool], TensorProperties] = {}
    try:
        sd: dict[str, Any] = {}
        for fqn, e in obj["state_dict"].items():
            if e["type"] == "bytes":
                sd[fqn] = BytesStorageMetadata()
            elif e["type"] == "tensor":
                key = (e["dtype"], bool(e["requires_grad"]))
                if key not in props:
                    props[key] = TensorProperties(dtype=dtype_from_name(key[0]), requires_grad=key[1])
                ndim = len(e["size"])
                flat = e["chunks"]
                step = 2 * ndim
                if ndim == 0:
                    chunks = [ChunkStorageMetadata(offsets=torch.Size(), sizes=torch.Size())] * (len(flat) or 1)
                else:
                    if len(flat) % step:
                        raise ValueError(f"{fqn}: chunk list length {len(flat)} is not a multiple of {step}")
                    chunks = [ChunkStorageMetadata(offsets=torch.Size(flat[i:i + ndim]),
                                                   sizes=torch.Size(flat[i + ndim:i + step]))
                              for i in range(0, len(flat), step)]
                sd[fqn] = TensorStorageMetadata(properties=props[key], size=torch.Size(e["size"]), chunks=chunks)
            else:
                raise ValueError(f"unknown entry type {e['type']!r}")
        planner_data = {}
        for k, path in obj["planner_data"].items():
            if not isinstance(path, list) or not all(isinstance(p, str | int) for p in path):
                raise ValueError(f"bad planner path for {k!r}")
            planner_data[str(k)] = tuple(path)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"invalid DCP metadata in manifest: {type(e).__name__}: {e}") from None
    storage = {item_index(i): i for i in items}
    return Metadata(state_dict_metadata=sd, planner_data=planner_data, storage_data=storage,
                    version=obj.get("version"))


def item_index(item: StoredItem) -> MetadataIndex:
    return MetadataIndex(item.fqn, torch.Size(item.offsets) if item.offsets is not None else None)


# -- planners ---------------------------------------------------------------------------


class DomainSavePlanner(DefaultSavePlanner):
    """DCP's planner, with replicated tensors written once per storage domain, not once per job.

    DCP deduplicates replicated tensors across all ranks, which assumes one
    shared filesystem. With node-local disks each domain must hold its own copy,
    or a node could not load the replicated parameters (DDP) from its own disk.
    """

    def __init__(self, domain_of_rank: Sequence[int], cache_key: str) -> None:
        # DCP's plan caching: when no rank's plan changed since the last save (the usual case:
        # same model, same shapes), ranks send empty plans and the coordinator reuses the global
        # plan. The cache is class-level in DCP; the key keeps Checkpointers (and their storage
        # domains, which shape the global plan) apart.
        super().__init__(dedup_save_to_lowest_rank=False, enable_plan_caching=True)
        self.domain_of_rank = list(domain_of_rank)
        self._cached_plans_key = plan_cache_key(cache_key)

    def create_local_plan(self) -> SavePlan:
        sent = super().create_local_plan()
        self.local_plan = self.plan  # the full plan, even when caching sends an empty one
        return sent

    def replicated_digests(self) -> dict[str, str]:
        """See replicated_digests(); computed from this rank's plan before deduplication."""
        return replicated_digests(self.local_plan, self.state_dict)

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        global_plan, metadata = super()._create_global_plan(all_plans)
        if len(set(self.domain_of_rank)) <= 1:
            return global_plan, metadata
        canonical: dict[MetadataIndex, tuple[int, WriteItem]] = {}
        for rank, plan in enumerate(global_plan):
            for item in plan.items:
                canonical[item.index] = (rank, item)
        extra: dict[int, list[WriteItem]] = defaultdict(list)
        covered: set[tuple[MetadataIndex, int]] = {(i, self.domain_of_rank[r]) for i, (r, _) in canonical.items()}
        for rank, plan in enumerate(all_plans):
            dom = self.domain_of_rank[rank]
            for item in plan.items:
                key = (item.index, dom)
                if key not in covered:
                    covered.add(key)
                    extra[rank].append(canonical[item.index][1])
        global_plan = [replace(p, items=p.items + extra[r]) if extra.get(r) else p
                       for r, p in enumerate(global_plan)]
        return global_plan, metadata


_DIGEST_LIMIT = 64 << 10


def plan_cache_key(instance: str) -> str:
    return f"ckptguard:{instance}"


def forget_cached_plans(instance: str) -> None:
    """Drop DCP's class-level cached plans of one Checkpointer (after a failed save, and at close)."""
    key = plan_cache_key(instance)
    for name in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
                 "_cached_final_save_plan"):
        cache = getattr(SavePlanner, name, None)
        if isinstance(cache, dict):
            cache.pop(key, None)


def replicated_digests(plan: SavePlan, state_dict: dict[str, Any]) -> dict[str, str]:
    """Checksums of this rank's small non-sharded values, to catch values that differ across ranks.

    DCP treats every plain tensor and object as replicated and keeps one rank's
    copy: a per-rank value (an RNG state, a data-loader position) saved that way
    silently comes back as another rank's. Small values are where that happens;
    large ones are model weights, identical by construction under DDP.
    """
    out: dict[str, str] = {}
    for item in plan.items:
        if item.type == WriteItemType.SHARD:
            continue
        obj = state_dict.get(item.index.fqn)
        if isinstance(obj, torch.Tensor):
            if obj.numel() * obj.element_size() <= _DIGEST_LIMIT and type(obj) is torch.Tensor:
                mv, _ = tensor_bytes(obj)
                out[item.index.fqn] = checksum("xxh3-64", mv)
        elif item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(obj, buf)
            if buf.tell() <= _DIGEST_LIMIT:
                out[item.index.fqn] = checksum("xxh3-64", buf.getbuffer())
    return out


def check_replicated(digests: list[dict[str, str]]) -> str | None:
    """Rank 0: the first plain value that differs across ranks, as an error message, or None."""
    first: dict[str, tuple[int, str]] = {}
    for rank, mine in enumerate(digests):
        for fqn, digest in mine.items():
            seen = first.setdefault(fqn, (rank, digest))
            if seen[1] != digest:
                return (f"{fqn!r} differs between rank {seen[0]} and rank {rank}, but it is a plain value, which "
                        f"DCP stores once for all ranks: every rank would load rank {seen[0]}'s copy. Wrap "
                        "per-rank state in ckptguard.PerRank(...) (e.g. RNG states, data loader positions), or "
                        "make it identical on every rank.")
    return None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with objects loaded by torch.load(weights_only=True): no code runs on load.

    Planning is also faster in the common case: a plain tensor stored whole, as
    one chunk of the same shape, gets its read item directly; everything else
    (DTensor shards, resharding, size mismatches, missing keys) goes through
    DCP's general planner.
    """

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        stored = self.metadata.state_dict_metadata
        direct: list[ReadItem] = []
        rest: dict[str, Any] = {}
        for fqn, obj in self.state_dict.items():
            md = stored.get(fqn)
            if (type(obj) is torch.Tensor and isinstance(md, TensorStorageMetadata) and len(md.chunks) == 1
                    and md.chunks[0].sizes == md.size == obj.size() and not any(md.chunks[0].offsets)):
                zero = md.chunks[0].offsets
                index = MetadataIndex(fqn, zero)
                direct.append(ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=zero,
                                       storage_index=index, storage_offsets=zero, lengths=md.size))
            else:
                rest[fqn] = obj
        general = create_default_local_load_plan(rest, self.metadata, not self.allow_partial_load)
        return LoadPlan(direct + general.items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"refusing to load object {read_item.dest_index.fqn!r}: it is not a tensor or plain "
                f"Python value ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
                "ckptguard never unpickles arbitrary objects from a checkpoint; register classes you "
                "trust with torch.serialization.add_safe_globals([...]) or store their state_dict()."
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# -- writer -----------------------------------------------------------------------------


@dataclass
class WriteOutcome:
    """What this rank wrote, for the commit (filled by write_data)."""

    files: list[FileEntry] = field(default_factory=list)
    extra: Any = None  # what the pre-write hook returned (artifacts)


class GuardedWriter(StorageWriter):
    def __init__(
        self,
        staging_dir: str,
        rank: int,
        algorithm: str,
        io_threads: int = 4,
        before_write: Callable[[], Any] | None = None,
        error_root: str | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__()
        self.error_root = error_root
        self.on_bytes = on_bytes
        self.staging_dir = staging_dir
        self.rank = rank
        self.algorithm = algorithm
        self.io_threads = max(1, io_threads)
        self.before_write = before_write
        self.outcome = WriteOutcome()
        self.metadata: Metadata | None = None  # rank 0, after planning
        self.digests: dict[str, str] = {}
        self.plan: SavePlan | None = None  # this rank's part of the global plan
        self.stored: list[StoredItem] = []  # where this rank put each of its items
        self.error: BaseException | None = None  # a write failure, reported at the commit

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
        fault_point("before_write", self.rank)
        if self.before_write is not None:
            self.outcome.extra = self.before_write()
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
            rel = layout.data_file(self.rank, index)
            path = os.path.join(self.staging_dir, rel)
            offset = 0
            out: list[WriteResult] = []
            fd = retry_stale(lambda: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644),
                             "create", path)
            try:
                batch = _Batch(fd)
                placed: list[tuple[WriteItem, memoryview, Any, int]] = []
                for item, mv, owner in bucket:
                    batch.add(mv)
                    placed.append((item, mv, owner, offset))
                    offset += len(mv)
                    if index == 0 and not written[0] and offset * 2 * len(buckets) >= total:
                        batch.flush()
                        written[0] = 1
                        fault_point("mid_write", self.rank)
                    if self.on_bytes is not None:
                        self.on_bytes(len(mv))
                batch.flush()
                # The bytes are in the page cache now. The disk takes longer to absorb them than the
                # CPU takes to checksum them (from the same memory, which nothing changes during a
                # save): flush and checksum at the same time, and checksumming costs ~nothing.
                flushed: list[BaseException] = []
                flusher = threading.Thread(target=_fsync_noting_errors, args=(fd, flushed),
                                           name="ckptguard-fsync")
                flusher.start()
                try:
                    for item, mv, owner, at in placed:
                        digest = checksum(self.algorithm, mv)
                        out.append(WriteResult(index=item.index, size_in_bytes=len(mv),
                                               storage_data=_stored(item, owner, rel, at, len(mv), digest)))
                finally:
                    flusher.join()
                if flushed:
                    raise flushed[0]
            finally:
                os.close(fd)
            results.extend(out)
            files.append(FileEntry(rel, offset, self.rank))

        try:
            if len(buckets) <= 1:  # nothing to write on this rank (all deduplicated elsewhere), or one file
                for b in buckets:
                    write_bucket(0, b)
            else:
                with ThreadPoolExecutor(len(buckets), thread_name_prefix="ckptguard-write") as pool:
                    for f in [pool.submit(write_bucket, i, b) for i, b in enumerate(buckets)]:
                        f.result()
            if buckets:
                fsync_dir(os.path.join(self.staging_dir, layout.DATA_DIR))
        except OSError as e:
            raise explain_os_error(e, self.staging_dir, self.rank, needed_bytes=total, root=self.error_root) from None
        fault_point("after_write", self.rank)
        self.outcome.files = sorted(files, key=lambda f: f.path)
        fut: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        fut.set_result(results)
        return fut

    def write_planned(self, planner: SavePlanner) -> None:
        """Write this rank's part of the plan made by plan_collectively()."""
        assert self.plan is not None
        results = self.write_data(planner.finish_plan(self.plan), planner).wait()
        self.stored = [r.storage_data for r in results]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # Part of DCP's interface; the commit is ckptguard's own protocol (Checkpointer._commit).
        self.metadata = metadata


def _fsync_noting_errors(fd: int, errors: list[BaseException]) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        errors.append(e)


class _Batch:
    """Small items go to the file in one writev() per batch; large ones straight through."""

    MAX_IOV = 512
    MAX_BYTES = 8 << 20

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.views: list[memoryview] = []
        self.bytes = 0

    def add(self, mv: memoryview) -> None:
        if len(mv) >= self.MAX_BYTES:
            self.flush()
            write_all(self.fd, mv)
            return
        if not len(mv):
            return
        self.views.append(mv)
        self.bytes += len(mv)
        if len(self.views) >= self.MAX_IOV or self.bytes >= self.MAX_BYTES:
            self.flush()

    def flush(self) -> None:
        views = self.views
        while views:
            views = _after(views, os.writev(self.fd, views))
        self.views = []
        self.bytes = 0


def _after(views: list[memoryview], n: int) -> list[memoryview]:
    """What is left of ``views`` once a vectored read or write moved ``n`` bytes (it may stop anywhere)."""
    i = 0
    while i < len(views) and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    rest = views[i:]
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


def _stored(item: WriteItem, owner: Any, rel: str, offset: int, length: int, digest: str) -> StoredItem:
    offsets = tuple(int(x) for x in item.index.offset) if item.index.offset is not None else None
    if item.type == WriteItemType.BYTE_IO:
        return StoredItem(item.index.fqn, offsets, rel, offset, length, digest)
    assert isinstance(owner, torch.Tensor)
    return StoredItem(item.index.fqn, offsets, rel, offset, length, digest,
                      dtype=dtype_name(owner.dtype), shape=tuple(owner.shape))


_MIN_BYTES_PER_FILE = 32 << 20


def _balance(buffers: list[tuple[WriteItem, memoryview, Any]], n: int
             ) -> list[list[tuple[WriteItem, memoryview, Any]]]:
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


# -- reader -----------------------------------------------------------------------------


class GuardedReader(StorageReader):
    def __init__(self, checkpoint_dir: str, metadata: Metadata, algorithm: str, rank: int,
                 io_threads: int = 4, on_bytes: Callable[[int], None] | None = None) -> None:
        super().__init__()
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
            fd = _open_for_read(path)
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
                        if batch and (len(batch) >= _Batch.MAX_IOV or batch_bytes >= 64 << 20 or
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
                        fault_point("mid_load", self.rank)
                flush()
            finally:
                os.close(fd)

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


def _open_for_read(path: str) -> int:
    try:
        return retry_stale(lambda: os.open(path, os.O_RDONLY | os.O_CLOEXEC), "open", path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing: the checkpoint is incomplete", path=path) from None


def _pread_into(fd: int, view: memoryview, offset: int, path: str, expect: int) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            size = os.fstat(fd).st_size
            raise CorruptCheckpointError(
                f"{path} is truncated: {expect} bytes expected at offset {offset}, "
                f"the file ends at {size}. The checkpoint is corrupt.",
                path=path,
            )
        got += n


def _read_batch(fd: int, path: str, batch: list[tuple[_ReadJob, memoryview]], algorithm: str) -> None:
    views = [v for _, v in batch]
    start = batch[0][0].stored.offset
    total = sum(len(v) for v in views)
    done = 0
    while views:
        n = os.preadv(fd, views, start + done)
        if n == 0:
            size = os.fstat(fd).st_size
            raise CorruptCheckpointError(
                f"{path} is truncated: {total} bytes expected at offset {start}, the file ends at {size}. "
                "The checkpoint is corrupt.", path=path)
        done += n
        views = _after(views, n)
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

    def run(self, fd: int, path: str, algorithm: str) -> None:
        s = self.stored
        if s.shape is None:  # serialized object
            buf = bytearray(s.length)
            _pread_into(fd, memoryview(buf), s.offset, path, s.length)
            self.verify(memoryview(buf), path, algorithm)
            self.raw = bytes(buf)
            return
        direct = self._direct_target()
        if direct is not None:
            view, _ = tensor_bytes(direct) if direct.numel() else (memoryview(b""), direct)
            if len(view) != s.length:
                raise CheckpointError(f"{path}: {s.fqn} has {s.length} bytes stored, destination needs {len(view)}",
                                      path=path)
            _pread_into(fd, view, s.offset, path, s.length)
            self.verify(view, path, algorithm)
            return
        src = torch.empty(s.shape, dtype=dtype_from_name(s.dtype or ""))
        view, _ = tensor_bytes(src) if src.numel() else (memoryview(b""), src)
        if len(view) != s.length:
            raise CheckpointError(f"{path}: {s.fqn} stored length {s.length} does not match its shape {list(s.shape)}",
                                  path=path)
        _pread_into(fd, view, s.offset, path, s.length)
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


def read_locally(state_dict: dict[str, Any], reader: GuardedReader, planner: LoadPlanner,
                 is_coordinator: bool, stats: Any = None, before_read: Callable[[], None] | None = None) -> None:
    """dcp.load's planning and reading, without its two collectives.

    dcp.load gathers every rank's load plan on the coordinator and scatters them
    back, but its default global load plan changes nothing: for 10,000 tensors
    per rank that round trip of pickled plans cost more than the reads. Every
    rank here plans (DCP's planner: resharding included) and reads on its own;
    the caller agrees on the outcome. ``before_read`` runs once the plan is made.
    """
    with stats.phase("plan") if stats is not None else contextlib.nullcontext():
        planner.set_up_planner(state_dict, reader.metadata, is_coordinator)
        reader.set_up_storage_reader(reader.metadata, is_coordinator)
        plan = reader.prepare_local_plan(planner.create_local_plan())
        plan = planner.finish_plan(plan)
    if before_read is not None:
        before_read()
    with stats.phase("read") if stats is not None else contextlib.nullcontext():
        reader.read_data(plan, planner).wait()


def plan_collectively(state_dict: dict[str, Any], writer: GuardedWriter, planner: DomainSavePlanner,
                      comm: Comm, what: str, suffix: str = "") -> None:
    """DCP's save planning (deduplication, global metadata, plan caching), with our collectives.

    dcp.save also gathers every rank's write results and broadcasts the global
    metadata back to every rank after writing; the commit needs the results on
    rank 0 only, and no rank needs the metadata but rank 0. For 20,000 tensors
    that broadcast alone cost ~0.2 s per save. The planner calls are dcp.save's,
    in its order. Afterwards ``writer.plan`` is this rank's part, and on rank 0
    ``writer.metadata`` the checkpoint's metadata.
    """
    err: BaseException | None = None
    local_plan: SavePlan | None = None
    try:
        planner.set_up_planner(state_dict=state_dict, storage_meta=None, is_coordinator=comm.rank == 0)
        writer.set_up_storage_writer(comm.rank == 0)
        local_plan = writer.prepare_local_plan(planner.create_local_plan())
    except Exception as e:  # every failure must reach the agreement
        err = e
    gathered = comm.gather((local_failure(err), local_plan))
    parts: list[Any] | None = None
    if comm.rank == 0:
        assert gathered is not None
        failures = order_failures([g[0] for g in gathered])
        if not failures:
            try:
                global_plans, metadata = planner.create_global_plan([g[1] for g in gathered])
                global_plans = writer.prepare_global_plan(global_plans)
                writer.metadata = metadata
                parts = [([], p) for p in global_plans]
            except Exception as e:
                failures = order_failures([local_failure(e)])
        if failures:
            parts = [(failures, None)] * comm.world_size
    failures, mine = comm.scatter(parts)
    raise_failures(failures, what, suffix)
    writer.plan = mine
