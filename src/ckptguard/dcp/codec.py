"""How tensors and DCP's metadata are represented in a ckptguard checkpoint.

Tensor bytes are written and read as raw memory (no serialized copy); DCP's
metadata travels as JSON inside the manifest, never as DCP's pickled
``.metadata`` file, so loading runs no code from the checkpoint.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
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

from ckptguard.dcp.records import ITEMSIZES, StoredItem
from ckptguard.errors import CheckpointError, CorruptCheckpointError

_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}

_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                 torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128}


_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" of torch.float32 (a lookup: it runs for every item of every save and load)."""
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


def metadata_from_json(obj: dict[str, Any], items: Sequence[StoredItem], path: str | None = None, *,
                       domain_count: int = 1) -> Metadata:
    """DCP's Metadata from the manifest's JSON; every size and index bounded by what the items hold.

    ``domain_count`` > 1: the manifest is one storage domain's of several and its items hold only that
    domain's share (a per-rank value or a shard may live in another domain's manifest), so a tensor's
    size is bounded by its declared chunks, each of which must lie inside it, instead."""
    props: dict[tuple[str, bool], TensorProperties] = {}
    stored: dict[str, int] = {}
    for i in items:
        stored[i.fqn] = stored.get(i.fqn, 0) + i.length
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
                _check_size(fqn, e["size"], flat, key[0], stored if domain_count == 1 else None)
                sd[fqn] = TensorStorageMetadata(properties=props[key], size=torch.Size(e["size"]), chunks=chunks)
            else:
                raise ValueError(f"unknown entry type {e['type']!r}")
        planner_data = {}
        entries = len(obj["planner_data"])
        for k, path in obj["planner_data"].items():
            # Lists are rebuilt by index (unflatten) and nested by path: an index is below the number of
            # entries (each list element that holds something has one), a path no longer than MAX_VALUE_DEPTH.
            if not isinstance(path, list) or not 0 < len(path) <= MAX_VALUE_DEPTH or not all(
                    type(p) is str or (type(p) is int and 0 <= p < entries) for p in path):
                raise ValueError(f"bad planner path for {str(k)[:100]!r}: {str(path)[:100]}")
            planner_data[str(k)] = tuple(path)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"invalid DCP metadata in manifest {path or ''}: {type(e).__name__}: {e}",
                                     path=path) from None
    # Each item's shape was checked against its length when the manifest was parsed.
    storage = {item_index(i): i for i in items}
    return Metadata(state_dict_metadata=sd, planner_data=planner_data, storage_data=storage,
                    version=obj.get("version"))


#: How deeply a stored value may nest (dicts, lists, tuples, sets): decoding and encoding recurse.
MAX_VALUE_DEPTH = 100


def _check_size(fqn: str, size: Any, flat: Any, dtype: str, stored: Mapping[str, int] | None) -> None:
    """A tensor's size: what a reader allocates before reading. Its bytes cannot exceed what the
    checkpoint stores for it (each item's length was checked against its file when parsed); where the
    manifest holds only a share of the checkpoint (``stored`` None), its elements cannot exceed those
    of its chunks, each inside the tensor."""
    if not (type(size) is list and len(size) <= 64 and all(type(d) is int and d >= 0 for d in size)):
        raise ValueError(f"{fqn[:100]}: size {str(size)[:100]} is not a list of integers >= 0")
    if not (type(flat) is list and all(type(d) is int and d >= 0 for d in flat)):
        raise ValueError(f"{fqn[:100]}: chunk offsets and sizes must be integers >= 0")
    itemsize = ITEMSIZES.get(dtype)
    if itemsize is None:
        return
    if stored is not None:
        if math.prod(size) * itemsize > stored.get(fqn, 0):
            raise ValueError(f"{fqn[:100]}: size {size[:8]} of {dtype} is more than the {stored.get(fqn, 0)} "
                             "bytes stored for it")
        return
    ndim = len(size)
    covered = 1 if ndim == 0 else 0
    for i in range(0, len(flat), 2 * ndim or 1):
        if ndim == 0:
            break
        offsets, sizes = flat[i:i + ndim], flat[i + ndim:i + 2 * ndim]
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
            raise CorruptCheckpointError(f"{what} nests more than {MAX_VALUE_DEPTH} deep: not a state "
                                         "ckptguard stores (decoding it would recurse without bound)", path=path)
        stack.extend((c, depth + 1) for c in children)


def load_bounded(source: Any, what: str, path: str | None = None, map_location: Any = None) -> Any:
    """``torch.load(weights_only=True)`` and then the nesting bound (MAX_VALUE_DEPTH): the one way
    ckptguard unpickles a value from a checkpoint, a ``save_file`` file or an import, so that no path
    hands back a value that recursing code (decoding, saving, printing) cannot walk. torch.load's own
    refusals propagate for the caller to name; too deep is a CorruptCheckpointError naming ``what``."""
    value = torch.load(source, map_location=map_location, weights_only=True)
    check_depth(value, what, path)
    return value


def item_index(item: StoredItem) -> MetadataIndex:
    return MetadataIndex(item.fqn, torch.Size(item.offsets) if item.offsets is not None else None)


# -- user values <-> what DCP stores and gives back exactly -----------------------------
#
# DCP flattens nested dicts into names joined by "." (every key turned into str(key)), walks
# lists that hold tensors or dicts, stores other leaves with torch.save and ckptguard loads
# them with torch.load(weights_only=True). So without help an int key comes back a str (and
# 0 and "0" flatten to one name), an empty dict vanishes, and a numpy array or numpy scalar
# cannot be loaded at all. ``encode_value`` rewrites a value, reversibly, into one that DCP
# gives back exactly; ``decode_value`` undoes it. Both return the very same object where
# nothing needs rewriting (a model's state dict: str keys, tensors), so that DCP still fills
# the caller's tensors in place and old checkpoints keep their names.
#
#   key: str not starting with "<"     itself
#        str starting with "<"         "<str>" + key
#        int                           "<int>" + decimal
#        bool, float, None, bytes,
#        tuples of those               "<key>" + JSON of the tagged form below
#   {}                                 {"<dict>": []}
#   tuple holding only plain leaves    itself (torch.save / weights_only keep tuples)
#   other tuple                        {"<tuple>": [items]}
#   set of plain leaves                itself;  other set / frozenset: {"<set>"|"<frozenset>": [items]}
#   torch.Size                         {"<size>": [...]}
#   numpy array or scalar              {"<ndarray>": tensor, "<dtype>": dtype.str, "<shape>": [...],
#                                       "<scalar>": bool}   (a typed tensor where torch has the
#                                       dtype, else the raw bytes as uint8)
#
# A user's key can never be one of the tags: every str key starting with "<" is escaped.

_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_TAGS = frozenset({"<dict>", "<tuple>", "<set>", "<frozenset>", "<ndarray>", "<size>"})
_NDARRAY_KEYS = frozenset({"<ndarray>", "<dtype>", "<shape>", "<scalar>"})


def _where(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path) or "the value"


def _refuse(value: Any, path: tuple[Any, ...], what: str = "") -> CheckpointError:
    from ckptguard.errors import UnsupportedValueError

    hint = what or (
        f"a {type(value).__module__}.{type(value).__qualname__} cannot be loaded back without unpickling "
        "code from the checkpoint (ckptguard loads objects with torch.load(weights_only=True)). Store what "
        "describes it instead: its state_dict() (or make it a Stateful at the top level), a dict, a tensor, "
        "or str(...) / int(...) of it")
    return UnsupportedValueError(f"cannot save {_where(path)}: {hint}.")


def _plain(value: Any) -> bool:
    """Whether torch.save + torch.load(weights_only=True) give ``value`` back exactly, as one leaf."""
    if type(value) in _PLAIN_LEAVES:
        return True
    if type(value) is tuple or type(value) is list:
        return all(_plain(v) for v in value)
    if type(value) is set:
        return all(type(v) in _PLAIN_LEAVES for v in value)
    return False


def _key_json(key: Any, path: tuple[Any, ...]) -> Any:
    if key is None or type(key) in (int, str):
        return key
    if type(key) is bool:
        return {"b": key}
    if type(key) is float:
        return {"f": repr(key)}
    if type(key) is bytes:
        return {"x": key.hex()}
    if type(key) is tuple:
        return {"t": [_key_json(k, path) for k in key]}
    raise _refuse(key, path, f"its key {key!r} is a {type(key).__qualname__}; dict keys must be str, int, "
                             "float, bool, None, bytes or tuples of those. Use str(key) instead")


def _key_from_json(obj: Any) -> Any:
    if obj is None or type(obj) in (int, str):
        return obj
    if isinstance(obj, dict) and len(obj) == 1:
        (tag, v), = obj.items()
        if tag == "b":
            return bool(v)
        if tag == "f":
            return float(v)
        if tag == "x":
            return bytes.fromhex(v)
        if tag == "t":
            return tuple(_key_from_json(k) for k in v)
    raise CheckpointError(f"invalid encoded dict key {obj!r} in checkpoint")


def encode_key(key: Any, path: tuple[Any, ...] = ()) -> str:
    if type(key) is str:
        return "<str>" + key if key.startswith("<") else key
    if type(key) is int:
        return f"<int>{key}"
    import json

    return "<key>" + json.dumps(_key_json(key, path), separators=(",", ":"))


def decode_key(key: str) -> Any:
    if not key.startswith("<"):
        return key
    if key.startswith("<str>"):
        return key[5:]
    if key.startswith("<int>"):
        return int(key[5:])
    if key.startswith("<key>"):
        import json

        if len(key) > 4096 or key.count("[") + key.count("{") > 32:  # keys are small: bound before recursing
            raise CheckpointError(f"invalid encoded dict key {key[:100]!r}... in checkpoint: too large or deep")
        return _key_from_json(json.loads(key[5:]))
    raise CheckpointError(f"invalid encoded dict key {key!r} in checkpoint")


def _encode_ndarray(arr: Any, scalar: bool, path: tuple[Any, ...]) -> dict[str, Any]:
    import numpy as np

    if arr.dtype.hasobject or arr.dtype.fields is not None:
        raise _refuse(arr, path, f"a numpy array of dtype {arr.dtype} (object or structured) cannot be stored "
                                 "as bytes; convert it to a plain dtype, a list, or a dict of arrays")
    a = np.ascontiguousarray(arr)
    tensor: torch.Tensor
    try:
        if not a.dtype.isnative or a.dtype.kind not in "biufc":
            raise TypeError(a.dtype)
        tensor = torch.from_numpy(a.copy() if not a.flags.writeable else a)
    except TypeError:  # a dtype torch lacks (strings, datetimes, big-endian, float128): its bytes
        tensor = torch.from_numpy(a.reshape(-1).view(np.uint8).copy())
    return {"<ndarray>": tensor, "<dtype>": a.dtype.str, "<shape>": list(arr.shape), "<scalar>": scalar}


def _decode_ndarray(obj: dict[str, Any]) -> Any:
    import numpy as np

    dtype = np.dtype(obj["<dtype>"])
    tensor = obj["<ndarray>"]
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError("invalid encoded numpy array in checkpoint")
    flat = tensor.detach().cpu().contiguous()
    if flat.dtype == torch.uint8 and dtype != np.dtype(np.uint8):
        arr = np.frombuffer(flat.numpy().tobytes(), dtype=dtype).reshape(obj["<shape>"]).copy()
    elif flat.dtype == torch.bfloat16:
        raise CheckpointError("invalid encoded numpy array in checkpoint (bfloat16)")
    else:
        arr = flat.numpy().astype(dtype, copy=False).reshape(obj["<shape>"])
    return arr[()] if obj["<scalar>"] else arr


def encode_value(value: Any, path: tuple[Any, ...] = (), *, plain_torch_load: bool = False) -> Any:
    """``value`` as DCP stores it exactly (see above); the same object where nothing changes.

    Raises UnsupportedValueError naming the place of a value that cannot round-trip.
    ``plain_torch_load=True`` also refuses what only the encoding makes loadable (numpy values, frozensets):
    the check for a value stored by torch.save as it is and read back by torch.load(weights_only=True).
    """
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN_LEAVES:
        return value
    if isinstance(value, Mapping):
        if not value:
            return {"<dict>": []}
        out: dict[str, Any] = {}
        changed = type(value) not in (dict, OrderedDict)
        for k, v in value.items():
            ek = encode_key(k, path)
            ev = encode_value(v, (*path, k), plain_torch_load=plain_torch_load)
            changed = changed or ek is not k or ev is not v
            out[ek] = ev
        return out if changed else value
    if type(value) is list:
        items = [encode_value(v, (*path, i), plain_torch_load=plain_torch_load) for i, v in enumerate(value)]
        return items if any(a is not b for a, b in zip(items, value, strict=True)) else value
    if type(value) is torch.Size:  # a tuple to DCP's host staging: tagged, to come back a Size
        return {"<size>": list(value)}
    if type(value) is tuple:
        if _plain(value):
            return value
        return {"<tuple>": [encode_value(v, (*path, i), plain_torch_load=plain_torch_load)
                            for i, v in enumerate(value)]}
    if plain_torch_load and type(value) is frozenset:
        raise _refuse(value, path, "torch.load(weights_only=True) cannot load a frozenset; store a set or a tuple")
    if type(value) in (set, frozenset):
        if type(value) is set and _plain(value):
            return value
        tag = "<set>" if type(value) is set else "<frozenset>"
        return {tag: [encode_value(v, (*path, "<item>"), plain_torch_load=plain_torch_load) for v in value]}
    import numpy as np

    if plain_torch_load and isinstance(value, np.ndarray | np.generic):
        raise _refuse(value, path, "torch.load(weights_only=True) cannot load a numpy value; store "
                                   "torch.from_numpy(a) or a.tolist() (or save it with a Checkpointer, which "
                                   "stores numpy values exactly)")
    if isinstance(value, np.ndarray) and type(value) is np.ndarray:
        return _encode_ndarray(value, False, path)
    if isinstance(value, np.generic):
        return _encode_ndarray(np.asarray(value), True, path)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        raise _refuse(value, path, f"a namedtuple ({type(value).__qualname__}) would come back as a plain "
                                   "tuple; store value._asdict() or tuple(value)")
    if isinstance(value, list | tuple | set | frozenset | str | int | float | bytes):
        raise _refuse(value, path, f"a {type(value).__qualname__} (a subclass of {type(value).__mro__[1].__name__})"
                                   f" would come back as a plain {type(value).__mro__[1].__name__}; convert it first")
    raise _refuse(value, path)


def decode_value(value: Any) -> Any:
    """What ``encode_value`` was given, from what DCP gave back; the same object where nothing was encoded."""
    if isinstance(value, dict):
        if value.keys() and value.keys() <= _NDARRAY_KEYS and "<ndarray>" in value:
            return _decode_ndarray(value)
        if len(value) == 1:
            (tag, inner), = value.items()
            if tag in _TAGS:
                if tag == "<dict>":
                    return {}
                if tag == "<size>":
                    return torch.Size(inner)
                items = [decode_value(v) for v in inner]
                return tuple(items) if tag == "<tuple>" else set(items) if tag == "<set>" else frozenset(items)
        out: dict[Any, Any] = {}
        changed = False
        for k, v in value.items():
            dk = decode_key(k) if isinstance(k, str) else k
            dv = decode_value(v)
            changed = changed or dk is not k or dv is not v
            out[dk] = dv
        return out if changed else value
    if isinstance(value, list):
        items = [decode_value(v) for v in value]
        return items if any(a is not b for a, b in zip(items, value, strict=True)) else value
    return value


def unflatten(flat: Mapping[str, Any], paths: Mapping[str, Sequence[str | int]]) -> dict[str, Any]:
    """DCP's flat {name: value} back into nested dicts and lists, from the paths it recorded."""
    root: dict[str, Any] = {}
    for fqn, value in flat.items():
        path = list(paths.get(fqn, (fqn,)))
        node: Any = root
        for i, part in enumerate(path):
            last = i == len(path) - 1
            nxt: Any = value if last else ([] if isinstance(path[i + 1], int) else {})
            if isinstance(part, int):
                if not isinstance(node, list):
                    raise CheckpointError(f"{fqn}: inconsistent nesting in checkpoint metadata")
                while len(node) <= part:
                    node.append(None)
                if last or node[part] is None:
                    node[part] = nxt
                node = node[part]
            else:
                if not isinstance(node, dict):
                    raise CheckpointError(f"{fqn}: inconsistent nesting in checkpoint metadata")
                if last or part not in node:
                    node[part] = nxt
                node = node[part]
    return root


# A PerRank value is stored under its top-level key with the rank appended (``meta@rank00003``).
def per_rank_key(key: str, rank: int) -> str:
    return f"{key}@rank{rank:05d}"


_PER_RANK = re.compile(r"^[^.]*@rank\d{5}(\.|$)")
_PER_RANK_KEY = re.compile(r"^(.+)@rank(\d{5,})$")


def is_per_rank_key(fqn: str) -> bool:
    """Whether a flattened key lies under a PerRank value (its top-level key carries the rank)."""
    return _PER_RANK.match(fqn) is not None


def split_per_rank_key(key: str) -> tuple[str, int] | None:
    """(the user's key, the rank) of a top-level key made by :func:`per_rank_key`, else None."""
    m = _PER_RANK_KEY.match(key)
    return (m.group(1), int(m.group(2))) if m is not None else None
