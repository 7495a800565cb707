"""Lightning: a ``CheckpointIO`` plugin that commits every checkpoint through ckptguard.

    from ckptguard.integrations.lightning import CkptguardCheckpointIO
    trainer = L.Trainer(strategy="ddp", plugins=[CkptguardCheckpointIO()], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path="last")          # resumes only from a committed checkpoint

Lightning names checkpoints by path (``dirpath/epoch=0-step=10.ckpt``, ``last.ckpt``) and
calls ``save_checkpoint`` on global rank 0 only, so the plugin uses a rank-local
``Checkpointer`` (no collective). The data of every checkpoint of a directory lives in one
ckptguard root next to them (``dirpath/.ckptguard-lightning``), one committed step per save,
tagged with the file name; ``dirpath/<name>.ckpt`` itself is a small JSON pointer, replaced
atomically once its checkpoint is committed. So ``ModelCheckpoint``'s top-k, ``save_last``
and ``ckpt_path="last"`` see a checkpoint only once it is complete and durable, a crash in
the middle of a save leaves the previous one intact, and ``remove_checkpoint`` deletes the
pointer first, then the data (``Checkpointer.delete``). ``load_checkpoint`` reads without a
template (``Checkpointer.read``): the optimizer's integer parameter ids, tuples and numpy
values come back as they were saved. A path that holds an ordinary ``torch.save`` checkpoint
is read with ``torch.load(weights_only=True)``.

Tested with lightning 2.6.6 (``pip install 'ckptguard[lightning]'``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ckptguard.checkpointer import Checkpointer
from ckptguard.errors import CorruptCheckpointError
from ckptguard.storage.fileio import replace_file

ROOT_NAME = ".ckptguard-lightning"
POINTER_FORMAT = "ckptguard-lightning-pointer"
_TAG_OK = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=-]{0,127}$")


# -- the path <-> step mapping (shared by every hook that saves Lightning checkpoints) ---------------
def _tag_for(filename: str) -> str:
    if _TAG_OK.match(filename):
        return filename
    return "f-" + hashlib.sha256(filename.encode()).hexdigest()[:24]


def root_for(path: str, root_name: str = ROOT_NAME) -> str:
    """The ckptguard root that holds the data of checkpoint ``path`` (next to it)."""
    return os.path.join(os.path.dirname(os.path.abspath(path)), root_name)


def read_pointer(path: str) -> dict[str, Any] | None:
    """The pointer at ``path``, or None if ``path`` is not one (e.g. a torch.save file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except (IsADirectoryError, FileNotFoundError):
        return None
    if not head.startswith(b"{"):
        return None
    try:
        body = json.loads(head)
    except ValueError:
        return None
    return body if isinstance(body, dict) and body.get("format") == POINTER_FORMAT else None


def pointer_at(path: str, *, follow: bool = True) -> dict[str, Any] | None:
    """The pointer at ``path``, if it is a file holding one. ``follow=False``: not through a symlink
    (``save_last="link"`` makes one; removing the link must not delete the data it links to)."""
    if not os.path.isfile(path) or (not follow and os.path.islink(path)):
        return None
    return read_pointer(path)


def pointed(path: str, pointer: Mapping[str, Any]) -> tuple[str, str, int]:
    """(root, tag, step) that the pointer at ``path`` names."""
    root = os.path.normpath(os.path.join(os.path.dirname(path), pointer["root"]))
    return root, str(pointer["tag"]), int(pointer["step"])


def commit(ck: Checkpointer, path: str, state: Mapping[str, Any], *, publish: bool) -> int:
    """Save ``state`` as the next step of ``ck``, tag it with the file name, then (``publish``: the
    process that writes) point ``path`` at it; the step the tag named before is deleted last.
    Collective exactly when ``ck`` is. Returns the step."""
    name = os.path.basename(path)
    tag = _tag_for(name)
    step = max(ck.steps(), default=-1) + 1
    ck.save(step, state)
    before = ck.tag(tag, step)
    if publish:
        pointer = {"format": POINTER_FORMAT, "root": os.path.relpath(ck.root, os.path.dirname(path)), "tag": tag,
                   "step": step, "name": name}
        # The commit point Lightning sees: the pointer appears or changes atomically, once the
        # checkpoint is committed.
        replace_file(path, (json.dumps(pointer) + "\n").encode())
    if before is not None and before != step:
        _drop_if_untagged(ck, before)
    return step


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


class CkptguardCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` through ckptguard (see the module docstring).

    ``root_name``: the name of the ckptguard root inside each checkpoint directory.
    Other keyword arguments go to the ``Checkpointer`` that writes.
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
            commit(self._writer(root_for(path, self.root_name)), path, checkpoint, publish=True)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
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
        root, _, step = pointed(path, pointer)
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
        with self._lock:
            os.unlink(path)  # gone for Lightning first; the data follows
            forget(self._writer(pointed(path, pointer)[0]), pointer)

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
