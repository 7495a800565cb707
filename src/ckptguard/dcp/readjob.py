"""One item of a load, and where its bytes wait between verification and placement.

A :class:`ReadJob` is one stored item and the destinations it fills: read in place
(its old bytes saved in the :class:`Arena` to be put back), staged (scratch bytes in
the arena), or verified only (checked in chunks, its source pinned for a second read:
a file kept open, or the :class:`Spill`). The reader (dcp/reader.py) decides which
and drives the phases; this module holds what one item does.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter, methodcaller
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ckptguard.checksum import Hasher, checksum
from ckptguard.dcp._torch_private import has_internal_overlap
from ckptguard.dcp.codec import _DTYPE_NAMES, _NUMPY_DTYPES, dtype_from_name, narrow, tensor_bytes
from ckptguard.dcp.records import StoredItem
from ckptguard.errors import CheckpointError, CorruptCheckpointError, TemplateMismatchError, TornLoadError
from ckptguard.storage import ReadHandle


def no_in_place_for_aliases(jobs: list[ReadJob]) -> None:
    """Items whose destinations share memory with another item's (tied weights) are staged, not read
    in place: their old bytes could not be told apart when put back. A destination read in place
    spans its own bytes; any other, conservatively, its whole storage."""
    n = len(jobs)
    if n > 1 and None not in map(_DIRECT, jobs):  # every job read in place (most loads): C-level passes
        starts = np.fromiter(map(_PTR, map(_FIRST, map(_TARGETS, jobs))), np.uint64, n)  # (unsigned)
        if _apart(starts, starts + np.fromiter(map(len, map(_DIRECT, jobs)), np.uint64, n)):
            return
    spans: list[tuple[int, int, ReadJob]] = []
    for job in jobs:
        if job.direct is not None:
            t = job.targets[0]
            spans.append((t.data_ptr(), t.data_ptr() + len(job.direct), job))
            continue
        for t in job.targets:
            if t.is_cpu and t.numel():
                storage = t.untyped_storage()
                spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes(), job))
    if len(spans) > 1 and _apart(  # no two spans meet (almost every load): found on columns, no loop below
        np.fromiter((s[0] for s in spans), np.uint64, len(spans)), np.fromiter((s[1] for s in spans), np.uint64)
    ):
        return
    spans.sort(key=lambda s: s[0])
    end = -1
    last: ReadJob | None = None
    for lo, hi, job in spans:
        if lo < end and last is not None and last is not job:
            _refuse_tied_conflict(last, job)
            job.direct = None
            last.direct = None
        if hi > end:
            end, last = hi, job


_TARGETS, _DIRECT, _FIRST, _PTR = attrgetter("targets"), attrgetter("direct"), itemgetter(0), methodcaller("data_ptr")


def _apart(starts: np.ndarray, ends: np.ndarray) -> bool:
    order = np.argsort(starts, kind="stable")
    return not bool((starts[order][1:] < np.maximum.accumulate(ends[order])[:-1]).any())


def _refuse_tied_conflict(a: ReadJob, b: ReadJob) -> None:
    """Two items whose destinations are one tensor of the template (tied weights) and whose stored
    values differ (saved untied): the load cannot give both their values. Refused before any byte
    is read (a destination partly shared with another's is not compared: overlapping views)."""
    if len(a.targets) != 1 or len(b.targets) != 1 or a.stored.shape is None or b.stored.shape is None:
        return
    ta, tb = a.targets[0], b.targets[0]
    if (
        ta.data_ptr() == tb.data_ptr()
        and ta.shape == tb.shape
        and ta.stride() == tb.stride()
        and ta.dtype == tb.dtype
        and a.stored.dtype == b.stored.dtype
        and a.stored.length == b.stored.length
        and a.stored.checksum != b.stored.checksum
    ):
        raise TemplateMismatchError(
            f"{a.stored.fqn} and {b.stored.fqn} are one tensor in the template (tied weights), but the "
            "checkpoint holds different values for them (they were saved untied): tie or untie them as they "
            "were when saved; nothing was read or changed"
        )


#: Up to this many elements, a tensor whose strides prove nothing either way has its element offsets
#: counted (8 bytes each); a larger one is refused (a template is a clone away from a plain tensor).
_COUNTED_ELEMENTS = 1 << 22


def shares_elements(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may be one memory location: then a copy into it keeps one value of
    several (an ``expand()``ed tensor, ``unfold()``, ``as_strided()`` with overlapping strides). Sure
    where torch can tell; else dimensions sorted by stride each stepping over all the smaller ones prove
    there is none; else the element offsets are counted (small tensors), or it is taken to share."""
    verdict = has_internal_overlap(t)
    if verdict is not None:
        return verdict
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    span = 0  # the largest offset the smaller-stride dimensions reach
    for st, n in dims:
        if st <= span:
            break
        span += st * (n - 1)
    else:
        return False
    if t.numel() > _COUNTED_ELEMENTS:
        return True
    offsets = np.zeros(1, dtype=np.int64)
    for st, n in dims:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64)[None, :] * st).ravel()
    return len(np.unique(offsets)) < len(offsets)


def follows(prev: ReadJob, job: ReadJob) -> bool:
    return prev.stored.offset + prev.stored.length == job.stored.offset


def follows_at(prev: ReadJob, job: ReadJob, spilled: bool) -> bool:
    if spilled:
        return prev.spill_at >= 0 and prev.spill_at + prev.stored.length == job.spill_at
    return follows(prev, job)


def _private_memory(size: int) -> mmap.mmap:
    """Private anonymous memory in transparent huge pages where the kernel grants them: a fresh page
    is faulted in per 2 MiB instead of per 4 KiB (a copy into fresh memory 0.9 -> 2.5 GB/s on the
    CPU machine of the Performance page). ``mmap.mmap(-1, n)`` alone is shared memory, which the
    kernel backs with huge pages only when shmem_enabled allows, and faults slower still."""
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP on this kernel or platform
        memory.madvise(mmap.MADV_HUGEPAGE)
    return memory


class Arena:
    """The host memory of one load's staged items and saved old bytes: one anonymous mapping instead
    of an allocation per item (a small tensor's allocation cost more than its copy)."""

    def __init__(self, size: int) -> None:
        self._map = _private_memory(size) if size else None
        self.view = memoryview(self._map) if self._map is not None else memoryview(bytearray())

    def close(self) -> None:
        self.view.release()
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a scratch tensor still refers to it: it goes with the last
                self._map.close()
            self._map = None


class Spill:
    """Verified bytes kept for the second read in an unlinked local temporary file (TMPDIR): what a
    load re-reads instead of storage that retention may have changed since (objects; files beyond
    the descriptor limit). It is the load's own: nothing else can delete or change it."""

    path = "the load's spill file"

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="ckptguard-load-")  # noqa: SIM115  # closed by close()
        self.fd = self._file.fileno()
        self._end = 0
        self._lock = threading.Lock()

    def append(self, data: memoryview) -> int:
        """Write ``data`` at the end; where it starts."""
        with self._lock:
            at = self._end
            self._end += len(data)
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], at + done)
        return at

    def size(self) -> int:
        return self._end

    def read_into(self, views: Sequence[memoryview], offset: int) -> None:
        pending = [v for v in views if len(v)]
        done = 0
        while pending:
            n = os.preadv(self.fd, pending[:1024], offset + done)
            if n <= 0:
                raise CorruptCheckpointError(f"{self.path} ended early at {offset + done}")
            done += n
            while pending and n >= len(pending[0]):
                n -= len(pending[0])
                pending.pop(0)
            if n:
                pending[0] = pending[0][n:]

    def close(self) -> None:
        self._file.close()


IN_PLACE, STAGED, VERIFIED = "in place", "staged", "verified only"


@dataclass
class ReadJob:
    """One stored item and the destinations it fills: ``targets[i]`` the piece ``reqs[i]`` of it; no
    read items for a whole tensor planned from the item table (wholereads.py), its one target of the
    item's shape and dtype."""

    stored: StoredItem
    reqs: list[ReadItem]
    targets: list[torch.Tensor]
    mode: str = STAGED
    direct: memoryview | None = field(default=None, repr=False)  # the destination's bytes, if read straight there
    slot: int = -1  # offset in the arena: scratch bytes (staged) or the old bytes (in place)
    spill_at: int = -1  # offset in the spill file of a verified-only item
    raw: bytearray | None = None  # an object's bytes, until decoded
    obj: Any = None  # an object, decoded
    scratch: torch.Tensor | None = field(default=None, repr=False)
    scratch_view: memoryview | None = field(default=None, repr=False)
    old: memoryview | None = field(default=None, repr=False)  # the destination's bytes before this load
    placed: bool = False  # read straight into its destination in the apply phase

    def __post_init__(self) -> None:
        self.direct = self._direct_view()

    @property
    def is_object(self) -> bool:
        """Whether this item is an object (decoded by torch.load), not tensor bytes."""
        return bool(self.reqs) and self.reqs[0].type == LoadItemType.BYTE_IO

    def check_fits(self) -> None:
        """Every destination can take its piece (checked before anything is copied)."""
        s = self.stored
        if s.shape is None:
            raise CheckpointError(f"{s.fqn}: a tensor is expected where the checkpoint stores an object")
        if not self.reqs:  # a whole tensor: the one target has the stored shape (wholereads.py)
            if self.direct is None:
                self._refuse_shared_elements(self.targets[0])
            return
        for req, target in zip(self.reqs, self.targets, strict=True):
            if target.shape != tuple(req.lengths):  # (torch.Size is a tuple)
                raise CheckpointError(
                    f"{s.fqn}: stored piece {list(req.lengths)} does not fit destination {list(target.shape)}"
                )
        if self.direct is not None:
            return  # the whole stored chunk into one contiguous destination of its shape
        for req, target in zip(self.reqs, self.targets, strict=True):
            # The piece read lies inside the chunk stored (the metadata's chunk list and the stored
            # item agree), so that nothing fails once the copies into place have begun.
            if len(req.lengths) != len(s.shape) or any(
                o + n > d for o, n, d in zip(req.storage_offsets, req.lengths, s.shape, strict=True)
            ):
                raise CorruptCheckpointError(
                    f"{s.fqn}: the checkpoint's metadata asks for a piece at {list(req.storage_offsets)[:8]} "
                    f"of {list(req.lengths)[:8]} of a stored chunk of shape {list(s.shape)[:8]}: the manifest "
                    "is corrupt"
                )
            self._refuse_shared_elements(target)

    def _refuse_shared_elements(self, target: torch.Tensor) -> None:
        if shares_elements(target):
            s = self.stored
            raise TemplateMismatchError(
                f"{s.fqn}: the template's tensor has elements that share memory (an expand()ed tensor, "
                f"stride 0, or strides {list(target.stride())[:8]} that make elements of shape "
                f"{list(target.shape)[:8]} meet, as unfold() and as_strided() can): it cannot hold the "
                "checkpoint's values. Pass a tensor with its own memory (.clone()); nothing was read "
                "or changed"
            )

    def destination(self, arena: Arena) -> memoryview:
        """Where phase 1 reads this item: its destination (in place), an arena slot (staged tensor),
        or fresh bytes (an object)."""
        s = self.stored
        if self.mode == IN_PLACE:
            assert self.direct is not None
            return self.direct
        if s.shape is None:
            buf = bytearray(s.length)
            self.raw = buf
            return memoryview(buf)
        view = arena.view[self.slot : self.slot + s.length] if self.slot >= 0 else None
        return self._scratch(view)

    def allocate_scratch(self, pool: torch.Tensor | None = None) -> memoryview:
        """Scratch memory for the second read of a verified-only item that cannot go straight into place:
        the start of ``pool`` (reused bytes, at least ``scratch_bytes`` long) if given."""
        return self._scratch(None, pool)

    @property
    def scratch_bytes(self) -> int:
        """The bytes of the stored shape in its dtype (what ``_scratch`` takes from a pool)."""
        s = self.stored
        assert s.shape is not None
        return math.prod(s.shape) * dtype_from_name(s.dtype or "").itemsize

    @property
    def to_devices(self) -> bool:
        """Every destination is a CUDA tensor (copied into from pinned host memory at the DMA's speed)."""
        return all(t.device.type == "cuda" for t in self.targets)

    def _scratch(self, view: memoryview | None, pool: torch.Tensor | None = None) -> memoryview:
        s = self.stored
        assert s.shape is not None
        dtype = dtype_from_name(s.dtype or "")
        numel = 1
        for d in s.shape:
            numel *= d
        if pool is not None and numel:
            self.scratch = pool[: numel * dtype.itemsize].view(dtype).view(s.shape)
        elif view is None or not numel:
            self.scratch = torch.empty(s.shape, dtype=dtype)
        else:
            self.scratch = torch.frombuffer(view, dtype=torch.uint8).view(dtype).view(s.shape)
        got, _ = tensor_bytes(self.scratch) if numel else (memoryview(b""), self.scratch)
        if len(got) != s.length:
            raise CorruptCheckpointError(f"{s.fqn}: stored length {s.length} does not match its shape {list(s.shape)}")
        self.scratch_view = got
        return got

    def save_old(self, arena: Arena) -> None:
        assert self.direct is not None and self.slot >= 0
        old = arena.view[self.slot : self.slot + len(self.direct)]
        old[:] = self.direct
        self.old = old

    def restore_old(self) -> None:
        if self.old is not None and self.direct is not None:
            self.direct[:] = self.old
        self.old = None

    def copy_into_place(self) -> None:
        assert self.scratch is not None
        direct = self.direct
        if direct is not None and self.scratch_view is not None and len(self.scratch_view) == len(direct):
            direct[:] = self.scratch_view  # a plain memcpy: far cheaper than a torch op per small tensor
            return
        if not self.reqs:  # a whole tensor into a destination of its shape that is not contiguous
            self.targets[0].copy_(self.scratch)
            return
        for req, target in zip(self.reqs, self.targets, strict=True):
            target.copy_(narrow(self.scratch, req.storage_offsets, req.lengths))

    def release(self) -> None:
        self.scratch = None
        if self.scratch_view is not None:
            self.scratch_view.release()
        self.scratch_view = None
        self.obj = None
        self.old = None

    def _direct_view(self) -> memoryview | None:
        """The destination's own bytes, if the stored bytes can go straight into them (cheap checks
        first: this runs for every item of every load)."""
        stored, targets = self.stored, self.targets
        shape = stored.shape
        if len(targets) != 1 or shape is None:
            return None
        t = targets[0]
        if self.reqs:  # (a whole tensor without read items is the piece at zero of the stored shape)
            req = self.reqs[0]
            if tuple(req.lengths) != shape or any(req.storage_offsets):
                return None
        dtype = t.dtype
        # (torch.Size is a tuple: compared with the stored shape as it is)
        if (
            t.shape != shape
            or not t.is_contiguous()
            or not t.is_cpu
            or not t.numel()
            or _DTYPE_NAMES.get(dtype) != stored.dtype
            or t.is_conj()
            or t.is_neg()
        ):
            return None
        if dtype in _NUMPY_DTYPES:
            view = memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer
        else:
            view, _ = tensor_bytes(t)
        return view if len(view) == stored.length else None

    def verify_streaming(
        self, fd: ReadHandle, path: str, algorithm: str, chunk: memoryview, spill: Spill | None
    ) -> None:
        """Check an item's checksum reading it in chunks (kept in ``spill`` if given)."""
        s = self.stored
        hasher = Hasher(algorithm)
        pos = 0
        while pos < s.length:
            n = min(len(chunk), s.length - pos)
            fd.read_into([chunk[:n]], s.offset + pos)
            hasher.update(chunk[:n])
            if spill is not None:
                at = spill.append(chunk[:n])
                if not pos:
                    self.spill_at = at
            pos += n
        self._compare(hasher.hexdigest(), path)

    def read_verified(
        self, fd: ReadHandle, offset: int, view: memoryview, piece: int, path: str, algorithm: str
    ) -> None:
        """Read this item into ``view`` from ``offset`` of ``fd`` and check it, ``piece`` bytes at a time
        (each hashed while still in the CPU's cache)."""
        if len(view) <= piece:
            fd.read_into([view], offset)
            self.verify(view, path, algorithm)
            return
        hasher = Hasher(algorithm)
        for pos in range(0, len(view), piece):
            part = view[pos : pos + piece]
            fd.read_into([part], offset + pos)
            hasher.update(part)
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


def detached(t: torch.Tensor) -> torch.Tensor:
    """A destination written without autograd (a new view only where autograd would see the write)."""
    return t.detach() if t.requires_grad else t


class Stopped(Exception):
    """Another file of the same load failed: this one stops reading."""


@contextlib.contextmanager
def torn_if_it_fails(rank: int, path: str) -> Iterator[None]:
    """The second read of bytes verified moments before: whatever fails there (a checksum, a file
    truncated, an I/O error) fails once destinations may already hold part of the checkpoint, so it
    is a TornLoadError, never a corrupt checkpoint to fall back from."""
    try:
        yield
    except (CheckpointError, OSError) as e:
        raise TornLoadError(
            f"{e} The same bytes were verified moments before, so the file was modified in place during "
            "this load (ckptguard never does that). Part of this checkpoint may already be in the state "
            "being loaded: load again.",
            rank=rank,
            path=path,
        ) from None


_ALIGN = 64  # scratch slots in the arena start at this alignment (any dtype, vector loads)


@dataclass(frozen=True)
class Modes:
    """What :func:`assign_modes` decided, in bytes: the arena's size, held between the passes, read twice."""

    arena_bytes: int
    staged_bytes: int
    verified_only_bytes: int


def assign_modes(jobs: Sequence[ReadJob], budget: int, backup: bool) -> Modes:
    """Give each job its mode within ``budget`` bytes held between the passes, in order: objects are always
    staged (decoded in the first pass); a whole destination of fresh memory (``backup`` False) is read in
    place with nothing to hold; within the budget a job is read in place (its old bytes held) or staged
    (its slot in the arena set); beyond it, verified only."""
    arena = staged = verified = 0
    for job in jobs:
        length = job.stored.length
        if job.stored.shape is None:
            budget -= length
            staged += length
        elif job.direct is not None and not backup:
            job.mode = IN_PLACE
        elif length <= budget:
            job.mode = IN_PLACE if job.direct is not None else STAGED
            budget -= length
            staged += length
            job.slot = arena
            arena += -(-length // _ALIGN) * _ALIGN
        else:
            job.mode = VERIFIED
            verified += length
    return Modes(arena, staged, verified)
