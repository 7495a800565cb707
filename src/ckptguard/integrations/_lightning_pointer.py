"""Lightning's checkpoint pointer files: ``dirpath/<name>.ckpt`` naming a committed step of the root next to it.

The commit point Lightning sees: a pointer appears or changes atomically once its checkpoint is
committed. A pointer is bound to its checkpoint (the root's identity, the step, its commit sequence
number and its manifest's checksum), and removing one deletes the data only in the root next to it.
Both hooks of ``integrations.lightning`` (the ``CheckpointIO`` and the strategy) commit, read and
remove checkpoints through this module; it needs no Lightning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from ckptguard.checkpointer import Checkpointer
from ckptguard.discover import FRAMEWORK_KEY, LIGHTNING_ROOT
from ckptguard.errors import CheckpointError, CorruptCheckpointError, StepNotFoundError
from ckptguard.files import decode_record, fsync_dir, replace_file
from ckptguard.ranks import one_rank_acts
from ckptguard.verify import is_plain_name, read_root_id, step_binding

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
    return is_plain_name(root) and os.sep not in root


def root_identity(ck: Checkpointer) -> str:
    """The stable identity of ``ck``'s root, created once if it has none (``Checkpointer.root_id``)."""
    return ck.root_id()


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
    ident = read_root_id(root)
    if ident != pointer["root_id"]:
        raise CorruptCheckpointError(
            f"{path} points to a checkpoint of another root (root identity {pointer['root_id']}, but {root} is "
            f"{ident or 'one without an identity'}): a pointer copied from another run is not this run's "
            "checkpoint. Load the other run's pointer in its own directory, or remove this file.",
            path=path,
        )
    try:
        seq, digest = step_binding(root, step)
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


def may_delete(path: str, pointer: Mapping[str, Any], root: str, step: int, own_root: str) -> bool:
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
            f"bind the checkpoint pointer {path}", lambda: (root_identity(ck), step_binding(ck.root, step)), where=path
        )
    else:
        ident, (seq, digest) = root_identity(ck), step_binding(ck.root, step)
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


def unlink_pointer(ck: Checkpointer, path: str) -> None:
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
