"""Find the ckptguard root(s) inside the directories users have.

The integrations keep their committed checkpoints in a hidden root next to the framework's own
files (``output_dir/.ckptguard-hf``, ``dirpath/.ckptguard-lightning``, ...). A user points tools at
the directory they know (a Trainer ``output_dir``, a Lightning ``dirpath``, an Accelerate
``project_dir``, a DeepSpeed save directory, a torchtitan dump folder); :func:`find_roots` turns
that into the roots to read, each with the framework that wrote it, so that ``ckptguard ls`` and
``verify`` never report "no checkpoint" for a directory full of them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptguard.errors import CheckpointError
from ckptguard.frameworks import BY_ROOT_NAME, FRAMEWORK_KEY, FRAMEWORKS, root_name

__all__ = [
    "ACCELERATE_ROOT",
    "DEEPSPEED_ROOT",
    "FRAMEWORK_KEY",
    "FRAMEWORK_ROOTS",
    "HF_ROOT",
    "LIGHTNING_ROOT",
    "FoundRoot",
    "find_roots",
]
from ckptguard.protocol import layout
from ckptguard.storage import StorageBackend, open_storage

# The hidden root each integration keeps its committed checkpoints in -> the framework's name
# (from the registry, ``ckptguard.frameworks``; the integrations import these names).
FRAMEWORK_ROOTS: Mapping[str, str] = {name: f.name for name, f in BY_ROOT_NAME.items()}
HF_ROOT, LIGHTNING_ROOT, ACCELERATE_ROOT, DEEPSPEED_ROOT = (
    root_name(n) for n in ("transformers", "lightning", "accelerate", "deepspeed")
)
_SEARCH_DEPTH = 2  # the given directory's children and grandchildren (a directory of runs)


@dataclass(frozen=True)
class FoundRoot:
    """A ckptguard root: where it is, and which integration wrote it (None: the plain API, or unknown)."""

    path: str
    framework: str | None


def find_roots(
    path: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    unreadable: list[str] | None = None,
    strays: list[str] | None = None,
) -> list[FoundRoot]:
    """The ckptguard roots at or under ``path``, in path order; ``[]`` if there is none.

    ``path`` itself if it is a root; otherwise every root found in it and in its subdirectories
    (two levels; on object stores one, each level costs a listing), not looking inside a root. For a
    directory a framework names beside its hidden root (``Framework.beside``: Accelerate's automatic
    ``project_dir/checkpoints``), the hidden root beside it. A subdirectory that cannot be read (a mode
    000 ``lost+found`` beside the runs) is skipped: one such directory must not hide the roots beside it.
    A ``.ckptguard`` that is not a directory (a file, a FIFO, a link) makes no root and is never opened.

    Args:
        path: A POSIX path or a URL of a registered storage scheme.
        storage_options: Passed to the storage backend (credentials, endpoint).
        unreadable: If given, the subdirectories skipped for lack of permission are appended to it.
        strays: If given, the control entries that are not directories are appended to it.

    Returns:
        Every root found, each with the framework that wrote it (None: the plain API, or unknown).

    Raises:
        CheckpointError: ``path`` cannot be read (a usage error: not a directory, an unsupported URL,
            a missing bucket).
    """
    text = os.fspath(path)
    storage = open_storage(text, storage_options)
    if not storage.is_dir(storage.root):
        raise CheckpointError(f"{text} is not a directory", path=text)
    found: list[FoundRoot] = []
    strays = [] if strays is None else strays
    if _is_root(storage, storage.root, strays):
        return [FoundRoot(storage.root, _framework_of(storage, storage.root, storage_options))]
    depth = _SEARCH_DEPTH if storage.cheap_listing else 1
    _search(storage, storage.root, depth, found, storage_options, [] if unreadable is None else unreadable, strays)
    if not found:
        name = os.path.basename(os.path.normpath(storage.root))
        for framework in FRAMEWORKS:
            if framework.beside == name and framework.root_name is not None:
                beside = storage.join(storage.parent(storage.root), framework.root_name)
                if _is_root(storage, beside, strays):
                    found.append(FoundRoot(beside, framework.name))
    return found


def _search(
    storage: StorageBackend,
    directory: str,
    depth: int,
    found: list[FoundRoot],
    options: Mapping[str, Any] | None,
    unreadable: list[str],
    strays: list[str],
) -> None:
    for name in sorted(storage.listdir(directory)):
        child = storage.join(directory, name)
        try:
            _visit(storage, child, name, depth, found, options, unreadable, strays)
        except PermissionError:
            unreadable.append(child)


def _visit(
    storage: StorageBackend,
    child: str,
    name: str,
    depth: int,
    found: list[FoundRoot],
    options: Mapping[str, Any] | None,
    unreadable: list[str],
    strays: list[str],
) -> None:
    if not storage.is_dir(child):
        return
    if name in FRAMEWORK_ROOTS:
        if _is_root(storage, child, strays):
            found.append(FoundRoot(child, FRAMEWORK_ROOTS[name]))
        return
    if name.startswith("."):  # staging directories, .git, caches: never a user's run
        return
    if _is_root(storage, child, strays):
        found.append(FoundRoot(child, _framework_of(storage, child, options)))
    elif depth > 1:
        _search(storage, child, depth - 1, found, options, unreadable, strays)


def _is_root(storage: StorageBackend, directory: str, strays: list[str]) -> bool:
    """A root has its control directory (made when a Checkpointer first opens it for writing) or a
    committed checkpoint; a framework's own ``latest`` file (DeepSpeed's) is not enough. The control
    entry counts only as a real directory (lstat: a FIFO is never opened, a link never followed)."""
    names = storage.listdir(directory)
    if any(layout.CheckpointName.parse(n) is not None for n in names):
        return True
    if layout.CONTROL not in names:
        return False
    control = storage.join(directory, layout.CONTROL)
    if not storage.is_dir(control, follow_links=False):
        strays.append(control)
        return False
    return True


def _framework_of(storage: StorageBackend, directory: str, options: Mapping[str, Any] | None) -> str | None:
    """The framework named in the metadata of the root's newest checkpoint (torchtitan's folder)."""
    from ckptguard.protocol.root import open_root

    with contextlib.suppress(CheckpointError, OSError, ValueError):
        root = open_root(storage if directory == storage.root else open_storage(directory, options))
        current = root.current()
        if not current:
            return None
        meta = root.read_manifest(current[max(current)]).user_metadata or {}
        named = meta.get(FRAMEWORK_KEY)
        if isinstance(named, str):
            return named
    return None
