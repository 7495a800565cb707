"""`save_file` / `load_file`: one file, one writer, atomic, checksummed, for plain DDP code.

The file is an ordinary ``torch.save`` zip, so ``torch.load`` still reads it; the
checksum of everything before it sits in the zip's end-of-archive comment, which
zip readers (torch's included) ignore. ``torch.load`` itself does not check the
zip CRCs, so a torn or bit-flipped file can load silently; ``load_file`` refuses.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import struct
from typing import Any

import torch

from ckptguard.checksum import DEFAULT_ALGORITHM, checksum
from ckptguard.comm import Comm, LocalTransport, default_comm
from ckptguard.dcp.codec import load_bounded
from ckptguard.dcp.values import encode_value
from ckptguard.errors import (
    CheckpointError,
    CorruptCheckpointError,
    MalformedRecordError,
    UnsafeObjectError,
    UnsupportedValueError,
    from_os_error,
)
from ckptguard.protocol.records import parse_json
from ckptguard.protocol.topology import Topology, probe_storage_domains
from ckptguard.storage import PosixStorage, StorageBackend, filesystem_path, open_storage
from ckptguard.storage.fileio import makedirs_durable, open_regular
from ckptguard.writerlock import WriterLock, replace_locked

_EOCD = b"PK\x05\x06"
_TAG = re.compile(rb"ckptguard:1:(xxh3-64|crc32c):([0-9a-f]{8,16}):(\d+)$")
_topologies: dict[tuple[int, str], Topology] = {}


def _seal(data: bytes, algorithm: str) -> bytes:
    eocd = data.rfind(_EOCD, max(0, len(data) - 22 - 65535))
    if eocd < 0 or len(data) - eocd != 22:
        raise CheckpointError("torch.save produced an archive with a comment already; cannot seal it")
    body = data[: eocd + 20]
    tag = f"ckptguard:1:{algorithm}:{checksum(algorithm, body)}:{len(body)}".encode()
    return body + struct.pack("<H", len(tag)) + tag


def _unseal(data: bytes, path: str) -> bytes:
    """The verified archive, or CorruptCheckpointError naming what is wrong."""
    m = _TAG.search(data[-80:])
    if m is None and data[-22:-18] == _EOCD and data[-2:] == b"\x00\x00":  # a zip without save_file's tag
        raise CheckpointError(
            f"{path} is a torch.save file without ckptguard's checksum (not written by ckptguard.save_file), so "
            "it cannot be verified. If you trust it, load it with torch.load(path, weights_only=True), or "
            "write a verified copy with ckptguard.save_file(torch.load(path, weights_only=True), new_path).",
            path=path,
        )
    if m is None:
        raise CorruptCheckpointError(
            f"{path} carries no ckptguard checksum: it was not written by ckptguard.save_file, or its end "
            f"is cut off ({len(data)} bytes). Refusing to load it unverified.",
            path=path,
        )
    tag = m.group(0)
    algorithm, digest, length = m.group(1).decode(), m.group(2).decode(), int(m.group(3))
    if len(data) != length + 2 + len(tag) or struct.unpack("<H", data[length : length + 2])[0] != len(tag):
        raise CorruptCheckpointError(
            f"{path} is {len(data)} bytes but its checksum covers {length} + {2 + len(tag)}: the file is "
            "truncated or has bytes appended. Refusing to load it.",
            path=path,
        )
    body = data[:length]
    got = checksum(algorithm, body)
    if got != digest:
        raise CorruptCheckpointError(
            f"{path}: checksum mismatch ({algorithm} {got}, expected {digest}): the file is corrupt "
            "(torn write, bit flip or concurrent writers). Refusing to load it.",
            path=path,
        )
    return body + b"\x00\x00"


def _topology(comm: Comm, directory: str) -> Topology:
    key = (id(comm.process_group), directory)
    if key not in _topologies:
        _topologies[key] = probe_storage_domains(comm, PosixStorage(directory), probe_prefix=".ckptguard-probe-")
    return _topologies[key]


def save_file(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    process_group: Any = None,
    format: str | None = None,
    checksum_algorithm: str = DEFAULT_ALGORITHM,
    lock_timeout_s: float = 60.0,
) -> None:
    """Save ``obj`` to ``path``: atomic replace, checksummed, one writer at a time.

    Takes part in no collective unless given ``group=``: ``if rank == 0: save_file(...)`` just works.
    Two processes writing one path take turns through an exclusive lock file next to it
    (``path + ".lock"``, created with O_EXCL; a lock left by a dead process on this host is broken, and
    so is one left empty or holding no writer's name for more than 10 s; another is waited for up to
    ``lock_timeout_s``). The temporary file a killed writer left beside the target is removed by the
    next ``save_file`` of it.

    Example:
        ```python
        if rank == 0:
            save_file(model.state_dict(), "/shared/model.pt")
        save_file(model.state_dict(), "/shared/model.safetensors")  # a flat dict of tensors
        ```

    Args:
        obj: What to save. Refused, before anything is written, if ``load_file``
            (``torch.load(weights_only=True)``) could not give it back: an arbitrary object, a
            ``Path``, a namedtuple, numpy values, frozensets (store ``torch.from_numpy(a)`` or
            ``a.tolist()``, or use a ``Checkpointer``, which stores them exactly).
        path: A local path, a ``file://`` URL or ``s3://bucket/key`` (an object PUT replaces
            atomically; with ``group=``, rank 0 writes).
        group: A process group, or ``True`` for all ranks: then every rank of the group calls it with
            the same path and the lowest rank of each set of ranks sharing the directory writes, after
            a barrier (so the file is never replaced while another rank still reads the previous
            version); a failure is raised on every rank as the same class.
        process_group: Another name for ``group``.
        format: ``"torch"`` (a ``torch.save`` zip; ``torch.load`` still reads it) or ``"safetensors"``
            (a flat dict of tensors, checksum in the header). Default: from the suffix
            (``.safetensors``), else ``"torch"``.
        checksum_algorithm: The checksum stored with the data.
        lock_timeout_s: How long to wait for another writer's lock.

    Raises:
        UnsupportedValueError: ``obj`` holds a value ``load_file`` could not give back; it names where.
        PathCollisionError: ``path + ".lock"`` is a directory, FIFO or link (left as it is).
        DiskFullError: No space left; no lock is left behind.
        StorageError: Another storage failure, naming the file.
        TypeError: ``path`` is not a ``str`` or ``os.PathLike``.
    """
    _check_path("save_file", path)
    group = group if group is not None else process_group
    local = filesystem_path(path)
    if local is None:
        comm = Comm(LocalTransport()) if group is None else _world_comm() if group is True else default_comm(group)
        _save_object(obj, os.fspath(path), comm, _format(os.fspath(path), format), checksum_algorithm)
        return
    path = os.path.abspath(local)
    directory = os.path.dirname(path)
    fmt = _format(path, format)
    if group is None:
        save_local(obj, path, fmt, checksum_algorithm, lock_timeout_s)
        return
    comm = _world_comm() if group is True else default_comm(group)
    try:
        makedirs_durable(directory)
    except OSError as e:
        raise from_os_error(e, directory, comm.rank) from e
    topo = None
    if comm.world_size > 1:
        topo = _topology(comm, directory)
        # Nobody may still be reading the previous version (load_file right after the last save_file).
        comm.step(f"finish reading the previous version of {path}")

    def write() -> None:
        if topo is None or topo.is_leader:
            data = _serialize(obj, fmt, checksum_algorithm, path)
            with WriterLock(path, lock_timeout_s):
                try:
                    replace_locked(path, data)
                except OSError as e:  # the temporary file's own name would only confuse
                    raise from_os_error(e, path, comm.rank, root=directory) from e

    comm.step(f"save {path}", write, where=directory)


def save_local(
    obj: Any, path: str, fmt: str, algorithm: str, lock_timeout_s: float = 60.0, *, loadable: bool = True
) -> None:
    """``save_file`` to a local path, by this process alone. ``loadable=False`` (``ckptguard export --to
    torch``, whose file is for plain ``torch.load``) skips the refusal of what ``load_file`` could not read."""
    directory = os.path.dirname(path)
    try:
        makedirs_durable(directory)
    except OSError as e:
        raise from_os_error(e, directory) from e
    data = _serialize(obj, fmt, algorithm, path, loadable=loadable)
    with WriterLock(path, lock_timeout_s):
        try:
            replace_locked(path, data)
        except OSError as e:  # the temporary file's own name would only confuse
            raise from_os_error(e, path, root=directory) from e


def load_file(path: str | os.PathLike[str], *, map_location: Any = "cpu", format: str | None = None) -> Any:
    """Load a file written by ``save_file``, after checking its checksum; objects via ``weights_only``.

    Example:
        ```python
        state = load_file("/shared/model.pt")
        ```

    Args:
        path: A local path, a ``file://`` URL or ``s3://bucket/key``.
        map_location: Where tensors go, as for ``torch.load``.
        format: ``"torch"`` or ``"safetensors"``; default from the suffix.

    Returns:
        What was saved; a ``.safetensors`` file (or ``format="safetensors"``) comes back as a dict of
        tensors.

    Raises:
        CorruptCheckpointError: A torn, truncated or bit-flipped file, or a hostile one (a safetensors
            header out of bounds); it names the file and what is wrong.
        CheckpointError: A plain ``torch.save`` file without ckptguard's checksum (load it with
            ``torch.load(path, weights_only=True)`` if you trust it), or a directory.
        TypeError: ``path`` is not a ``str`` or ``os.PathLike``.
    """
    _check_path("load_file", path)
    local = filesystem_path(path)
    if local is None:
        path = os.fspath(path)
        data = _read_object(path)
    else:
        path = local
        if os.path.isdir(path):
            raise CheckpointError(
                f"{path} is a directory: load_file reads one file written by save_file. A checkpoint root is "
                f"loaded with Checkpointer({path!r}, read_only=True).load(state); a DCP directory with "
                "ckptguard.DCPReader",
                path=path,
            )
        try:
            fd = open_regular(path)
            with os.fdopen(fd, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise CheckpointError(f"{path} does not exist", path=path) from None
        except OSError as e:
            raise from_os_error(e, path) from e
    fmt = _format(path, format)
    if fmt == "safetensors":
        return _load_safetensors(data, path, map_location)
    body = _unseal(data, path)
    try:
        return load_bounded(io.BytesIO(body), path, path, map_location)
    except CheckpointError:
        raise
    except Exception as e:
        raise UnsafeObjectError(
            f"{path}: verified, but torch.load(weights_only=True) refused it: {e}", path=path
        ) from None


FORMATS = ("torch", "safetensors")


def _check_path(function: str, path: Any) -> None:
    """A str or os.PathLike path (bytes and anything else refused naming the argument)."""
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
        raise TypeError(
            f"{function}: path must be a local path or an s3:// URL (str or os.PathLike), got "
            f"{path!r} ({type(path).__name__})"
        )


def _format(path: str, format: str | None) -> str:
    if format is None:
        return "safetensors" if path.endswith(".safetensors") else "torch"
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, not {format!r}")
    return format


def _serialize(obj: Any, fmt: str, algorithm: str, path: str, *, loadable: bool = True) -> bytes:
    if fmt == "safetensors":
        return _seal_safetensors(obj, algorithm, path)
    try:  # what load_file could not give back is refused here, as Checkpointer.save refuses it
        if loadable:
            encode_value(obj, plain_torch_load=True)
    except UnsupportedValueError as e:
        raise UnsupportedValueError(f"{path}: {e}", path=path) from None
    buf = io.BytesIO()
    torch.save(obj, buf)
    return _seal(buf.getvalue(), algorithm)


# -- safetensors: the checksum lives in the header's __metadata__ -------------------------
#
# It covers the header (less the checksum entry itself: dtypes, shapes, offsets) and every
# data byte, so a bit flip anywhere is caught; any safetensors reader still reads the file.

_ST_KEY = "ckptguard"


def _st_digest(algorithm: str, header: dict[str, Any], data: memoryview) -> str:
    meta = dict(header.get("__metadata__") or {})
    meta.pop(_ST_KEY, None)
    canonical = json.dumps({**header, "__metadata__": meta}, sort_keys=True, separators=(",", ":")).encode()
    return f"{checksum(algorithm, canonical)}:{checksum(algorithm, data)}"


def _seal_safetensors(obj: Any, algorithm: str, path: str) -> bytes:
    try:
        from safetensors.torch import save as st_save
    except ImportError:
        raise CheckpointError(
            "saving .safetensors needs the safetensors package: pip install 'ckptguard[safetensors]'", path=path
        ) from None
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise UnsupportedValueError(
            f"{path}: safetensors stores a flat dict of str names to tensors (e.g. model.state_dict()); "
            "save other values with format='torch' (a .pt path)",
            path=path,
        )
    tensors = {k: v.detach().cpu().contiguous() for k, v in obj.items()}
    raw = st_save(tensors)
    header, data = _st_split(raw, path)
    digest = _st_digest(algorithm, header, data)
    header.setdefault("__metadata__", {})[_ST_KEY] = f"1:{algorithm}:{digest}:{len(data)}"
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keep the data 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(text)) + text + bytes(data)


def _st_split(raw: bytes, path: str) -> tuple[dict[str, Any], memoryview]:
    if len(raw) < 8:
        raise CorruptCheckpointError(f"{path}: {len(raw)} bytes is too short for a safetensors file", path=path)
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8 or n > 100 << 20:
        raise CorruptCheckpointError(f"{path}: safetensors header length {n} does not fit the file", path=path)
    header = parse_json(raw[8 : 8 + n], path, "safetensors header", max_bytes=None, max_depth=_ST_MAX_DEPTH)
    if not isinstance(header, dict):
        raise MalformedRecordError(f"{path}: safetensors header is not an object", path=path, field="(record)")
    return header, memoryview(raw)[8 + n :]


#: {name: {"dtype", "shape": [...], "data_offsets": [b, e]}, "__metadata__": {str: str}}
_ST_MAX_DEPTH = 3
_ST_ITEMSIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}
# (other dtypes, sub-byte ones included, are checked by the safetensors library, its refusal wrapped)


def _st_check(header: dict[str, Any], data_bytes: int, path: str) -> None:
    """Every entry of a safetensors header well-formed and inside the data, before anything reads it."""

    def bad(field: str, what: str) -> MalformedRecordError:
        return MalformedRecordError(
            f"{path}: safetensors header field {field[:200]!r}: {what}", path=path, field=field[:200]
        )

    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise bad(name, "must map names to strings")
            continue
        if not isinstance(entry, dict):
            raise bad(name, "must be an object with dtype, shape and data_offsets")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str):
            raise bad(name, "dtype must be a string")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(name, "shape must be a list of integers >= 0")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            raise bad(name, f"data_offsets {str(offsets)[:80]} are not inside the {data_bytes} data bytes")
        if dtype in _ST_ITEMSIZES and math.prod(shape) * _ST_ITEMSIZES[dtype] != offsets[1] - offsets[0]:
            raise bad(name, f"shape {shape[:8]} of {dtype} does not match its {offsets[1] - offsets[0]} bytes")


def _load_safetensors(data: bytes, path: str, map_location: Any) -> dict[str, torch.Tensor]:
    header, body = _st_split(data, path)
    _st_check(header, len(body), path)
    tag = (header.get("__metadata__") or {}).get(_ST_KEY)
    m = re.fullmatch(r"1:(xxh3-64|crc32c):([0-9a-f]+:[0-9a-f]+):(\d+)", tag or "")
    if m is None:
        raise CorruptCheckpointError(
            f"{path} carries no ckptguard checksum: it was not written by ckptguard.save_file. Refusing to "
            "load it unverified.",
            path=path,
        )
    if int(m.group(3)) != len(body):
        raise CorruptCheckpointError(
            f"{path}: {len(body)} data bytes, the checksum covers {m.group(3)}: truncated or appended to", path=path
        )
    got = _st_digest(m.group(1), header, body)
    if got != m.group(2):
        raise CorruptCheckpointError(
            f"{path}: checksum mismatch ({m.group(1)} {got}, expected {m.group(2)}): "
            "the file is corrupt. Refusing to load it.",
            path=path,
        )
    from safetensors.torch import load as st_load

    try:
        tensors: dict[str, torch.Tensor] = st_load(data)
    except Exception as e:  # SafetensorError and whatever else the library refuses it with
        raise CorruptCheckpointError(
            f"{path}: verified, but safetensors refused it: {type(e).__name__}: {e}", path=path
        ) from None
    if map_location not in (None, "cpu"):
        tensors = {k: v.to(map_location) for k, v in tensors.items()}
    return tensors


def _object_storage(path: str) -> tuple[StorageBackend, str]:
    """The store holding ``s3://bucket/key`` and the path of the object in it."""
    directory, _, name = path.rstrip("/").rpartition("/")
    if not name or directory.endswith(":/"):
        raise CheckpointError(f"{path}: expected s3://BUCKET/KEY", path=path)
    storage = open_storage(directory)
    return storage, storage.path(name)


def _save_object(obj: Any, path: str, comm: Comm, fmt: str, algorithm: str) -> None:
    storage, target = _object_storage(path)
    if comm.world_size > 1:
        comm.step(f"finish reading the previous version of {path}")

    # One namespace for every rank: rank 0 writes, every rank gets its outcome, an error as the same class.
    comm.one_rank_acts(
        f"save {path}", lambda: storage.replace(target, _serialize(obj, fmt, algorithm, path)), where=path
    )


def _read_object(path: str) -> bytes:
    storage, target = _object_storage(path)
    try:
        size = storage.size(target)
        if size is None:
            raise FileNotFoundError(target)
        handle = storage.open_read(target)
        buf = bytearray(size)
        try:
            handle.read_into([memoryview(buf)], 0)
        finally:
            handle.close()
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist", path=path) from None
    except OSError as e:
        raise from_os_error(e, path) from e
    return bytes(buf)


_world: tuple[object, Comm] | None = None


def _world_comm() -> Comm:
    """One control-plane group per default process group (creating groups is collective: reuse it)."""
    global _world
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return Comm(LocalTransport())
    if _world is None or _world[0] is not dist.group.WORLD:
        _world = (dist.group.WORLD, default_comm())
    return _world[1]
