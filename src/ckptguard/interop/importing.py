"""Other checkpoints into ckptguard: a DCP directory or a ``torch.save`` file (:func:`import_checkpoint`).

DCP's ``.metadata`` is a pickle: it is read with an unpickler that admits DCP's metadata classes and
nothing else, so no code from the file runs, and everything it names is checked before anything is
opened by path or allocated. Objects are loaded with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import math
import os
import pickle
import stat
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from ckptguard.dcp.codec import check_depth, load_bounded
from ckptguard.dcp.records import MAX_VALUE_DEPTH, covers_once
from ckptguard.errors import (
    CheckpointError,
    CorruptCheckpointError,
    UnsafeObjectError,
    from_os_error,
)
from ckptguard.interop.reader import read_all
from ckptguard.protocol.layout import is_plain_name
from ckptguard.storage import local_path
from ckptguard.storage.fileio import open_regular

_DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"WriteItemType", "LoadItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes (and torch dtypes, Size, layouts), nothing else: no code runs."""

    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(io.BytesIO(data))
        self.path = path  # named in the refusal

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _DCP_METADATA_CLASSES.get(module, ()):
            return getattr(importlib.import_module(module), name)
        raise UnsafeObjectError(
            f"{self.path} refers to {module}.{name}, which is not one of DCP's metadata "
            "classes: refusing to unpickle it (it could run code)",
            path=self.path,
        )


def read_dcp_metadata(directory: str | os.PathLike[str], pins: dict[str, _Pinned] | None = None) -> Metadata:
    """DCP's ``.metadata`` of ``directory``, unpickled with only DCP's metadata classes admitted.
    ``pins``: every data file it names is opened once, here, and kept open in it (by name)."""
    path = os.path.join(local_path(directory), ".metadata")
    try:
        md = _MetadataUnpickler(_read_regular(path, MAX_METADATA_BYTES), path).load()
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a DCP checkpoint: it has no .metadata", path=path) from None
    except OSError as e:
        raise from_os_error(e, path) from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{path} is not a readable DCP metadata file: {e}", path=path) from None
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{path} holds a {type(md).__name__}, not DCP Metadata", path=path)
    try:
        _check_dcp_metadata(md, local_path(directory), path, pins)
    except (AttributeError, TypeError, ValueError) as e:  # DCP's classes, with fields of any type
        raise CorruptCheckpointError(f"{path}: malformed DCP metadata ({type(e).__name__}: {e})", path=path) from None
    return md


#: DCP's .metadata of a large model is tens of MB; the ceiling is what one process reads into memory.
MAX_METADATA_BYTES = 1 << 30


def _read_regular(path: str, limit: int) -> bytes:
    """A regular file's bytes (a FIFO, device or symlink is refused: an import never blocks or escapes)."""
    with os.fdopen(open_regular(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise CorruptCheckpointError(
                f"{path} is {size:,} bytes, more than the {limit:,} ckptguard reads", path=path
            )
        return f.read()


@dataclass
class _Pinned:
    """A data file of a DCP directory, opened once: read through this fd, never reopened by path, so that
    a file deleted or replaced meanwhile (the source job's rotation) is still the file that was checked."""

    fd: int
    size: int
    mtime_ns: int


def _pin(full: str) -> _Pinned:
    try:
        fd = open_regular(full)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{full} is missing (deleted while it was being opened?)", path=full) from None
    except OSError as e:  # ELOOP: replaced by a symbolic link since it was looked at
        raise CorruptCheckpointError(f"{full} is not a regular file: refusing to read it ({e})", path=full) from None
    st = os.fstat(fd)
    return _Pinned(fd, st.st_size, st.st_mtime_ns)


def _check_dcp_metadata(md: Metadata, directory: str, path: str, pins: dict[str, _Pinned] | None = None) -> None:
    """Every data file DCP's metadata names: a plain name in ``directory``, a regular file, each
    range inside it; every tensor no larger than the bytes stored. Checked before anything is
    opened by path or allocated (DCP's reader trusts all of it). With ``pins``, each file is opened
    here and its size is that of the file opened."""
    storage = md.storage_data if isinstance(md.storage_data, dict) else {}
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        fqn = getattr(index, "fqn", index)
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(rel, str) or not is_plain_name(rel):
            raise CorruptCheckpointError(
                f"{path}: data file {str(rel)[:200]!r} of {fqn!r} is not a plain "
                "file name in the checkpoint directory: refusing to read it",
                path=path,
            )
        if rel not in sizes:
            full = os.path.join(directory, rel)
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{full}, named by {path}, is missing", path=full) from None
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(
                    f"{full} is not a regular file (a link, FIFO or device): refusing to read it", path=full
                )
            sizes[rel] = st.st_size
            if pins is not None:
                pins[rel] = _pin(full)
                sizes[rel] = pins[rel].size
        if not (
            type(offset) is int
            and type(length) is int
            and offset >= 0
            and length >= 0
            and offset + length <= sizes[rel]
        ):
            raise CorruptCheckpointError(
                f"{path}: {fqn!r} claims bytes {offset}..+{length} of {rel}, which has {sizes[rel]}", path=path
            )
    total = sum(sizes.values())
    declared = 0  # every tensor is allocated before any is read: their sum is bounded, not each alone
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            dims = list(entry.size)
            if any(type(d) is not int or d < 0 for d in dims):
                raise CorruptCheckpointError(
                    f"{path}: tensor {fqn!r} has size {dims[:8]}, not integers >= 0", path=path
                )
            for chunk in entry.chunks:  # DCP reads each chunk by its index into storage_data, then narrows
                offsets, extent = list(chunk.offsets), list(chunk.sizes)
                if (
                    len(offsets) != len(dims)
                    or len(extent) != len(dims)
                    or not all(
                        type(o) is int and type(n) is int and o >= 0 and n >= 0 and o + n <= d
                        for o, n, d in zip(offsets, extent, dims, strict=True)
                    )
                ):
                    raise CorruptCheckpointError(
                        f"{path}: a chunk of tensor {fqn!r} at {offsets[:8]} of size "
                        f"{extent[:8]} is not inside its size {dims[:8]}",
                        path=path,
                    )
                if MetadataIndex(fqn, chunk.offsets) not in storage:
                    raise CorruptCheckpointError(
                        f"{path}: the chunk of tensor {fqn!r} at {offsets[:8]} has no data file entry", path=path
                    )
            declared += math.prod(dims) * entry.properties.dtype.itemsize
            if declared > total:
                raise CorruptCheckpointError(
                    f"{path}: tensor {fqn!r} of size {dims[:8]} makes the tensors larger "
                    f"than every data file together ({total} bytes)",
                    path=path,
                )
            flat = [[*c.offsets, *c.sizes] for c in entry.chunks]
            if not covers_once(dims, np.array(flat, dtype=np.int64).reshape(len(flat), 2 * len(dims))):
                # DCP reads each listed chunk into a fresh tensor: an element no chunk covers would be
                # this process's memory, committed as a checkpoint
                raise CorruptCheckpointError(
                    f"{path}: the chunks of tensor {fqn!r} do not cover its size {dims[:8]} "
                    "exactly once (a gap or an overlap): refusing to import it",
                    path=path,
                )
        elif MetadataIndex(fqn) not in storage:
            raise CorruptCheckpointError(f"{path}: object {fqn!r} has no data file entry", path=path)
    # Lists are rebuilt by index from planner_data (values.unflatten): each index below the number of
    # entries, each path a non-empty sequence no deeper than a stored value may nest.
    planner = md.planner_data if md.planner_data is not None else {}
    if not isinstance(planner, dict):
        raise CorruptCheckpointError(f"{path}: planner_data is a {type(planner).__name__}, not a dict", path=path)
    entries = len(md.state_dict_metadata)
    for fqn, where in planner.items():
        if (
            not isinstance(where, tuple | list)
            or not 0 < len(where) <= MAX_VALUE_DEPTH
            or not all(type(p) is str or (type(p) is int and 0 <= p < entries) for p in where)
        ):
            raise CorruptCheckpointError(
                f"{path}: bad planner path for {str(fqn)[:100]!r}: {str(where)[:100]}", path=path
            )


class _PinnedFileSystem(FileSystem):
    """DCP's file system for a reader: a data file is read through the fd opened when the metadata was
    checked (:class:`_Pinned`); a name that was not checked is refused."""

    def __init__(self, directory: str, pins: dict[str, _Pinned]) -> None:
        self.directory = directory
        self.pins = pins

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        pinned = self.pins.get(os.path.basename(os.fspath(path)))
        if mode != "rb" or pinned is None or os.path.dirname(os.fspath(path)) != self.directory:
            raise CorruptCheckpointError(
                f"{path} is not a data file the checkpoint's metadata names", path=os.fspath(path)
            )
        with os.fdopen(os.dup(pinned.fd), "rb") as f:  # DCP closes the stream; the pin stays open
            f.seek(0)
            yield f


def read_dcp(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """A DCP checkpoint directory's whole state dict, nested, without running code from it.

    Every data file is opened once, when the metadata is checked, and read through that handle: a
    file deleted or replaced meanwhile (the training job that wrote it rotating it out) is still read
    whole; one changed in place (size or time) fails with CorruptCheckpointError."""
    directory = os.path.abspath(local_path(directory))
    pins: dict[str, _Pinned] = {}
    try:
        md = read_dcp_metadata(directory, pins)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        reader = FileSystemReader(directory)
        reader.fs = _PinnedFileSystem(os.fspath(reader.path), pins)
        reader.set_up_storage_reader(md, True)
        try:
            state = read_all(reader, md, decode=False)
        except Exception as e:  # a file cut short while read fails in DCP's or torch's code: say why
            changed = _changed(directory, pins)
            if changed is not None:
                raise changed from e
            if isinstance(e, CheckpointError | MemoryError):
                raise
            # Metadata whose ranges name other bytes than a tensor's (another item, a cut): DCP's reader
            # and torch.load fail anywhere in their code
            raise CorruptCheckpointError(
                f"{directory}: DCP's reader cannot read what its .metadata describes "
                f"({type(e).__name__}: {str(e)[:200]}): the directory is damaged or "
                "its .metadata was changed",
                path=os.path.join(directory, ".metadata"),
            ) from None
        changed = _changed(directory, pins)
        if changed is not None:
            raise changed
        return state
    finally:
        for pinned in pins.values():
            os.close(pinned.fd)


def _changed(directory: str, pins: dict[str, _Pinned]) -> CorruptCheckpointError | None:
    """The error for a pinned data file written to since it was checked, if one was."""
    for rel, pinned in pins.items():
        st = os.fstat(pinned.fd)
        if (st.st_size, st.st_mtime_ns) != (pinned.size, pinned.mtime_ns):
            full = os.path.join(directory, rel)
            return CorruptCheckpointError(
                f"{full} changed while it was being read ({pinned.size:,} bytes before, "
                f"{st.st_size:,} after): nothing was read from it; read it again once "
                "the job writing it is done",
                path=full,
            )
    return None


def import_checkpoint(
    source: str | os.PathLike[str], root: str | os.PathLike[str], step: int, *, overwrite: bool = False
) -> list[str]:
    """Commit a DCP directory or a ``torch.save`` file as ``step`` of the ckptguard root.

    The CLI's ``ckptguard import``. DCP's ``.metadata`` pickle is read with an unpickler that admits
    only DCP's metadata classes, torch dtypes, ``torch.Size`` and layouts (anything else is refused
    before it runs); a ``torch.save`` file is read with ``weights_only=True``. Each DCP data file is
    opened once and read through that handle, so a directory rotated out meanwhile is still imported
    whole.

    Args:
        source: A DCP checkpoint directory or a ``torch.save`` file.
        root: The ckptguard root to commit into (created if missing).
        step: The step number to commit it as (a non-negative int).
        overwrite: Replace a committed ``step`` atomically.

    Returns:
        The top-level keys of the imported state.

    Raises:
        ValueError: ``step`` is not a non-negative int (nothing is created).
        StepExistsError: ``step`` is committed and ``overwrite`` is False.
        UnsafeObjectError: The source would need unpickling code to load.
        CorruptCheckpointError: A DCP data file changed in place during the import, or the source is
            malformed; nothing is imported.
    """
    from ckptguard.checkpointer import Checkpointer

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:  # before anything is read or created
        raise ValueError(f"step must be a non-negative int, got {step!r} (nothing was created)")
    source = os.path.abspath(local_path(source))
    state: Any
    if os.path.isdir(source):
        state = read_dcp(source)
    else:
        try:
            with os.fdopen(open_regular(source), "rb") as f:  # a FIFO is refused, never waited on
                state = load_bounded(f, source, source, "cpu")
        except pickle.UnpicklingError as e:
            raise UnsafeObjectError(
                f"{source}: torch.load(weights_only=True) refused it ({str(e).splitlines()[0]}); "
                "ckptguard imports only files that load without running code",
                path=source,
            ) from None
        except CheckpointError:
            raise
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"{source} is not a DCP directory or a torch.save file: {e}", path=source) from None
    check_depth(state, source, source)  # a DCP directory's values, as read_dcp gives them
    if not isinstance(state, dict) or not all(isinstance(k, str) and k for k in state):
        state = {"state": state}
    with Checkpointer(root, process_group="local") as ck:
        ck.save(step, state, overwrite=overwrite)
    return sorted(state)
