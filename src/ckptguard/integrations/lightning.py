"""Lightning: every checkpoint committed through ckptguard, whole (``CheckpointIO``) or sharded (FSDP2).

    from ckptguard.integrations.lightning import CkptguardCheckpointIO, CkptguardModelParallelStrategy
    trainer = L.Trainer(strategy="ddp", plugins=[CkptguardCheckpointIO()], callbacks=[ModelCheckpoint(...)])
    trainer = L.Trainer(strategy=CkptguardModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), ...)
    trainer.fit(model, ckpt_path="last")          # resumes only from a committed checkpoint

Lightning names checkpoints by path (``dirpath/epoch=0-step=10.ckpt``, ``last.ckpt``). Both hooks
keep the data of every checkpoint of a directory in one ckptguard root next to them
(``dirpath/.ckptguard-lightning``), one committed step per save, tagged with the file name;
``dirpath/<name>.ckpt`` itself is a small JSON pointer, replaced atomically once its checkpoint is
committed. So ``ModelCheckpoint``'s top-k, ``save_last`` and ``ckpt_path="last"`` see a checkpoint
only once it is complete and durable, a crash in the middle of a save leaves the previous one
intact, and removing a checkpoint deletes the pointer first, then the data. A path that holds an
ordinary Lightning checkpoint still loads (a ``torch.save`` file through the plugin, a sharded
directory through the strategy).

A pointer is bound to its checkpoint: the root's identity (``.ckptguard/root-id``), the step,
its commit sequence number and the checksum of its manifest. A pointer whose binding does not match
(copied from another run, or its step replaced since) is refused, and removing it deletes no data; a
pointer whose root is not a directory next to it is refused. A pointer an older ckptguard wrote (no
binding) loads with a warning, and removing it deletes only in the root next to it.

``CkptguardCheckpointIO``: Lightning calls ``save_checkpoint`` on global rank 0 only, so the plugin
uses a rank-local ``Checkpointer`` (no collective). ``load_checkpoint`` reads without a template
(``Checkpointer.read``): the optimizer's integer parameter ids, tuples and numpy values come back as
they were saved. A ``torch.save`` file is read with ``torch.load(weights_only=True)``.

``CkptguardModelParallelStrategy``: Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel,
DTensor state) writes sharded checkpoints itself with DCP and never calls ``CheckpointIO`` for them.
The subclass commits them through one collective ``Checkpointer``: every rank saves its shards,
rank 0's copy of the rest (loops, callbacks, hyper-parameters: what Lightning puts in ``meta.pt``),
and loads them back into the sharded modules and optimizers, resharding if the mesh changed.

Tested with lightning 2.6.6 (from a clone: ``pip install -e '.[lightning]'``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from ckptguard.integrations._extra import missing_extra

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.strategies import ModelParallelStrategy
except ImportError as e:  # the framework is an extra
    raise missing_extra("lightning", "lightning", e) from e

from ckptguard.checkpointer import Checkpointer
from ckptguard.errors import CheckpointError, CorruptCheckpointError
from ckptguard.integrations._lightning_pointer import (
    POINTER_FORMAT,
    POINTER_MAX_BYTES,
    ROOT_NAME,
    SHARDED,
    Pointer,
    check_binding,
    commit,
    forget,
    framework_metadata,
    may_delete,
    pointed,
    pointer_at,
    read_pointer,
    root_for,
    root_identity,
    unlink_pointer,
)
from ckptguard.ranks import one_rank_acts

__all__ = [
    "POINTER_FORMAT",
    "POINTER_MAX_BYTES",
    "ROOT_NAME",
    "SHARDED",
    "CkptguardCheckpointIO",
    "CkptguardModelParallelStrategy",
    "Pointer",
    "check_binding",
    "commit",
    "forget",
    "framework_metadata",
    "pointed",
    "pointer_at",
    "read_pointer",
    "root_for",
    "root_identity",
]

log = logging.getLogger("ckptguard")


# -- CheckpointIO: whole checkpoints, saved by rank 0 ---------------------------------------------
class CkptguardCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` through ckptguard: every ``.ckpt`` committed before Lightning sees it.

    For strategies that save whole checkpoints from rank 0 (DDP, single device). See the module's
    description above.

    Example:
        ```python
        trainer = L.Trainer(strategy="ddp", plugins=[CkptguardCheckpointIO()],
                            callbacks=[ModelCheckpoint(save_last=True)])
        trainer.fit(model, ckpt_path="last")
        ```

    Args:
        root_name: The name of the ckptguard root inside each checkpoint directory.
        **checkpointer_kwargs: Keyword arguments for the ``Checkpointer`` that writes.
    """

    def __init__(self, root_name: str = ROOT_NAME, **checkpointer_kwargs: Any) -> None:
        super().__init__()
        self.root_name = root_name
        self.checkpointer_kwargs = checkpointer_kwargs
        self._writers: dict[str, Checkpointer] = {}
        self._lock = threading.Lock()

    def _writer(self, root: str) -> Checkpointer:
        ck = self._writers.get(root)
        if ck is None:
            ck = self._writers[root] = Checkpointer(root, process_group="local", **self.checkpointer_kwargs)
        return ck

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        path = os.path.abspath(os.fspath(path))
        with self._lock:
            commit(self._writer(root_for(path, self.root_name)), path, checkpoint)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = os.path.abspath(os.fspath(path))
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        pointer = pointer_at(path)
        if pointer is None:
            if os.path.isdir(path):  # a ckptguard root given directly
                return self._read(path, None, map_location)
            import torch

            loaded: dict[str, Any] = torch.load(path, map_location=map_location or "cpu", weights_only=True)
            return loaded
        if pointer.get("layout") == SHARDED:
            raise CheckpointError(
                f"{path} is a sharded checkpoint of CkptguardModelParallelStrategy: load it with that strategy",
                path=path,
            )
        root, _, step = pointed(path, pointer)
        check_binding(path, pointer, root, step)
        # The pointer's step, even where its tag has moved on: a save that died between moving the tag
        # and replacing the pointer did not commit for Lightning.
        return self._read(root, step, map_location)

    def _read(self, root: str, step: int | None, map_location: Any) -> dict[str, Any]:
        with Checkpointer(root, process_group="local", read_only=True) as ck:
            state = ck.read(step=step)
            if state is None:
                raise CorruptCheckpointError(f"{root} holds no committed checkpoint", path=root)
        if map_location not in (None, "cpu"):
            import torch

            state = _move(state, lambda t: t.to(map_location) if isinstance(t, torch.Tensor) else t)
        return state

    def remove_checkpoint(self, path: Any) -> None:
        path = os.path.abspath(os.fspath(path))
        pointer = pointer_at(path, follow=False)
        if pointer is None:
            if os.path.isfile(path) or os.path.islink(path):
                os.unlink(path)
            return
        own = root_for(path, self.root_name)
        with self._lock:
            try:
                root, _, step = pointed(path, pointer)
            except CheckpointError as e:  # names no checkpoint of its own root: the file goes, no data
                log.warning("ckptguard: removing %s without deleting any checkpoint: %s", path, e)
                os.unlink(path)
                return
            delete = may_delete(path, pointer, root, step, own)
            ck = self._writer(own)
            unlink_pointer(ck, path)  # gone for Lightning first; the data follows
            if delete:
                forget(ck, pointer)

    def teardown(self) -> None:
        with self._lock:
            writers, self._writers = self._writers, {}
        for ck in writers.values():
            ck.close()


def _move(obj: Any, fn: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _move(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_move(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_move(v, fn) for v in obj)
    return fn(obj)


# -- ModelParallelStrategy: sharded checkpoints, saved by every rank ------------------------------
_SHARDED_KEYS = ("state_dict", "optimizer_states")


class CkptguardModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose sharded (FSDP2, tensor-parallel) saves are committed through ckptguard.

    Saving, loading and removing a checkpoint are collective, as Lightning makes them: ``Trainer``
    and ``ModelCheckpoint`` call them on every rank (the path is rank 0's).

    Example:
        ```python
        trainer = L.Trainer(strategy=CkptguardModelParallelStrategy(), callbacks=[ModelCheckpoint(...)])
        ```

    Args:
        *args: As for ``ModelParallelStrategy``.
        root_name: As for ``CkptguardCheckpointIO``.
        checkpointer_kwargs: Keyword arguments for the collective ``Checkpointer``.
        **kwargs: As for ``ModelParallelStrategy``.

    Raises:
        ValueError: ``save_distributed_checkpoint=False`` (a full checkpoint gathered on rank 0, which
            Lightning then loads with ``torch.load`` itself).
    """

    def __init__(
        self,
        *args: Any,
        root_name: str = ROOT_NAME,
        checkpointer_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not self._save_distributed_checkpoint:
            raise ValueError(
                f"{type(self).__name__} commits sharded checkpoints: save_distributed_checkpoint=False "
                "would write a full one past it (use ModelParallelStrategy for that)"
            )
        self.root_name = root_name
        self.checkpointer_kwargs = dict(checkpointer_kwargs or {})
        self._writers: dict[str, Checkpointer] = {}

    def _writer(self, root: str) -> Checkpointer:
        ck = self._writers.get(root)
        if ck is None:  # collective: every rank opens it, in the same save, load or remove
            ck = self._writers[root] = Checkpointer(root, **self.checkpointer_kwargs)
        return ck

    def _rank0_view(self, filepath: Any, *, follow: bool = True) -> tuple[str, dict[str, Any] | None]:
        """Rank 0's absolute path and the pointer it finds there (``pointer_at``), on every rank."""

        def look() -> tuple[str, dict[str, Any] | None]:
            path = os.path.abspath(os.fspath(filepath))
            return path, pointer_at(path, follow=follow)

        return one_rank_acts(f"read the checkpoint pointer {filepath}", look)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        rest = {k: v for k, v in checkpoint.items() if k not in _SHARDED_KEYS}
        # One copy of the unsharded rest, rank 0's (Lightning's meta.pt is rank 0's too): a value that
        # differs between ranks (a callback's own state) is not refused as diverging.
        path, meta = one_rank_acts(f"save {filepath}", lambda: (os.path.abspath(os.fspath(filepath)), rest))
        state: dict[str, Any] = {"state_dict": checkpoint["state_dict"], "meta": meta}
        for i, optim_state in enumerate(checkpoint.get("optimizer_states", [])):
            state[f"optimizer_{i}"] = optim_state
        ck = self._writer(root_for(path, self.root_name))
        commit(ck, path, state, collective=True, layout=SHARDED)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path, pointer = self._rank0_view(checkpoint_path)
        if pointer is None:  # Lightning's own (a sharded directory or a full file)
            loaded: dict[str, Any] = super().load_checkpoint(path, weights_only)
            return loaded
        if pointer.get("layout") != SHARDED:
            raise CheckpointError(
                f"{path} is a whole checkpoint of CkptguardCheckpointIO, not a sharded one", path=path
            )
        root, _, step = pointed(path, pointer)  # the pointer's step, as CkptguardCheckpointIO loads
        one_rank_acts(
            f"check the checkpoint pointer {path}", lambda: check_binding(path, pointer, root, step), where=path
        )
        ck = self._writers.get(root)
        own = ck is None
        if ck is None:
            ck = Checkpointer(root, read_only=True)
        try:
            stored = ck.read(step, keys=("meta",))
            if stored is None or "meta" not in stored:
                raise CorruptCheckpointError(f"step {step} of {root} holds no Lightning checkpoint", path=root)
            assert self.lightning_module is not None
            into: dict[str, Any] = {"state_dict": self.model}
            into.update({f"optimizer_{i}": optim for i, optim in enumerate(self.optimizers)})
            ck.load(into, step=step, strict=self.lightning_module.strict_loading)
        finally:
            if own:
                ck.close()
        meta: dict[str, Any] = stored["meta"]
        return meta

    def remove_checkpoint(self, filepath: Any) -> None:
        path, pointer = self._rank0_view(filepath, follow=False)
        if pointer is None:
            super().remove_checkpoint(path)
            return
        own = root_for(path, self.root_name)
        try:
            root, _, step = pointed(path, pointer)
        except CheckpointError as e:  # names no checkpoint of its own root: the file goes, no data
            log.warning("ckptguard: removing %s without deleting any checkpoint: %s", path, e)
            one_rank_acts(f"remove the checkpoint pointer {path}", lambda: os.unlink(path), where=path)
            return
        delete = one_rank_acts(
            f"check the checkpoint pointer {path}", lambda: may_delete(path, pointer, root, step, own), where=path
        )
        ck = self._writer(own)
        # Gone for Lightning first (rank 0, under the lease; every rank learns its failure); the data follows.
        one_rank_acts(f"remove the checkpoint pointer {path}", lambda: unlink_pointer(ck, path), where=path)
        if delete:
            forget(ck, pointer)

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            writers, self._writers = self._writers, {}
            for ck in writers.values():
                ck.close()
