"""How tensors and DCP's metadata are represented in a ckptguard checkpoint.

Tensor bytes are written and read as raw memory (no serialized copy); DCP's
metadata travels as JSON inside the manifest, never as DCP's pickled
``.metadata`` file, so loading runs no code from the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptguard.dcp.records import StoredItem
from ckptguard.errors import CheckpointError, CorruptCheckpointError

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
        raise CorruptCheckpointError(f"invalid DCP metadata in manifest: {type(e).__name__}: {e}") from None
    for i in items:
        if i.shape is not None:
            expected = math.prod(i.shape) * dtype_from_name(i.dtype or "").itemsize
            if expected != i.length:
                raise CorruptCheckpointError(f"invalid manifest: {i.fqn} is stored as {i.length} bytes, but its shape "
                                      f"{list(i.shape)} of {i.dtype} needs {expected}")
    storage = {item_index(i): i for i in items}
    return Metadata(state_dict_metadata=sd, planner_data=planner_data, storage_data=storage,
                    version=obj.get("version"))


def item_index(item: StoredItem) -> MetadataIndex:
    return MetadataIndex(item.fqn, torch.Size(item.offsets) if item.offsets is not None else None)
