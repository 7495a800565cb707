"""torchtitan: ``CkptguardCheckpointManager``, a checkpoint manager whose every save is one ckptguard commit.

    from ckptguard.integrations.torchtitan import CkptguardCheckpointManager
    config.checkpoint = CkptguardCheckpointManager.Config(enable=True, interval=500, keep_latest_k=3)

torchtitan's trainer builds whatever ``config.checkpoint`` names (``config.checkpoint.build(dataloader=,
model_parts=, optimizers=, lr_schedulers=, states=, sd_adapter=, base_folder=)``) and calls
``load(step=config.checkpoint.load_step)`` once, ``save(step, last_step=...)`` every step, and
``maybe_wait_for_staging()`` / ``close()``; this class implements that contract
(``torchtitan.components.checkpointer.BaseCheckpointManager``) with the policies of torchtitan's own DCP
``CheckpointManager``, through one collective ``Checkpointer`` whose root is ``<dump_folder>/<folder>``.

torchtitan's own manager ``dcp.save``s straight into ``<folder>/step-N`` (an existing one is overwritten
in place, its old ``.metadata`` still there while the new shards are written), takes the highest
``step-N`` holding a ``.metadata`` file as the newest, and purges by listing ``step-N`` directories,
incomplete ones included. Here:

- ``save``: the same decision (``interval``, ``last_step``, ``enable_first_step_checkpoint``,
  ``load_only``); the model (torchtitan's ``ModelWrapper``, FSDP2 DTensors as they are), the
  ``OptimizersContainer``'s and the ``LRSchedulersContainer``'s own (flat, FQN-keyed) state dicts, the
  dataloader's and every other entry of ``states`` (e.g. ``train_state``) through their
  ``state_dict()`` are committed as step N (a step saved again, after a rollback, becomes a new version
  only once it is committed). ``keep_latest_k`` is ckptguard's ``keep_last``: old steps are retired only
  after the new one is committed. ``async_mode="async"``: ``save`` returns once the state is copied to
  host memory, writing and committing run in the background (``maybe_wait_for_saving()`` waits; the
  next save waits first). The last step's save is synchronous and, with ``last_save_model_only``
  (torchtitan's default), holds the model alone in ``export_dtype``.
- ``load(step=-1)``: the checkpoint committed last, falling back past one whose bytes do not verify
  (with a warning); a model-only checkpoint is not a resume point, so it is loaded (model only) only
  when no full one is committed (torchtitan's step-0 seed checkpoint). ``load(step=N)``: committed
  step N (model only if it was saved so, or N is 0). ``exclude_from_loading`` is honoured. With
  nothing committed, ``initial_load_path`` names a ckptguard root to start from
  (``initial_load_model_only``).

Refused at configuration, with the reason: HF safetensors (``last_save_in_hf``, ``initial_load_in_hf``;
``ckptguard export ROOT OUT --to safetensors`` writes a committed step as safetensors) and
``async_mode="async_with_pinned_mem"``. The folder holds ckptguard's layout, not ``step-N``
directories (``ckptguard export --to dcp`` writes one as a plain DCP directory).

Tested with torchtitan 0.3.0 (``requirements/torchtitan.txt``).
"""

from __future__ import annotations

import logging
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.stateful import Stateful

from ckptguard.integrations._extra import missing_extra

try:
    from torchtitan.components.checkpointer import (  # type: ignore[import-untyped]
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        BaseCheckpointManager,
        ModelWrapper,
    )
    from torchtitan.config import TORCH_DTYPE_MAP  # type: ignore[import-untyped]
    from torchtitan.tools import filesystem  # type: ignore[import-untyped]
except ImportError as e:  # the framework is an extra
    raise missing_extra("torchtitan", "torchtitan", e) from e


from ckptguard.checkpointer import Checkpointer
from ckptguard.discover import FRAMEWORK_KEY
from ckptguard.errors import CheckpointError, CorruptCheckpointError
from ckptguard.ranks import falls_back

log = logging.getLogger(__name__)

META_KEY = "torchtitan"  # the checkpoint's user metadata: {"torchtitan": {"model_only": bool}}
_MANAGED_OPTIONS = {"keep_last": "keep_latest_k", "read_only": "load_only", "root": "folder"}


class _Stateful:
    """An object's own ``state_dict()`` / ``load_state_dict()``, and nothing else: ckptguard would save a
    ``torch.optim.Optimizer`` (which ``OptimizersContainer`` is) through DCP's optimizer state dict
    instead of torchtitan's flat, FQN-keyed one that its loads and reshards expect."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = self.obj.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict)


class _Exported(_Stateful):
    """The model's state dict with floating-point tensors in the export dtype (a model-only last save)."""

    def __init__(self, model: Any, dtype: torch.dtype) -> None:
        super().__init__(model)
        self.dtype = dtype

    def state_dict(self) -> dict[str, Any]:
        return {
            k: v.to(self.dtype)
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != self.dtype
            else v
            for k, v in super().state_dict().items()
        }


def _refuse_unsupported(config: Any) -> None:
    if config.async_mode not in ("disabled", "async"):
        raise ValueError(
            f"CkptguardCheckpointManager: async_mode={config.async_mode!r} is not supported; use 'disabled' or "
            "'async' (ckptguard copies the state to host memory inside save(), then writes and commits in "
            "the background: there is no separate staging to wait for)"
        )
    if config.last_save_in_hf or config.initial_load_in_hf or config.initial_load_in_hf_quantized:
        raise ValueError(
            "CkptguardCheckpointManager does not read or write HF safetensors (last_save_in_hf, "
            "initial_load_in_hf): export a committed step with `ckptguard export ROOT OUT --to safetensors`, "
            "or use torchtitan's CheckpointManager for that"
        )
    for key, instead in _MANAGED_OPTIONS.items():
        if key in config.checkpointer_options:
            raise ValueError(f"checkpointer_options[{key!r}]: set checkpoint.{instead} instead")


class CkptguardCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]
    """A torchtitan checkpoint manager whose every save is one ckptguard commit.

    torchtitan's ``Trainer`` builds it from ``config.checkpoint`` and calls ``load()`` first (nothing is
    loaded on a fresh start), then ``save()`` every step; ``Config`` takes torchtitan's checkpoint options
    (``interval``, ``keep_latest_k``, ...) plus ``async_mode`` and ``checkpointer_options``. See the
    module's description above.

    Example:
        ```python
        config.checkpoint = CkptguardCheckpointManager.Config(enable=True, interval=500, keep_latest_k=3)
        ```
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        async_mode: Literal["disabled", "async"] = "disabled"
        """'async': save() returns once the state is in host memory; the commit runs in the background."""

        checkpointer_options: dict[str, Any] = field(default_factory=dict)
        """More keyword arguments for ``ckptguard.Checkpointer`` (io_threads, collective_timeout_s, ...)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            _refuse_unsupported(self)

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: Future[None] | None = None
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.async_mode = config.async_mode
        self.sd_adapter = sd_adapter
        # Collective: every rank builds the manager, as torchtitan's trainer does.
        self.checkpointer = Checkpointer(
            self.folder, keep_last=config.keep_latest_k or None, read_only=self.load_only, **config.checkpointer_options
        )
        log.info("ckptguard: torchtitan checkpoints are committed to and loaded from %s", self.folder)

    def __del__(self) -> None:
        self.close()

    # -- what is saved and loaded -------------------------------------------------------
    def _state(self, keys: list[str]) -> dict[str, Any]:
        """ckptguard's state for ``keys`` of ``states``: every Stateful through its own state dict (plain
        values as they are; a missing dataloader, None, left out)."""
        return {
            k: _Stateful(v) if isinstance(v, Stateful) else v for k in keys if (v := self.states.get(k)) is not None
        }

    def _full_state(self) -> dict[str, Any]:
        return self._state(list(self.states))

    def _state_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return self._state([MODEL])
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"{key} not found in state_dict.")
        return self._state([k for k in self.states if k not in self.exclude_from_loading])

    # -- BaseCheckpointManager ----------------------------------------------------------
    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()  # a failed background save surfaces here, before another starts
        model_only = last_step and self.last_save_model_only
        state = {MODEL: _Exported(self.states[MODEL], self.export_dtype)} if model_only else self._full_state()
        blocking = last_step or self.async_mode == "disabled"
        with torch.no_grad():
            self.checkpointer.save(
                curr_step,
                state,
                overwrite=curr_step in self.checkpointer.steps(),
                metadata={META_KEY: {"model_only": model_only}, FRAMEWORK_KEY: "torchtitan"},
                blocking=blocking,
            )
        self.save_future = None if blocking else self.checkpointer.pending_save()
        log.info(
            "ckptguard: %s step %d%s",
            "committed" if blocking else "saving",
            curr_step,
            " (model only)" if model_only else "",
        )
        return True

    def _wait_for_saving(self) -> None:
        self.save_future = None
        self.checkpointer.wait()

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: an async save copied the state to host memory before save() returned."""

    def _close(self) -> None:
        if hasattr(self, "checkpointer"):
            self.save_future = None
            self.checkpointer.close()

    def _load(self, step: int = -1) -> bool:
        ck = self.checkpointer
        model_only_steps = self._model_only_steps()
        if step != -1:
            self._load_step(step, step == 0 or step in model_only_steps)
            return True
        committed = list(reversed(ck.steps()))
        full = [s for s in committed if s not in model_only_steps and s != 0]
        errors: list[str] = []
        for s in full or committed:  # model-only ones only when nothing else is committed (a seed)
            try:
                self._load_step(s, s not in full)
                return True
            except CheckpointError as e:
                if not falls_back(e):  # agreed by every rank: they all take the same branch
                    raise
                errors.append(f"step {s}: {e}")
                if ck.topology.rank == 0:
                    warnings.warn(
                        f"ckptguard: torchtitan checkpoint step {s} in {ck.root} is corrupt ({e}); "
                        "falling back to the previous committed checkpoint",
                        stacklevel=2,
                    )
        if errors:
            raise CorruptCheckpointError(
                f"every committed checkpoint in {ck.root} is corrupt: " + "; ".join(errors), path=ck.root
            )
        return self._initial_load()

    def _load_step(self, step: int, model_only: bool) -> None:
        with torch.no_grad():
            self.checkpointer.load(self._state_to_load(model_only), step=step)
        log.info(
            "ckptguard: loaded step %d of %s%s", step, self.checkpointer.root, " (model only)" if model_only else ""
        )

    def _model_only_steps(self) -> set[int]:
        """The committed steps saved model-only, from their metadata (each read is agreed by every
        rank; an unreadable one is left to the load, which fails and falls back)."""
        found = set()
        for s in self.checkpointer.steps():
            try:
                if (self.checkpointer.metadata(s).get(META_KEY) or {}).get("model_only"):
                    found.add(s)
            except CheckpointError:
                continue
        return found

    def _initial_load(self) -> bool:
        """Nothing committed in the folder: start from ``initial_load_path`` (a ckptguard root), if set."""
        if not self.initial_load_path:
            log.info("ckptguard: no committed checkpoint in %s: a fresh start", self.folder)
            return False
        state = self._state_to_load(self.initial_load_model_only)
        with Checkpointer(self.initial_load_path, read_only=True) as source, torch.no_grad():
            got = source.load(state)
        if got is None:
            raise CheckpointError(
                f"initial_load_path {self.initial_load_path} holds no committed checkpoint", path=self.initial_load_path
            )
        log.info("ckptguard: started from step %d of %s", got, self.initial_load_path)
        return True
