"""DCP's load planner for ckptguard, and its contract with the reader.

:class:`SafeLoadPlanner` loads objects by ``torch.load(weights_only=True)`` (no code runs on load) and
plans a plain tensor stored whole straight from the stored item, without DCP's general planner.
:class:`ReaderPlanner` is what :class:`~ckptguard.dcp.reader.GuardedReader` needs of a planner beyond
DCP's ``LoadPlanner``; :func:`reader_planner` gives it for any planner (DCP's own, through
:class:`DcpPlanner`, when a user hands ``DCPReader`` to ``torch.distributed.checkpoint.load``).
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ckptguard.dcp import _torch_private
from ckptguard.dcp.codec import load_bounded
from ckptguard.dcp.records import StoredItem
from ckptguard.dcp.values import PLAIN_TENSOR_TYPES
from ckptguard.dcp.wholereads import WholeReads
from ckptguard.errors import CheckpointError, TemplateMismatchError, UnsafeObjectError


class DirectTarget(NamedTuple):
    """A whole plain tensor planned without DCP's general planner: its read item, its destination, and
    the stored item it reads where it was planned from the manifest's item table (else None)."""

    read: ReadItem
    target: torch.Tensor
    stored: StoredItem | None


class ReaderPlanner(Protocol):
    """What the reader needs of its planner, beyond DCP's ``LoadPlanner``."""

    def template(self) -> Mapping[str, Any]:
        """The state being loaded into, flattened as its read items name it (``{}``: not known)."""
        ...

    def direct_targets(self) -> Mapping[int, DirectTarget]:
        """The whole tensors planned directly, by ``id`` of their read item: covered by construction."""
        ...

    def stored_item(self, read_item: ReadItem) -> StoredItem | None:
        """The stored item a directly planned read item reads (None: look it up in DCP's metadata)."""
        ...

    def whole_reads(self) -> WholeReads:
        """Whole tensors planned from the manifest's item table and left out of the plan: the reader
        makes their read jobs itself (covered by construction)."""
        ...

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The destination of a tensor read item."""
        ...

    def place_object(self, read_item: ReadItem, obj: Any) -> None:
        """Put an object, already decoded and verified, where the state expects it."""
        ...

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """DCP's hook once a tensor is in place (called only where ``commits`` is true)."""
        ...

    @property
    def commits(self) -> bool:
        """Whether ``commit_tensor`` does anything (DCP's default planner's does not)."""
        ...


def _commits(planner: LoadPlanner) -> bool:
    return type(planner).commit_tensor is not DefaultLoadPlanner.commit_tensor


class DcpPlanner:
    """:class:`ReaderPlanner` for a planner of DCP's own: nothing planned directly, objects handed to its
    ``load_bytes`` again as bytes."""

    def __init__(self, planner: LoadPlanner) -> None:
        self._planner = planner

    def template(self) -> Mapping[str, Any]:
        return self._planner.state_dict if isinstance(self._planner, DefaultLoadPlanner) else {}

    def direct_targets(self) -> Mapping[int, DirectTarget]:
        return {}

    def stored_item(self, read_item: ReadItem) -> StoredItem | None:
        return None

    def whole_reads(self) -> WholeReads:
        return WholeReads()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self._planner.resolve_tensor(read_item)

    def place_object(self, read_item: ReadItem, obj: Any) -> None:
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        self._planner.load_bytes(read_item, buf)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self._planner.commit_tensor(read_item, tensor)

    @property
    def commits(self) -> bool:
        return _commits(self._planner)


def reader_planner(planner: LoadPlanner) -> ReaderPlanner:
    """``planner`` as the reader sees it: itself for a :class:`SafeLoadPlanner`, else :class:`DcpPlanner`."""
    return planner if isinstance(planner, SafeLoadPlanner) else DcpPlanner(planner)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with objects loaded by torch.load(weights_only=True): no code runs on load.

    Planning is also faster in the common case: a plain tensor stored whole, as
    one chunk of the same shape, gets its read item directly; everything else
    (DTensor shards, resharding, size mismatches, missing keys) goes through
    DCP's general planner.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._direct_targets: dict[int, DirectTarget] = {}
        self._whole = WholeReads()

    def template(self) -> Mapping[str, Any]:
        """The state being loaded into, flattened as its read items name it."""
        return self.state_dict

    def direct_targets(self) -> Mapping[int, DirectTarget]:
        """The whole tensors planned directly, by ``id`` of their read item."""
        return self._direct_targets

    @property
    def commits(self) -> bool:
        """Whether ``commit_tensor`` does anything (a subclass may hook it)."""
        return _commits(self)

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        """DCP's set-up; for a state of plain tensors (no DTensor, ShardedTensor or meta tensor), without
        its two walks that change nothing for one (meta initialisation, ShardedTensor flattening):
        each rebuilt a dict per value, a third of the planning of a state of many small tensors."""
        if not _plain_values(state_dict):
            try:
                super().set_up_planner(state_dict, metadata, is_coordinator)
            except (ValueError, RuntimeError) as e:  # e.g. a meta tensor DCP cannot initialise here
                raise TemplateMismatchError(
                    f"the state given to load cannot be loaded into: {e}. Give tensors with memory (a model "
                    "on the meta device: model.to_empty(device=...) first); nothing was read or changed"
                ) from None
            return
        self.original_state_dict = state_dict
        if self.flatten_state_dict:
            state_dict, self.mappings = _torch_private.flatten_state_dict(state_dict)
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def read_whole(self, reads: WholeReads) -> None:
        """Names of the state (flattened) read whole from their stored items (wholereads.find_whole_reads),
        without DCP's metadata: the metadata then given needs only the other names. Their read jobs are
        the reader's to make (:meth:`whole_reads`), unless ``commit_tensor`` is hooked: then each gets
        its read item in the plan, for the hook."""
        self._whole = reads

    def whole_reads(self) -> WholeReads:
        """The names given to :meth:`read_whole`, unless they are planned as read items (``commits``)."""
        return WholeReads() if self.commits else self._whole

    def stored_item(self, read_item: ReadItem) -> StoredItem | None:
        """The stored item a read item of :meth:`read_whole`'s names reads; None for the others."""
        known = self._direct_targets.get(id(read_item))
        return known.stored if known is not None and known.read is read_item else None

    def _read_whole_tensor(self, index: MetadataIndex, obj: torch.Tensor, stored: StoredItem | None) -> ReadItem:
        """The read item of a whole tensor into ``obj`` (what DCP would narrow to), kept for
        :meth:`resolve_tensor` and, where planned from the item table, with its stored item."""
        zero = index.offset
        assert zero is not None
        read = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=index,
            dest_offsets=zero,
            storage_index=index,
            storage_offsets=zero,
            lengths=obj.size(),
        )
        self._direct_targets[id(read)] = DirectTarget(read, obj, stored)
        return read

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        stored = self.metadata.state_dict_metadata
        direct: list[ReadItem] = []
        self._direct_targets = {}
        rest: dict[str, Any] = {}
        # The storage keys of whole tensors, reused as read items' indices (one MetadataIndex less per item).
        whole = {k.fqn: k for k in self.metadata.storage_data if k.offset is not None and not any(k.offset)}
        reads = self._whole
        planned = set(reads.fqns)
        if reads and self.commits:  # read items for the hook, each with its stored item
            direct.extend(
                self._read_whole_tensor(MetadataIndex(fqn, torch.Size(item.offsets or ())), obj, item)
                for fqn, obj, item in zip(reads.fqns, reads.targets, reads.items, strict=True)
            )
        for fqn, obj in self.state_dict.items():
            if fqn in planned:
                continue
            md = stored.get(fqn)
            # A plain tensor stored whole with its shape, in its dtype or one it widens to (nothing for
            # refuse_mismatches to find): its read item directly. Anything else is checked below.
            if (
                type(obj) is torch.Tensor
                and type(md) is TensorStorageMetadata
                and len(md.chunks) == 1
                and md.chunks[0].sizes == md.size == obj.size()
                and not any(md.chunks[0].offsets)
                and (md.properties.dtype == obj.dtype or widens(md.properties.dtype, obj.dtype))
            ):
                direct.append(
                    self._read_whole_tensor(whole.get(fqn) or MetadataIndex(fqn, md.chunks[0].offsets), obj, None)
                )
            else:
                rest[fqn] = obj
        refuse_mismatches(rest, stored, strict=not self.allow_partial_load)
        try:
            general = create_default_local_load_plan(rest, self.metadata, not self.allow_partial_load)
        except (ValueError, RuntimeError, KeyError, TypeError) as e:
            # Whatever else DCP finds the template and the checkpoint disagree on (nothing was read yet).
            raise TemplateMismatchError(
                f"the state given to load does not match the checkpoint: {e}. Build the state like the one "
                "saved (same model config, same optimizer); nothing was read or changed"
            ) from None
        return LoadPlan(direct + general.items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The destination of a read item; a whole plain tensor without DCP's lookup and narrowing."""
        known = self._direct_targets.get(id(read_item))
        if known is not None and known.read is read_item:
            return known.target
        resolved: torch.Tensor = super().resolve_tensor(read_item)
        return resolved

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.place_object(read_item, decode_object(read_item.dest_index.fqn, value))

    def place_object(self, read_item: ReadItem, obj: Any) -> None:
        """Put an object already decoded (and verified) where the caller's state expects it."""
        if self.flatten_state_dict:
            _torch_private.set_nested_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _plain_values(state_dict: Mapping[str, Any]) -> bool:
    """Whether every tensor in ``state_dict`` (nested in mappings, lists and tuples) is a plain tensor
    or parameter that is not on the meta device: nothing DCP's load set-up would rewrite."""
    pending: list[Any] = [state_dict]
    while pending:
        value = pending.pop()
        kind = type(value)
        if kind in PLAIN_TENSOR_TYPES:  # most values: tested first, without the ABCs
            if value.is_meta:
                return False
        elif kind is dict or isinstance(value, Mapping):
            pending.extend(value.values())
        elif isinstance(value, list | tuple):
            pending.extend(value)
        elif isinstance(value, torch.Tensor):  # a subclass (DTensor, ShardedTensor...)
            return False
    return True


def refuse_mismatches(state_dict: dict[str, Any], stored: dict[str, Any], *, strict: bool) -> None:
    """Raise TemplateMismatchError naming every key of the template that the checkpoint cannot fill (a
    tensor of another shape or dtype, a tensor where an object is stored or the other way round, a key
    it lacks unless ``strict=False``),
    rather than DCP's error about the first one, and before any byte is read."""
    problems = []
    for fqn, obj in state_dict.items():
        md = stored.get(fqn)
        if md is None:
            if strict:
                problems.append(f"{fqn}: not in the checkpoint (template: {_describe(obj)})")
        elif isinstance(obj, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                problems.append(f"{fqn}: checkpoint: a non-tensor value, template: {_describe(obj)}")
            elif tuple(md.size) != tuple(obj.size()) or not widens(md.properties.dtype, obj.dtype):
                # Only a cast that keeps every value exactly is made: a narrowing one may round, overflow
                # or wrap silently.
                problems.append(
                    f"{fqn}: checkpoint: shape {list(md.size)} {md.properties.dtype}, "
                    f"template: shape {list(obj.size())} {obj.dtype}"
                )
        elif isinstance(md, TensorStorageMetadata):
            problems.append(
                f"{fqn}: checkpoint: a tensor of shape {list(md.size)} {md.properties.dtype}, "
                f"template: a non-tensor value ({_describe(obj)})"
            )
    if problems:
        shown = "; ".join(problems[:50]) + (f"; ... and {len(problems) - 50} more" if len(problems) > 50 else "")
        raise TemplateMismatchError(
            f"the state given to load does not match the checkpoint ({len(problems)} key(s)): {shown}. Build the "
            "state like the one saved (same model config, same optimizer), or pass strict=False to leave keys "
            "the checkpoint lacks as they are; nothing was read or changed"
        )


_QUANTIZED = frozenset(
    getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, n)
)


def widens(stored: torch.dtype, template: torch.dtype) -> bool:
    """Whether every value of ``stored`` is exactly a value of ``template`` (the same dtype, or a lossless
    widening such as bfloat16 -> float32, int8 -> int32, int16 -> float32): the only casts a load makes.
    A stored dtype of 16 bits or fewer is decided by casting every one of its values (the float8 formats
    differ in range, precision, infinities and zeros in ways no finfo comparison captures); a wider one
    by its finfo/iinfo."""
    if stored == template:
        return True
    if stored in _QUANTIZED or template in _QUANTIZED:  # raw integers of a scale: never cast
        return False
    if stored.itemsize <= 2 and not stored.is_complex:
        return _casts_every_value_exactly(stored, template)
    try:
        if template.is_complex or stored.is_complex:
            return stored.is_complex and template.is_complex and stored.itemsize < template.itemsize
        if stored.is_floating_point:
            if not template.is_floating_point:
                return False
            s, t = torch.finfo(stored), torch.finfo(template)
            return t.eps <= s.eps and t.max >= s.max and t.smallest_normal * t.eps <= s.smallest_normal * s.eps
        si = torch.iinfo(stored)
        if template.is_floating_point:
            magnitude_bits = si.bits - (1 if si.min < 0 else 0)
            return -math.log2(torch.finfo(template).eps) + 1 >= magnitude_bits
        ti = torch.iinfo(template)
        return ti.min <= si.min and ti.max >= si.max
    except (TypeError, NotImplementedError, RuntimeError):  # a dtype without finfo/iinfo (quantized, bits,
        return False  # float4): only the same dtype


@functools.cache
def _casts_every_value_exactly(stored: torch.dtype, template: torch.dtype) -> bool:
    """Every bit pattern of ``stored`` (at most 65,536), cast to ``template`` as a load casts it, keeps
    its value, its sign (a zero's too), and stays NaN where it was NaN."""
    if template.is_complex:  # (a real value is one, but no load casts to complex: as for wider dtypes)
        return False
    try:
        every = torch.arange(1 << (8 * stored.itemsize), dtype=torch.int32)
        raw = every.to(torch.uint8) if stored.itemsize == 1 else every.to(torch.int16)  # (wraps: every pattern)
        values = raw.view(stored) if stored != torch.bool else torch.tensor([False, True])
        cast = values.to(template)
        before, after = values.to(torch.float64), cast.to(torch.float64)
    except (RuntimeError, TypeError, NotImplementedError):  # a dtype torch cannot cast (bits, quantized, ...)
        return False
    nan = before.isnan()
    same = (before == after) & (torch.signbit(before) == torch.signbit(after))
    return bool(torch.where(nan, after.isnan(), same).all())


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"shape {list(obj.size())} {obj.dtype}"
    return type(obj).__name__


def decode_object(fqn: str, value: io.BytesIO) -> Any:
    """A stored object, by torch.load(weights_only=True): nothing from the checkpoint runs."""
    try:
        obj = load_bounded(value, f"stored object {fqn!r}")  # decode_value recurses into it
    except CheckpointError:
        raise
    except Exception as e:
        raise UnsafeObjectError(
            f"refusing to load object {fqn!r}: it is not a tensor or plain "
            f"Python value ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            "ckptguard never unpickles arbitrary objects from a checkpoint; register classes you "
            "trust with torch.serialization.add_safe_globals([...]) or store their state_dict()."
        ) from None
    return obj
