"""Values that are not tensors: rewritten, reversibly, into what DCP stores and gives back exactly;
DCP's flat names nested again; the keys of per-rank values.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ckptguard.errors import CheckpointError

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
#: The tensor types taken as they are, tested by exact type before anything else: most values of a
#: state, and a runtime Protocol's or an ABC's isinstance costs microseconds per value.
PLAIN_TENSOR_TYPES: tuple[type, ...] = (torch.Tensor, torch.nn.Parameter)
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
        "or str(...) / int(...) of it"
    )
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
    raise _refuse(
        key,
        path,
        f"its key {key!r} is a {type(key).__qualname__}; dict keys must be str, int, "
        "float, bool, None, bytes or tuples of those. Use str(key) instead",
    )


def _key_from_json(obj: Any) -> Any:
    if obj is None or type(obj) in (int, str):
        return obj
    if isinstance(obj, dict) and len(obj) == 1:
        ((tag, v),) = obj.items()
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

    encoded = "<key>" + json.dumps(_key_json(key, path), separators=(",", ":"))
    if _key_too_large(encoded):  # what decode_key refuses is refused here: saved, no load could read it
        levels = encoded.count("[") + encoded.count("{")
        raise _refuse(
            key,
            path,
            f"a dict key of type {type(key).__name__} whose encoding ({len(encoded)} "
            f"characters, {levels} brackets) is more than a load takes (4096 characters, 32 brackets). "
            "Use a smaller key, e.g. a string naming it",
        )
    return encoded


def _key_too_large(encoded: str) -> bool:
    """Keys are small: a bound checked before recursing into one (the same at the save and the load)."""
    return len(encoded) > 4096 or encoded.count("[") + encoded.count("{") > 32


def decode_key(key: str) -> Any:
    if not key.startswith("<"):
        return key
    if key.startswith("<str>"):
        return key[5:]
    try:
        if key.startswith("<int>") and key[5:].lstrip("-").isdigit() and len(key) <= 4096:
            return int(key[5:])
        if key.startswith("<key>"):
            import json

            if _key_too_large(key):
                raise CheckpointError(f"invalid encoded dict key {key[:100]!r}... in checkpoint: too large or deep")
            return _key_from_json(json.loads(key[5:]))
    except (ValueError, TypeError, RecursionError):  # stored bytes: whatever they hold is a refusal
        pass
    raise CheckpointError(f"invalid encoded dict key {key[:100]!r} in checkpoint")


def _encode_ndarray(arr: Any, scalar: bool, path: tuple[Any, ...]) -> dict[str, Any]:
    import numpy as np

    if arr.dtype.hasobject or arr.dtype.fields is not None:
        raise _refuse(
            arr,
            path,
            f"a numpy array of dtype {arr.dtype} (object or structured) cannot be stored "
            "as bytes; convert it to a plain dtype, a list, or a dict of arrays",
        )
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


_CONTAINERS = (dict, list, tuple, set, frozenset)


def refuse_unsavable(state_dict: Mapping[str, Any]) -> None:
    """UnsupportedValueError naming the first value of the (prepared) state that a save cannot store
    for a load to give back, found before anything is written (in the plan's agreement, every rank
    raises it), never a raw torch error halfway through the write:

    - a tensor of a layout, kind or dtype the data path does not store (:func:`tensor_problem`);
    - nesting deeper than a load takes (MAX_VALUE_DEPTH, the state's own dict at depth 0): saved, it
      was committed and verified intact, and every load then refused it as corrupt."""
    from ckptguard.dcp.codec import MAX_VALUE_DEPTH

    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(state_dict, 0, ())]
    while stack:
        value, depth, path = stack.pop()
        children: Any = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in children:
            if type(child) in PLAIN_TENSOR_TYPES:
                problem = tensor_problem(child)
                if problem is not None:
                    raise _refuse(child, (*path, key), problem)
                continue
            if not isinstance(child, _CONTAINERS):
                continue
            if depth + 1 >= MAX_VALUE_DEPTH:
                raise _refuse(
                    child,
                    (*path, key),
                    f"it nests more than {MAX_VALUE_DEPTH} deep (dicts, lists, "
                    "tuples and sets, as stored), more than a load takes. Store it flatter, e.g. "
                    "as a tensor or a string",
                )
            stack.append((child, depth + 1, (*path, key)))


#: Dtypes whose elements are not whole bytes (or have no arithmetic): torch cannot copy, compare or
#: cast them as the data path does; their bytes are stored as uint8 by the caller if they must be.
_UNSTORED_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "bits1x8",
        "bits2x4",
        "bits4x2",
        "bits8",
        "bits16",
        *(f"int{n}" for n in range(1, 8)),
        *(f"uint{n}" for n in range(1, 8)),
    )
    if hasattr(torch, name)
)


def tensor_problem(t: torch.Tensor) -> str | None:
    """Why a plain tensor cannot be saved (None: it can): a sparse, quantized, nested or meta tensor,
    or a sub-byte or bits dtype."""
    if t.layout is not torch.strided:
        return (
            f"a {t.layout} tensor is not stored (only dense tensors): save t.to_dense(), or its "
            "indices and values as dense tensors"
        )
    if t.is_quantized:
        return (
            "a quantized tensor is not stored: save t.int_repr() with t.q_scale() and t.q_zero_point() "
            "(or t.dequantize())"
        )
    if t.is_nested:
        return "a nested tensor is not stored: save t.unbind() (a list of its tensors)"
    if t.is_meta:
        return (
            "a tensor on the meta device has no data to store: materialise it first (e.g. "
            "module.to_empty(device=...) and initialise it)"
        )
    if t.dtype in _UNSTORED_DTYPES:
        return (
            f"the dtype {t.dtype} (elements of less than a byte, or bits) is not stored: save "
            "t.view(torch.uint8) and view it back after the load"
        )
    return None


def refuse_flat_collisions(state_dict: dict[str, Any]) -> None:
    """UnsupportedValueError where two values of the state get the same DCP name (``{"a.b": x}`` beside
    ``{"a": {"b": y}}``: DCP joins nested keys with dots). The plan refuses it too; an async save checks
    at the call, so that the refusal is not left to ``wait()``."""
    from ckptguard.dcp import _torch_private

    try:
        _torch_private.flatten_state_dict(state_dict)
    except ValueError as e:
        raise flat_collision_error(e) from None


def flat_collision_error(err: ValueError) -> CheckpointError:
    """DCP's "duplicated flatten key" refusal as an UnsupportedValueError that says what to do."""
    from ckptguard.errors import UnsupportedValueError

    key = str(err).removeprefix("duplicated flatten key ").strip()
    return UnsupportedValueError(
        f"cannot save two values under the name {key!r}: DCP joins nested keys with dots, so a key with a dot "
        "and a nested dict of the same path collide. Rename one of them."
    )


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
            ev = (
                v
                if type(v) in PLAIN_TENSOR_TYPES
                else encode_value(  # kept without a call
                    v, (*path, k), plain_torch_load=plain_torch_load
                )
            )
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
        return {
            "<tuple>": [encode_value(v, (*path, i), plain_torch_load=plain_torch_load) for i, v in enumerate(value)]
        }
    if plain_torch_load and type(value) is frozenset:
        raise _refuse(value, path, "torch.load(weights_only=True) cannot load a frozenset; store a set or a tuple")
    if type(value) in (set, frozenset):
        if type(value) is set and _plain(value):
            return value
        tag = "<set>" if type(value) is set else "<frozenset>"
        return {tag: [encode_value(v, (*path, "<item>"), plain_torch_load=plain_torch_load) for v in value]}
    import numpy as np

    if plain_torch_load and isinstance(value, np.ndarray | np.generic):
        raise _refuse(
            value,
            path,
            "torch.load(weights_only=True) cannot load a numpy value; store "
            "torch.from_numpy(a) or a.tolist() (or save it with a Checkpointer, which "
            "stores numpy values exactly)",
        )
    if isinstance(value, np.ndarray) and type(value) is np.ndarray:
        return _encode_ndarray(value, False, path)
    if isinstance(value, np.generic):
        return _encode_ndarray(np.asarray(value), True, path)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        raise _refuse(
            value,
            path,
            f"a namedtuple ({type(value).__qualname__}) would come back as a plain "
            "tuple; store value._asdict() or tuple(value)",
        )
    if isinstance(value, list | tuple | set | frozenset | str | int | float | bytes):
        raise _refuse(
            value,
            path,
            f"a {type(value).__qualname__} (a subclass of {type(value).__mro__[1].__name__})"
            f" would come back as a plain {type(value).__mro__[1].__name__}; convert it first",
        )
    raise _refuse(value, path)


def decode_value(value: Any) -> Any:
    """What ``encode_value`` was given, from what DCP gave back; the same object where nothing was encoded."""
    if isinstance(value, dict):
        if value.keys() and value.keys() <= _NDARRAY_KEYS and "<ndarray>" in value:
            return _decode_ndarray(value)
        if len(value) == 1:
            ((tag, inner),) = value.items()
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
