"""How tensors and DCP's metadata are represented in a ckptguard checkpoint.

Tensor bytes are written and read as raw memory (no serialized copy); DCP's
metadata travels as JSON inside the manifest, never as DCP's pickled
``.metadata`` file, so loading runs no code from the checkpoint.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Collection, Mapping, Sequence
from collections.abc import Set as AbstractSet
from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptguard.dcp.records import ITEMSIZES, StoredItem, addressable, whole_chunk
from ckptguard.dcp.records import MAX_VALUE_DEPTH as MAX_VALUE_DEPTH  # where it was defined before
from ckptguard.errors import CheckpointError, CorruptCheckpointError

_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}

_NUMPY_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
}


_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """ "float32" of torch.float32 (a lookup: it runs for every item of every save and load)."""
    name = _DTYPE_NAMES.get(dtype)
    return name if name is not None else str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CorruptCheckpointError(f"unknown dtype {name!r} in checkpoint metadata") from None


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
        return memoryview(t.numpy()).cast("B"), t  # type: ignore[arg-type]  # ndarray is a buffer
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()), t  # type: ignore[arg-type]


# -- DCP metadata <-> JSON -------------------------------------------------------------


def metadata_to_json(md: Metadata, known: Mapping[str, tuple[int, int, Any]] | None = None) -> dict[str, Any]:
    """DCP's metadata as the manifest stores it. ``known``: per tensor, (chunk count, dimensions,
    flat chunk list or its MessagePack as ``msgspec.Raw``) already built from the stored items'
    columns (ItemTable.flat_chunks), used where the count and dimensions are DCP's; any other
    tensor's chunks are read from DCP's own objects. A Raw list is for the manifest's MessagePack
    encoder only (a JSON encoder would copy its bytes as they are)."""
    known = known or {}
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
                "chunks": _chunks_of(entry, known.get(fqn)),
            }
        else:
            raise CheckpointError(f"{fqn}: unsupported DCP storage metadata {type(entry).__name__}")
    planner_data = md.planner_data if isinstance(md.planner_data, dict) else {}
    return {
        "version": md.version,
        "state_dict": sd,
        "planner_data": {k: list(v) for k, v in planner_data.items()},
    }


def _chunks_of(entry: TensorStorageMetadata, known: tuple[int, int, Any] | None) -> Any:
    if known is not None and known[0] == len(entry.chunks) and known[1] == len(entry.size):
        return known[2]
    return _flat_chunks(entry.chunks)


#: A chunk's (offsets, sizes): fetched in C, so that flattening a million chunks runs no bytecode per chunk.
_OFFSETS_SIZES = attrgetter("offsets", "sizes")


def _flat_chunks(chunks: Sequence[ChunkStorageMetadata]) -> list[int]:
    """[offsets..., sizes..., offsets..., sizes...] of every chunk, built by C iterators (the leader
    does this for every chunk of every save: a million at 16,384 ranks x 64 tensors)."""
    return list(chain.from_iterable(chain.from_iterable(map(_OFFSETS_SIZES, chunks))))


def metadata_from_json(
    obj: dict[str, Any],
    items: Sequence[StoredItem],
    path: str | None = None,
    *,
    domain_count: int = 1,
    wanted: Collection[str] | None = None,
) -> Metadata:
    """DCP's Metadata from the manifest's JSON; every size and index bounded by what the items hold.
    ``obj`` as the manifest's schema decoded it (protocol.schema.DcpBody: every number an int).

    ``domain_count`` > 1: the manifest is one storage domain's of several and its items hold only that
    domain's share (a per-rank value or a shard may live in another domain's manifest), so a tensor's
    size is bounded by its declared chunks, each of which must lie inside it, instead.

    ``wanted``: only these names (a load's template keys), with their items: a rank that loads its own
    part of a checkpoint of many ranks builds nothing for the rest (every name's entry is still a
    JSON value of the manifest, whose checksum covers it)."""
    props: dict[tuple[str, bool], TensorProperties] = {}
    if wanted is not None and not isinstance(wanted, AbstractSet):
        wanted = set(wanted)  # looked up once per stored name: a list would make this quadratic
    items = _items_named(items, wanted)
    stored: dict[str, int] = {}
    for i in items:
        stored[i.fqn] = stored.get(i.fqn, 0) + i.length
    try:
        sd: dict[str, Any] = {}
        entries_json = obj["state_dict"]
        if not isinstance(entries_json, dict):
            raise TypeError(f"state_dict is a {type(entries_json).__name__}, not an object")
        chosen = (
            entries_json.items()
            if wanted is None
            else ((fqn, entries_json[fqn]) for fqn in wanted if fqn in entries_json)
        )
        for fqn, e in chosen:
            if e["type"] == "bytes":
                sd[fqn] = BytesStorageMetadata()
            elif e["type"] == "tensor":
                key = (e["dtype"], bool(e["requires_grad"]))
                if key not in props:
                    props[key] = TensorProperties(dtype=dtype_from_name(key[0]), requires_grad=key[1])
                size = e["size"]
                ndim = len(size)
                flat = e["chunks"]
                step = 2 * ndim
                if whole_chunk(size, flat) and ndim <= 64 and min(size) >= 0 and (0 not in size or addressable(size)):
                    # One chunk, the whole tensor (most tensors of most checkpoints): one Size for both,
                    # and _check_size's checks that remain for it (the manifest's schema typed the numbers).
                    itemsize = ITEMSIZES.get(key[0])
                    if domain_count == 1 and itemsize is not None and math.prod(size) * itemsize > stored.get(fqn, 0):
                        raise ValueError(
                            f"{fqn[:100]}: size {size[:8]} of {key[0]} is more than the "
                            f"{stored.get(fqn, 0)} bytes stored for it"
                        )
                    whole = torch.Size(size)
                    sd[fqn] = TensorStorageMetadata(
                        properties=props[key],
                        size=whole,
                        chunks=[ChunkStorageMetadata(offsets=torch.Size(flat[:ndim]), sizes=whole)],
                    )
                    continue
                if ndim == 0:
                    chunks = [ChunkStorageMetadata(offsets=torch.Size(), sizes=torch.Size())] * (len(flat) or 1)
                else:
                    if len(flat) % step:
                        raise ValueError(f"{fqn}: chunk list length {len(flat)} is not a multiple of {step}")
                    chunks = [
                        ChunkStorageMetadata(
                            offsets=torch.Size(flat[i : i + ndim]), sizes=torch.Size(flat[i + ndim : i + step])
                        )
                        for i in range(0, len(flat), step)
                    ]
                _check_size(fqn, e["size"], flat, key[0], stored if domain_count == 1 else None)
                sd[fqn] = TensorStorageMetadata(properties=props[key], size=torch.Size(e["size"]), chunks=chunks)
            else:
                raise ValueError(f"unknown entry type {e['type']!r}")
        planner_data = {}
        paths_json = obj["planner_data"]
        if not isinstance(paths_json, dict):
            raise TypeError(f"planner_data is a {type(paths_json).__name__}, not an object")
        entries = len(paths_json)
        chosen_paths = paths_json.items() if wanted is None else ((k, paths_json[k]) for k in wanted if k in paths_json)
        for k, obj_path in chosen_paths:
            # Lists are rebuilt by index (unflatten) and nested by path: an index is below the number of
            # entries (each list element that holds something has one), a path no longer than MAX_VALUE_DEPTH.
            if (
                not isinstance(obj_path, list)
                or not 0 < len(obj_path) <= MAX_VALUE_DEPTH
                or not all(type(p) is str or (type(p) is int and 0 <= p < entries) for p in obj_path)
            ):
                raise ValueError(f"bad planner path for {str(k)[:100]!r}: {str(obj_path)[:100]}")
            planner_data[str(k)] = tuple(obj_path)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(
            f"invalid DCP metadata in manifest {path or ''}: {type(e).__name__}: {e}", path=path
        ) from None
    # Each item's shape was checked against its length when the manifest was parsed.
    storage = {item_index(i): i for i in items}
    return Metadata(state_dict_metadata=sd, planner_data=planner_data, storage_data=storage, version=obj.get("version"))


def _items_named(items: Sequence[StoredItem], wanted: Collection[str] | None) -> Sequence[StoredItem]:
    """The items of the names in ``wanted`` (all without it); an item table (protocol.itemtable, one
    name index per row) is filtered on its name column."""
    if wanted is None:
        return items
    table_names: list[str] | None = getattr(items, "names", None)  # an ItemTable (protocol's): its rows
    # of those names are taken on its columns, and only they become StoredItems
    if table_names is not None:
        names = [i for i, nm in enumerate(table_names) if nm in wanted]
        if len(names) == len(table_names):
            return items
        table: Any = items
        return list(table.take(np.flatnonzero(np.isin(table.name, names))))
    return [i for i in items if i.fqn in wanted]


def _check_size(fqn: str, size: Any, flat: Any, dtype: str, stored: Mapping[str, int] | None) -> None:
    """A tensor's size: what a reader allocates before reading. Its bytes cannot exceed what the
    checkpoint stores for it (each item's length was checked against its file when parsed); where the
    manifest holds only a share of the checkpoint (``stored`` None), its elements cannot exceed those
    of its chunks, each inside the tensor."""
    if not (type(size) is list and len(size) <= 64 and all(type(d) is int and d >= 0 for d in size)):
        raise ValueError(f"{fqn[:100]}: size {str(size)[:100]} is not a list of integers >= 0")
    if not (type(flat) is list and all(type(d) is int and d >= 0 for d in flat)):
        raise ValueError(f"{fqn[:100]}: chunk offsets and sizes must be integers >= 0")
    if not addressable(size):  # (an empty tensor's other dimensions too: torch computes its strides)
        raise ValueError(f"{fqn[:100]}: size {size[:8]} has more elements than a tensor can address")
    itemsize = ITEMSIZES.get(dtype)
    if itemsize is None:
        return
    if stored is not None:
        if math.prod(size) * itemsize > stored.get(fqn, 0):
            raise ValueError(
                f"{fqn[:100]}: size {size[:8]} of {dtype} is more than the {stored.get(fqn, 0)} bytes stored for it"
            )
        return
    ndim = len(size)
    covered = 1 if ndim == 0 else 0
    for i in range(0, len(flat), 2 * ndim or 1):
        if ndim == 0:
            break
        offsets, sizes = flat[i : i + ndim], flat[i + ndim : i + 2 * ndim]
        if any(o + n > d for o, n, d in zip(offsets, sizes, size, strict=True)):
            raise ValueError(f"{fqn[:100]}: a chunk at {offsets[:8]} of {sizes[:8]} lies outside its size {size[:8]}")
        covered += math.prod(sizes)
    if math.prod(size) > covered:
        raise ValueError(f"{fqn[:100]}: size {size[:8]} is more than its chunks cover ({covered} elements)")


def check_depth(value: Any, what: str, path: str | None = None) -> None:
    """CorruptCheckpointError if ``value`` nests deeper than MAX_VALUE_DEPTH (found without recursing)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, list | tuple | set | frozenset):
            children = v
        else:
            continue
        if depth >= MAX_VALUE_DEPTH:
            raise CorruptCheckpointError(
                f"{what} nests more than {MAX_VALUE_DEPTH} deep: not a state "
                "ckptguard stores (decoding it would recurse without bound)",
                path=path,
            )
        stack.extend((c, depth + 1) for c in children)


def load_bounded(source: Any, what: str, path: str | None = None, map_location: Any = None) -> Any:
    """``torch.load(weights_only=True)`` and then the nesting bound (MAX_VALUE_DEPTH): the one way
    ckptguard unpickles a value from a checkpoint, a ``save_file`` file or an import, so that no path
    hands back a value that recursing code (decoding, saving, printing) cannot walk. torch.load's own
    refusals propagate for the caller to name; too deep is a CorruptCheckpointError naming ``what``."""
    try:
        value = torch.load(source, map_location=map_location, weights_only=True)
    except (CheckpointError, pickle.UnpicklingError, MemoryError):
        raise  # (weights_only's refusal of code is an UnpicklingError: callers name it)
    except Exception as e:  # a damaged file fails anywhere in torch's and zipfile's readers
        raise CorruptCheckpointError(
            f"{what}: torch.load cannot read it ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else 'no detail'}); the file is damaged "
            "or not a torch.save file",
            path=path,
        ) from None
    check_depth(value, what, path)
    return value


def item_index(item: StoredItem) -> MetadataIndex:
    return MetadataIndex(item.fqn, torch.Size(item.offsets) if item.offsets is not None else None)
