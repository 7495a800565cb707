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

import hashlib
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from ckptguard.integrations._extra import missing_extra

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.strategies import ModelParallelStrategy
except ImportError as e:  # the framework is an extra
    raise missing_extra("lightning", "lightning", e) from e


from ckptguard.checkpointer import Checkpointer
from ckptguard.discover import FRAMEWORK_KEY, LIGHTNING_ROOT
from ckptguard.errors import CheckpointError, CorruptCheckpointError, StepNotFoundError
from ckptguard.files import decode_record, fsync_dir, replace_file
from ckptguard.ranks import one_rank_acts
from ckptguard.verify import read_root_id, step_binding

log = logging.getLogger("ckptguard")

ROOT_NAME = LIGHTNING_ROOT
POINTER_FORMAT = "ckptguard-lightning-pointer"
SHARDED = "sharded"  # the pointer's "layout" for the strategy's checkpoints
_TAG_OK = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=-]{0,127}$")


# -- the path <-> step mapping both hooks share --------------------------------------------------
def _tag_for(filename: str) -> str:
    if _TAG_OK.match(filename):
        return filename
    return "f-" + hashlib.sha256(filename.encode()).hexdigest()[:24]


def root_for(path: str, root_name: str = ROOT_NAME) -> str:
    """The ckptguard root that holds the data of checkpoint ``path`` (next to it)."""
    return os.path.join(os.path.dirname(os.path.abspath(path)), root_name)


#: A pointer is one line of a few short fields; a file bigger than this is not one.
POINTER_MAX_BYTES = 4096


class _Format(msgspec.Struct, frozen=True):
    """Only the ``format`` field: whether a JSON file is a pointer at all."""

    format: str = ""


class Pointer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """``dirpath/<name>.ckpt``: which step of which root holds the checkpoint of that name."""

    format: str
    root: str
    tag: str
    step: Annotated[int, msgspec.Meta(ge=0)]
    name: str
    layout: str | None = None
    #: The binding (absent in pointers of older versions): the root's identity, the commit sequence
    #: number of the step, and the SHA-256 of its manifest's bytes.
    root_id: str | None = None
    seq: Annotated[int, msgspec.Meta(ge=0)] | None = None
    manifest: str | None = None


def read_pointer(path: str) -> dict[str, Any] | None:
    """The pointer at ``path``, or None if ``path`` is not one (e.g. a torch.save file, or JSON of another
    format). A file of the pointer's format with a field missing or of the wrong type raises
    MalformedRecordError naming the file and the field."""
    try:
        with open(path, "rb") as f:
            head = f.read(POINTER_MAX_BYTES + 1)
    except (IsADirectoryError, FileNotFoundError):
        return None
    if not head.startswith(b"{"):
        return None
    try:
        kind = decode_record(head, _Format, path, max_bytes=POINTER_MAX_BYTES)
    except CheckpointError:  # not JSON, or too big or too deep for a pointer
        return None
    if kind.format != POINTER_FORMAT:
        return None
    pointer = decode_record(head, Pointer, path, max_bytes=POINTER_MAX_BYTES)
    return {k: v for k, v in msgspec.structs.asdict(pointer).items() if v is not None}


def pointer_at(path: str, *, follow: bool = True) -> dict[str, Any] | None:
    """The pointer at ``path``, if it is a file holding one. ``follow=False``: not through a symlink
    (``save_last="link"`` makes one; removing the link must not delete the data it links to)."""
    if not os.path.isfile(path) or (not follow and os.path.islink(path)):
        return None
    return read_pointer(path)


def pointed(path: str, pointer: Mapping[str, Any]) -> tuple[str, str, int]:
    """(root, tag, step) that the pointer at ``path`` names; CorruptCheckpointError naming the field
    where the file holds something no save wrote there. The root is always a directory next to the
    pointer (a save writes its bare name): one that leads anywhere else is refused."""
    root, tag, step = pointer.get("root"), pointer.get("tag"), pointer.get("step")
    for field, ok in (
        ("root", isinstance(root, str) and _beside(root)),
        ("tag", isinstance(tag, str)),
        ("step", type(step) is int and step >= 0),
    ):
        if not ok:
            raise CorruptCheckpointError(
                f"{path}: the checkpoint pointer's {field!r} is "
                f"{str(pointer.get(field))[:100]!r}, not what a save writes there: "
                "the file was modified by hand or by another tool",
                path=path,
            )
    assert isinstance(root, str) and isinstance(tag, str) and isinstance(step, int)
    return os.path.normpath(os.path.join(os.path.dirname(path), root)), tag, step


def _beside(root: str) -> bool:
    """Whether a pointer's ``root`` names a directory next to the pointer (one bare name)."""
    return root not in ("", ".", "..") and "/" not in root and os.sep not in root and "\0" not in root


def _read_root_id(root: str) -> str | None:
    """The root's identity, or None if it has none yet; CorruptCheckpointError if the record is damaged."""
    return read_root_id(root)


def root_identity(ck: Checkpointer) -> str:
    """The stable identity of ``ck``'s root, created once if it has none (``Checkpointer.root_id``)."""
    return ck.root_id()


def _binding(root: str, step: int) -> tuple[int | None, str]:
    """(commit sequence number, SHA-256 of the manifest's bytes) of committed ``step`` of ``root``."""
    return step_binding(root, step)


def check_binding(path: str, pointer: Mapping[str, Any], root: str, step: int) -> bool:
    """Whether the pointer at ``path`` is bound to step ``step`` of ``root`` as it is now: True when it is;
    False (with a warning) for a pointer an older version wrote, which has no binding.

    Raises:
        CorruptCheckpointError: the pointer is bound to another root (a pointer copied from another run)
            or to another checkpoint of this step (the step was deleted and saved again since).
    """
    if pointer.get("root_id") is None or pointer.get("manifest") is None:
        log.warning(
            "ckptguard: %s was written by an older ckptguard: it is not bound to its checkpoint, so "
            "step %d of %s is loaded unchecked (the next save of %s binds it)",
            path,
            step,
            root,
            os.path.basename(path),
        )
        return False
    ident = _read_root_id(root)
    if ident != pointer["root_id"]:
        raise CorruptCheckpointError(
            f"{path} points to a checkpoint of another root (root identity {pointer['root_id']}, but {root} is "
            f"{ident or 'one without an identity'}): a pointer copied from another run is not this run's "
            "checkpoint. Load the other run's pointer in its own directory, or remove this file.",
            path=path,
        )
    try:
        seq, digest = _binding(root, step)
    except StepNotFoundError:
        seq, digest = None, ""
    if digest != pointer["manifest"] or (pointer.get("seq") is not None and seq != pointer["seq"]):
        raise CorruptCheckpointError(
            f"{path} names step {step} of {root}, but that step is now another checkpoint than the one this "
            "pointer was written for (deleted and saved again, or the pointer was copied from another run): "
            "refused. Resume from another checkpoint, or remove this file.",
            path=path,
        )
    return True


def _may_delete(path: str, pointer: Mapping[str, Any], root: str, step: int, own_root: str) -> bool:
    """Whether removing the pointer at ``path`` may delete the data it names: only its own checkpoint, and
    only in the root next to it."""
    if os.path.normpath(root) != os.path.normpath(own_root):
        return False
    try:
        check_binding(path, pointer, root, step)  # bound and matching, or older and unbound: its own root
        return True
    except CheckpointError as e:
        log.warning("ckptguard: removed %s without deleting any checkpoint: %s", path, e)
        return False


def commit(
    ck: Checkpointer, path: str, state: Mapping[str, Any], *, collective: bool = False, layout: str | None = None
) -> int:
    """Save ``state`` as the next step of ``ck``, tag it with the file name, then point ``path`` at it
    (``collective``: rank 0 does, and every rank learns its failure); the step the tag named before is
    deleted last. Collective exactly when ``ck`` is. Returns the step."""
    name = os.path.basename(path)
    tag = _tag_for(name)
    step = max(ck.steps(), default=-1) + 1
    ck.save(step, state, metadata=framework_metadata(name, state))
    before = ck.tag(tag, step)
    if collective:
        ident, (seq, digest) = one_rank_acts(
            f"bind the checkpoint pointer {path}", lambda: (root_identity(ck), _binding(ck.root, step)), where=path
        )
    else:
        ident, (seq, digest) = root_identity(ck), _binding(ck.root, step)
    pointer = Pointer(
        format=POINTER_FORMAT,
        root=os.path.relpath(ck.root, os.path.dirname(path)),
        tag=tag,
        step=step,
        name=name,
        layout=layout,
        root_id=ident,
        seq=seq,
        manifest=digest,
    )
    # The commit point Lightning sees: the pointer appears or changes atomically, once the
    # checkpoint is committed.
    data = msgspec.json.encode(pointer) + b"\n"
    if collective:
        one_rank_acts(f"publish the checkpoint pointer {path}", lambda: _publish(ck, path, data), where=path)
    else:
        _publish(ck, path, data)
    if before is not None and before != step:
        _drop_if_untagged(ck, before)
    return step


def framework_metadata(name: str, state: Mapping[str, Any]) -> dict[str, Any]:
    """What ``ckptguard ls`` shows for a step: Lightning's own counters (the ckptguard step is a
    sequence number: several files, ``last.ckpt`` and a top-k one, are saved at one global step)."""
    meta: dict[str, Any] = {FRAMEWORK_KEY: "lightning", "file": name}
    nested = state.get("meta")  # the strategy's layout keeps Lightning's counters under "meta"
    counters: Mapping[str, Any] = nested if isinstance(nested, Mapping) else state
    for key in ("global_step", "epoch"):
        value = counters.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            meta[key] = value
    return meta


def _publish(ck: Checkpointer, path: str, data: bytes) -> None:
    # Replacing what a reader sees at ``path``: only while this job holds the root (a job that lost it
    # would overwrite the new holder's pointer).
    ck.check_lease(f"replace the checkpoint pointer {path}")
    if os.path.isdir(path) and not os.path.islink(path):
        # A sharded checkpoint Lightning wrote itself under this name (a run that switched to ckptguard):
        # out of the way by one rename, so that the path never names a half-deleted directory. A crash
        # before the pointer lands leaves no checkpoint under this name, and the old one aside.
        aside = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.replaced-{uuid.uuid4().hex[:8]}")
        os.rename(path, aside)
        fsync_dir(os.path.dirname(path))
        replace_file(path, data)
        shutil.rmtree(aside, ignore_errors=True)
        return
    replace_file(path, data)


def _unlink_pointer(ck: Checkpointer, path: str) -> None:
    """Remove the pointer at ``path``, only while ``ck`` holds the root's lease: a job that lost the root
    to another job must not delete a checkpoint the new holder published under that name."""
    ck.check_lease(f"remove the checkpoint pointer {path}")
    os.unlink(path)


def forget(ck: Checkpointer, pointer: Mapping[str, Any]) -> None:
    """After the pointer is unlinked: untag its step and delete it (unless another tag names it).
    Collective exactly when ``ck`` is."""
    tags = ck.tags(refresh=True)
    step = int(pointer["step"])
    if tags.get(pointer["tag"]) == step:
        ck.untag(pointer["tag"])
    _drop_if_untagged(ck, step)


def _drop_if_untagged(ck: Checkpointer, step: int) -> None:
    if step in ck.steps() and step not in ck.tags().values():
        ck.delete(step)


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
            delete = _may_delete(path, pointer, root, step, own)
            ck = self._writer(own)
            _unlink_pointer(ck, path)  # gone for Lightning first; the data follows
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
            f"check the checkpoint pointer {path}", lambda: _may_delete(path, pointer, root, step, own), where=path
        )
        ck = self._writer(own)
        # Gone for Lightning first (rank 0, under the lease; every rank learns its failure); the data follows.
        one_rank_acts(f"remove the checkpoint pointer {path}", lambda: _unlink_pointer(ck, path), where=path)
        if delete:
            forget(ck, pointer)

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            writers, self._writers = self._writers, {}
            for ck in writers.values():
                ck.close()
