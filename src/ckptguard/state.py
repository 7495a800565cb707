"""From the user's state (modules, optimizers, Stateful objects, plain values) to a DCP state dict and back.

Modules and optimizers go through DCP's get_state_dict/set_state_dict so that
DDP, FSDP2 (DTensor) and plain modules all work and loading reshards.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Container, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from ckptguard._signals import signals_deferred
from ckptguard.dcp.values import PLAIN_TENSOR_TYPES, decode_value, encode_value, per_rank_key
from ckptguard.errors import CheckpointError, UnsupportedValueError


class PerRank:
    """Marks a value as this rank's own (RNG state, data-loader position): stored once per rank.

    Plain values are otherwise treated as replicated: DCP keeps one copy for all ranks, and a plain
    value that differs across ranks is refused at save (``ReplicatedValueError``). Load with the same
    wrapper: the value is filled in place where it can be (tensors, dicts, ``Stateful`` objects), and
    ``.value`` holds what was loaded. ``Checkpointer.read()`` returns this rank's own value under its key.

    Example:
        ```python
        state = {"model": model, "loader": PerRank(loader.state_dict()), "rng": PerRank(RNGState())}
        ck.save(step, state)
        ck.load(state)
        loader.load_state_dict(state["loader"].value)
        ```

    Args:
        value: Any value ``Checkpointer.save`` accepts, or a ``Stateful`` object.

    Attributes:
        value: The wrapped value; after a load, what was loaded.
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


@dataclass
class PreparedState:
    state_dict: dict[str, Any]
    apply: Callable[[], None]  # after a load: push loaded values into modules, optimizers, objects
    undo: Callable[[], None]  # after a failed load: take back what preparing changed (an optimizer's state)
    # A never-stepped optimizer's key -> the parameters DCP gave a placeholder state to load into.
    placeholders: dict[str, list[Any]] = field(default_factory=dict)


def drop_placeholders(prepared: PreparedState, stored: Container[str]) -> None:
    """Take out of a load's template the placeholder state of each parameter the checkpoint holds no
    state for (``stored``: its flattened names). DCP gives a never-stepped optimizer a state for every
    parameter; a parameter that never had a gradient has none in the checkpoint, and the load was
    refused ("not in the checkpoint") and a fresh job could not resume. Such a parameter is loaded
    without state, as it was saved."""
    for key, params in prepared.placeholders.items():
        state = prepared.state_dict[key].get("state")
        if not isinstance(state, dict):
            continue
        for fqn in params:
            entries = state.get(fqn)
            if isinstance(entries, dict) and not any(f"{key}.state.{fqn}.{k}" in stored for k in entries):
                del state[fqn]
        if not state:
            prepared.state_dict[key]["state"] = encode_value({})


def _owner(optim: torch.optim.Optimizer, key: str, modules: Mapping[str, nn.Module]) -> nn.Module:
    params = {id(p) for g in optim.param_groups for p in g["params"]}
    for module in modules.values():
        if params <= {id(p) for p in module.parameters()}:
            return module
    raise CheckpointError(
        f"optimizer {key!r}: no module in the same state owns all of its parameters. Pass the model "
        f"alongside it, e.g. ck.save(step, {{'model': model, {key!r}: optim}})."
    )


def state_nbytes(obj: Any) -> int:
    """Bytes of tensor data this rank holds in a (nested) state dict."""
    if isinstance(obj, DTensor):
        local = obj.to_local()
        return local.numel() * local.element_size()
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(state_nbytes(v) for v in obj)
    return 0


def _later(fn: Callable[[Any], object], sd: dict[str, Any], key: str) -> Callable[[], object]:
    """``fn(what was loaded into sd[key])``, decoded (see ``values.encode_value``), after a load."""
    return lambda: fn(decode_value(sd[key]))


def merge_into(dst: Any, src: Any) -> Any:
    """Put a loaded value into the caller's object in place where it can (dicts, lists, arrays,
    tensors); the object that now holds the value (``dst``, or ``src`` where it could not)."""
    if dst is src:
        return dst
    if isinstance(dst, MutableMapping) and isinstance(src, Mapping):
        for k, v in src.items():
            dst[k] = merge_into(dst[k], v) if k in dst else v
        return dst
    if isinstance(dst, list) and isinstance(src, list):
        if len(dst) == len(src):
            dst[:] = [merge_into(a, b) for a, b in zip(dst, src, strict=True)]
        else:
            dst[:] = src
        return dst
    if (
        isinstance(dst, np.ndarray)
        and isinstance(src, np.ndarray)
        and dst.shape == src.shape
        and dst.dtype == src.dtype
        and dst.flags.writeable
    ):
        np.copyto(dst, src)
        return dst
    if (
        type(dst) is torch.Tensor
        and isinstance(src, torch.Tensor)
        and dst.shape == src.shape
        and dst.dtype == src.dtype
    ):
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
        return dst
    return src


def _merge_later(state: Mapping[str, Any], key: str, sd: dict[str, Any]) -> Callable[[], object]:
    def apply() -> None:
        merged = merge_into(state[key], decode_value(sd[key]))
        if isinstance(state, MutableMapping) and merged is not state[key]:
            state[key] = merged

    return apply


def _per_rank_later(holder: PerRank, sd: dict[str, Any], key: str) -> Callable[[], object]:
    def apply() -> None:
        holder.value = merge_into(holder.value, decode_value(sd[key]))

    return apply


@contextlib.contextmanager
def _gradients_set_aside(optim: torch.optim.Optimizer) -> Iterator[None]:
    """DCP builds that state only where no parameter holds a gradient (it takes one for the sign of
    a stateless optimizer): a template built after a backward pass had none, and the load was refused
    for a key the checkpoint has. The gradients are set aside meanwhile and given back as they were."""
    held = [(p, p.grad) for g in optim.param_groups for p in g["params"] if p.grad is not None]
    for p, _ in held:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in held:
            p.grad = grad


_OPTIMIZER_APPLY = StateDictOptions(strict=False)


def prepare_state(state: Mapping[str, Any], rank: int = 0, *, for_load: bool = False) -> PreparedState:
    """The DCP state dict of ``state``, with what a load then does (``apply``) or takes back (``undo``).
    ``for_load``: a never-stepped optimizer gets a state to load into even where gradients exist."""
    if not isinstance(state, Mapping):
        raise UnsupportedValueError(
            "state must be a mapping of names to modules, optimizers or values, "
            f"not {type(state).__name__} (rank {rank})",
            rank=rank,
        )
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    sd: dict[str, Any] = {}
    appliers: list[Callable[[], object]] = []
    placeholders: dict[str, list[Any]] = {}
    undoers: list[Callable[[], object]] = []

    def undo() -> None:
        for fn in undoers:
            fn()

    try:
        _prepare_values(state, rank, modules, sd, appliers, undoers, for_load, placeholders)
    except BaseException:
        undo()
        raise

    def apply() -> None:
        for fn in appliers:
            fn()

    return PreparedState(sd, apply, undo, placeholders)


def _prepare_values(
    state: Mapping[str, Any],
    rank: int,
    modules: Mapping[str, nn.Module],
    sd: dict[str, Any],
    appliers: list[Callable[[], object]],
    undoers: list[Callable[[], object]],
    for_load: bool,
    placeholders: dict[str, list[Any]],
) -> None:
    for key, value in state.items():
        if not isinstance(key, str) or not key:
            raise UnsupportedValueError(f"state keys must be non-empty strings, got {key!r} on rank {rank}", rank=rank)
        if type(value) in PLAIN_TENSOR_TYPES:  # most values, as the last branch below takes them, without
            sd[key] = value  # the Stateful check (a runtime Protocol's isinstance: ~16 us per value)
            continue
        if isinstance(value, nn.Module):
            sd[key] = encode_value(get_model_state_dict(value), (key,))
            appliers.append(_later(functools.partial(set_model_state_dict, value), sd, key))
        elif isinstance(value, torch.optim.Optimizer):
            model = _owner(value, key, modules)
            fresh = not value.state
            if fresh:
                # DCP gives an optimizer that never stepped a state to load into (a step with zero
                # gradients and learning rate): a load that fails must leave it without one again.
                undoers.append(value.state.clear)
            # DCP's step sets every learning rate to 0 and back: a Ctrl-C inside left it 0 (outside
            # attack), so a fresh optimizer's preparation runs whole, the signal handled after it.
            with (
                signals_deferred() if fresh else contextlib.nullcontext(),
                _gradients_set_aside(value) if fresh and for_load else contextlib.nullcontext(),
            ):
                sd[key] = encode_value(get_optimizer_state_dict(model, value), (key,))
            if fresh and isinstance(sd[key].get("state"), dict):
                if for_load:
                    placeholders[key] = list(sd[key]["state"])
                else:  # saved as it is, without state: the placeholder's step would make a resumed Adam's
                    sd[key] = {**sd[key], "state": encode_value({})}  # next step its second
            # Not DCP's strict: it refuses a parameter without state (one that never had a gradient), also
            # where the optimizer saved had none for it; the load has checked the keys already, and the
            # parameter is left without state, as it was saved (DCP's strict makes such a checkpoint
            # unloadable, and raises after the model was placed).
            appliers.append(
                _later(functools.partial(set_optimizer_state_dict, model, value, options=_OPTIMIZER_APPLY), sd, key)
            )
        elif isinstance(value, PerRank):
            pkey = per_rank_key(key, rank)
            inner = value.value
            sd[pkey] = encode_value(inner.state_dict() if isinstance(inner, Stateful) else inner, (key,))
            if isinstance(inner, Stateful):
                appliers.append(_later(inner.load_state_dict, sd, pkey))
            else:
                appliers.append(_per_rank_later(value, sd, pkey))
        elif isinstance(value, Stateful):
            sd[key] = encode_value(value.state_dict(), (key,))
            appliers.append(_later(value.load_state_dict, sd, key))
        else:
            sd[key] = encode_value(value, (key,))
            if sd[key] is not value or not isinstance(value, torch.Tensor | dict):
                # DCP fills tensors in place, and replaces everything else in *its* dict (or in the
                # encoded copy): hand what was loaded back to the caller's objects.
                appliers.append(_merge_later(state, key, sd))
