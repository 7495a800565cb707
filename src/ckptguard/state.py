"""From the user's state (modules, optimizers, Stateful objects, plain values) to a DCP state dict and back.

Modules and optimizers go through DCP's get_state_dict/set_state_dict so that
DDP, FSDP2 (DTensor) and plain modules all work and loading reshards.
"""

from __future__ import annotations

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


def prepare_state(state: Mapping[str, Any], rank: int = 0) -> PreparedState:
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping of names to modules, optimizers or values, not {type(state).__name__}")
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    sd: dict[str, Any] = {}
    appliers: list[Callable[[], None]] = []
    for key, value in state.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"state keys must be non-empty strings, got {key!r}")
        if isinstance(value, nn.Module):
            sd[key] = get_model_state_dict(value)
            appliers.append(lambda m=value, k=key: set_model_state_dict(m, sd[k]))  # type: ignore[misc]
        elif isinstance(value, torch.optim.Optimizer):
            model = _owner(value, key, modules)
            sd[key] = get_optimizer_state_dict(model, value)
            appliers.append(lambda m=model, o=value, k=key: set_optimizer_state_dict(m, o, sd[k]))  # type: ignore[misc]
        elif isinstance(value, PerRank):
            pkey = per_rank_key(key, rank)
            inner = value.value
            sd[pkey] = inner.state_dict() if isinstance(inner, Stateful) else inner
            if isinstance(inner, Stateful):
                appliers.append(lambda o=inner, k=pkey: o.load_state_dict(sd[k]))  # type: ignore[misc]
            else:
                appliers.append(lambda w=value, k=pkey: setattr(w, "value", sd[k]))  # type: ignore[misc]
        elif isinstance(value, Stateful):
            sd[key] = value.state_dict()
            appliers.append(lambda o=value, k=key: o.load_state_dict(sd[k]))  # type: ignore[misc]
        else:
            sd[key] = value
            if isinstance(state, MutableMapping) and not isinstance(value, torch.Tensor | dict):
                # DCP replaces top-level plain values in *its* dict; hand them back to the caller's.
                appliers.append(lambda k=key: state.__setitem__(k, sd[k]))  # type: ignore[misc]

    def apply() -> None:
        for fn in appliers:
            fn()

    return PreparedState(sd, apply)
