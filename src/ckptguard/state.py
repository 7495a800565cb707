"""From the user's state (modules, optimizers, Stateful objects, plain values) to a DCP state dict and back.

Modules and optimizers go through DCP's get_state_dict/set_state_dict so that
DDP, FSDP2 (DTensor) and plain modules all work and loading reshards.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from ckptguard.errors import CheckpointError


class PerRank:
    """Marks a value as this rank's own (RNG state, data-loader position): stored once per rank.

    Plain values are otherwise treated as replicated, and DCP keeps one copy for
    all ranks. ``ck.save(step, {"model": m, "loader": PerRank(loader_state)})``;
    load with the same wrapper; the value is filled in place where it can be
    (tensors, dicts), and ``.value`` holds what was loaded.
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


def per_rank_key(key: str, rank: int) -> str:
    return f"{key}@rank{rank:05d}"


_PER_RANK = re.compile(r"^[^.]*@rank\d{5}(\.|$)")


def is_per_rank_key(fqn: str) -> bool:
    """Whether a flattened key lies under a PerRank value (its top-level key carries the rank)."""
    return _PER_RANK.match(fqn) is not None


@dataclass
class PreparedState:
    state_dict: dict[str, Any]
    apply: Callable[[], None]  # after a load: push loaded values into modules, optimizers, objects


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
    """``fn(sd[key])``, called after a load has replaced ``sd[key]`` with what was loaded."""
    return lambda: fn(sd[key])


def prepare_state(state: Mapping[str, Any], rank: int = 0) -> PreparedState:
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping of names to modules, optimizers or values, not {type(state).__name__}")
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    sd: dict[str, Any] = {}
    appliers: list[Callable[[], object]] = []
    for key, value in state.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"state keys must be non-empty strings, got {key!r}")
        if isinstance(value, nn.Module):
            sd[key] = get_model_state_dict(value)
            appliers.append(_later(functools.partial(set_model_state_dict, value), sd, key))
        elif isinstance(value, torch.optim.Optimizer):
            model = _owner(value, key, modules)
            sd[key] = get_optimizer_state_dict(model, value)
            appliers.append(_later(functools.partial(set_optimizer_state_dict, model, value), sd, key))
        elif isinstance(value, PerRank):
            pkey = per_rank_key(key, rank)
            inner = value.value
            sd[pkey] = inner.state_dict() if isinstance(inner, Stateful) else inner
            if isinstance(inner, Stateful):
                appliers.append(_later(inner.load_state_dict, sd, pkey))
            else:
                appliers.append(_later(functools.partial(setattr, value, "value"), sd, pkey))
        elif isinstance(value, Stateful):
            sd[key] = value.state_dict()
            appliers.append(_later(value.load_state_dict, sd, key))
        else:
            sd[key] = value
            if isinstance(state, MutableMapping) and not isinstance(value, torch.Tensor | dict):
                # DCP replaces top-level plain values in *its* dict; hand them back to the caller's.
                appliers.append(_later(functools.partial(state.__setitem__, key), sd, key))

    def apply() -> None:
        for fn in appliers:
            fn()

    return PreparedState(sd, apply)
