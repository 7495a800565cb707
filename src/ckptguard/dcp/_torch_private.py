"""Every private torch API ckptguard uses, in one place, checked against the torch versions tested.

DCP's public surface lacks a few things ckptguard needs (writing a loaded
object back into a nested state dict, DCP's own host-staging helpers, its
class-level plan caches, the global save plan without the coordinator's
collectives). Private APIs change without notice between releases, so they are
imported only here; ``check_torch_version`` names the versions they were
tested with when one has moved, instead of failing deep inside a save.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

#: torch releases the private APIs below were tested with (tests/project/test_torch_private.py).
TESTED_TORCH = ("2.13", "2.14")

_CACHE_ATTRS = (
    "_cached_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
    "_cached_final_save_plan",
)


class TorchVersionError(ImportError):
    """A private torch API ckptguard depends on is missing from the installed torch."""


def _missing(what: str, err: BaseException) -> TorchVersionError:
    return TorchVersionError(
        f"ckptguard needs {what}, which torch {torch.__version__} does not provide ({err}). ckptguard was "
        f"tested with torch {', '.join(TESTED_TORCH)}: install one of those, or a ckptguard release that "
        "supports this torch."
    )


try:
    # DCP's own helper for writing a loaded object back into the nested state dict.
    from torch.distributed._state_dict_utils import _create_cpu_state_dict
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as _flatten_state_dict
    from torch.distributed.checkpoint._traverse import set_element
except ImportError as e:  # pragma: no cover - depends on the installed torch
    raise _missing("torch.distributed's private state-dict helpers", e) from e


def torch_minor(version: str | None = None) -> str:
    """ "2.13" of "2.13.0+cpu"."""
    return ".".join((version or torch.__version__).split("+")[0].split(".")[:2])


def check_torch_version() -> None:
    """Raise TorchVersionError if a private API this module wraps is gone from the installed torch;
    warn once if the installed torch is not one of the versions tested (the APIs were found)."""
    if torch_minor() not in TESTED_TORCH:
        import warnings

        warnings.warn(
            f"ckptguard was tested with torch {', '.join(TESTED_TORCH)}; torch {torch.__version__} is "
            "not among them. The private torch APIs ckptguard needs were found, but their behaviour "
            "is unchecked on this release: run `pytest tests/project/test_torch_private.py` to check.",
            stacklevel=2,
        )
    if not hasattr(DefaultSavePlanner, "_create_global_plan"):
        raise _missing("DefaultSavePlanner._create_global_plan", AttributeError("missing"))
    for name in _CACHE_ATTRS:
        if not isinstance(getattr(SavePlanner, name, None), dict):
            raise _missing(f"SavePlanner.{name} (DCP's plan cache)", AttributeError("missing"))


class CachingSavePlanner(DefaultSavePlanner):
    """DCP's save planner with plan caching under a key of ours, and a hook on the global plan.

    DCP caches plans in class-level dicts keyed by ``_cached_plans_key``, and
    builds the global plan in ``_create_global_plan`` (called between its cache
    lookup and its cache store): both private, hence here.
    """

    def __init__(self, cache_key: str) -> None:
        super().__init__(dedup_save_to_lowest_rank=False, enable_plan_caching=True)
        # Fixed for the life of the Checkpointer: a key that changed on one rank (it once carried the
        # rank's dtypes) sent the coordinator to an empty cache while a rank sent it an empty plan.
        self._cached_plans_key = cache_key

    @property
    def cache_key(self) -> str:
        """The key of this planner's plans in DCP's class-level caches."""
        return self._cached_plans_key

    def set_up_flat(self, flat: dict[str, Any], mappings: dict[str, Any], is_coordinator: bool) -> None:
        """What DCP's ``set_up_planner`` leaves, for a state already flattened by DCP's rules and holding
        no ShardedTensor (DCP's second walk would change nothing)."""
        self.mappings = mappings
        self.state_dict = flat
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan, sent in full when it differs from the cached one in what DCP's comparison
        leaves out: the tensors' properties (dtype, requires_grad, pinning) and the nesting of the
        state (``planner_data``). A plan DCP judged unchanged made the coordinator reuse a Metadata
        naming the old dtypes and the old nesting."""
        sent = super().create_local_plan()
        if not sent.usable:
            cached = cached_local_plan(self._cached_plans_key)
            if cached is None or not _same_properties(self.plan, cached):
                self._pending_local_plan = self.plan  # promoted by finish_plan, as DCP does
                return self.plan
        return sent

    def adjust_global_plan(
        self, all_plans: list[SavePlan], global_plan: list[SavePlan], metadata: Metadata
    ) -> tuple[list[SavePlan], Metadata]:
        """Subclasses change DCP's global plan here (every rank's local plan at hand)."""
        return global_plan, metadata

    def check_local_plans(self, all_plans: list[SavePlan]) -> None:
        """Subclasses refuse a set of local plans here, before DCP merges them (every rank's at hand)."""

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        self.check_local_plans(all_plans)
        global_plan, metadata = super()._create_global_plan(all_plans)
        return self.adjust_global_plan(all_plans, global_plan, metadata)


def cached_local_plan(key: str) -> SavePlan | None:
    """The local plan DCP keeps under ``key`` after a save's plan was finished (None if none): the
    plan a rank compares its next one with."""
    return SavePlanner._cached_save_plan.get(key)


def _same_properties(plan: SavePlan, cached: SavePlan) -> bool:
    """Whether two plans DCP compared as equal (same items, indices, sizes, chunks) also agree on each
    tensor's properties and on the nesting of the state."""
    if plan.planner_data != cached.planner_data or len(plan.items) != len(cached.items):
        return False
    for item, other in zip(plan.items, cached.items, strict=True):
        if (item.tensor_data is None) != (other.tensor_data is None):
            return False
        if (
            item.tensor_data is not None
            and other.tensor_data is not None
            and item.tensor_data.properties != other.tensor_data.properties
        ):
            return False
    return True


def forget_cached_plans(prefix: str) -> None:
    """Drop DCP's class-level cached save plans stored under keys that start with ``prefix``."""
    for name in _CACHE_ATTRS:
        cache = getattr(SavePlanner, name, None)
        if isinstance(cache, dict):
            for key in list(cache):  # a copy taken at once: ranks that are threads forget together
                if isinstance(key, str) and key.startswith(prefix):
                    cache.pop(key, None)


def set_nested_element(root: Any, path: Any, value: Any) -> None:
    """Write ``value`` at DCP's flattened ``path`` inside the nested state dict ``root``."""
    set_element(root, path, value)


def flatten_state_dict(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's flat view of a nested state dict and the path of each flat key in it.

    A state of nested mappings without lists (a model's, an optimizer's state dict) is flattened here
    by DCP's rules for it (keys as ``str``, joined by dots, a duplicate refused): a third of the cost of
    DCP's general walk, which runs for every one of a load's thousands of values. Lists, and the
    torch 2.3 layout, go through DCP's own walk."""
    flat: dict[str, Any] = {}
    mappings: dict[str, Any] = {}
    if _derived_version() != "2_3" and _flatten_mappings(state_dict, (), flat, mappings):
        return flat, mappings
    flat, mappings = _flatten_state_dict(state_dict)
    return flat, mappings


def _derived_version() -> str | None:
    from torch.distributed.checkpoint import _version

    return getattr(_version, "_derived_version", None)


def _flatten_mappings(
    value: Mapping[Any, Any], path: tuple[str, ...], flat: dict[str, Any], mappings: dict[str, Any]
) -> bool:
    """DCP's flattening of nested mappings (``traverse_state_dict``: a mapping is walked, anything but
    a mapping or a list is a leaf); False as soon as a list is found (DCP's rules for lists differ)."""
    for k, v in value.items():
        p = (*path, str(k))
        if isinstance(v, Mapping):
            if not _flatten_mappings(v, p, flat, mappings):
                return False
        elif isinstance(v, list):
            return False
        else:
            fqn = ".".join(p)
            if fqn in flat:
                raise ValueError(f"duplicated flatten key {fqn}")
            flat[fqn] = v
            mappings[fqn] = p
    return True


def create_cpu_state_dict(state_dict: dict[str, Any], pin_memory: bool) -> dict[str, Any]:
    """Host buffers shaped like ``state_dict`` (DCP's async staging helper).

    Made on the CPU as ordinary tensors whatever the caller's context: DCP's helper follows the
    default device (under ``torch.device("meta")`` it made meta buffers) and under
    ``torch.inference_mode()`` it made inference tensors, which every later copy outside that mode
    refuses; the buffers are reused by the saves after."""
    with torch.device("cpu"), torch.inference_mode(False):
        out: dict[str, Any] = _create_cpu_state_dict(state_dict, pin_memory=pin_memory)
    return out


check_torch_version()


def has_internal_overlap(t: torch.Tensor) -> bool | None:
    """torch's own verdict on whether two elements of ``t`` are one memory location: None where it
    cannot tell (torch's TOO_HARD: any stride pattern but zero strides and dense tensors) or the
    check has moved."""
    check = getattr(torch, "_debug_has_internal_overlap", None)
    if check is not None:
        try:
            verdict = check(t)
            if verdict in (0, 1):
                return bool(verdict)
        except (RuntimeError, TypeError):
            pass
    return None
