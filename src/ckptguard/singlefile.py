"""`save_file` / `load_file`: one file, one writer, atomic, checksummed, for plain DDP code.

The file is an ordinary ``torch.save`` zip, so ``torch.load`` still reads it; the
checksum of everything before it sits in the zip's end-of-archive comment, which
zip readers (torch's included) ignore. ``torch.load`` itself does not check the
zip CRCs, so a torn or bit-flipped file can load silently; ``load_file`` refuses.
"""

from __future__ import annotations

import io
import os
import re
import struct
from typing import Any

import torch

from ckptguard.checksum import DEFAULT_ALGORITHM, checksum
from ckptguard.comm import Comm, LocalTransport, default_comm
from ckptguard.errors import (
    CheckpointError,
    CorruptCheckpointError,
    UnsafeObjectError,
    from_os_error,
)
from ckptguard.protocol.topology import Topology, probe_storage_domains
from ckptguard.storage import PosixStorage, StorageBackend, is_s3_url, local_path, open_storage
from ckptguard.storage.posix import open_regular, replace_file

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
    if m is None:
        raise CorruptCheckpointError(
            f"{path} carries no ckptguard checksum: it was not written by ckptguard.save_file, or its end "
            f"is cut off ({len(data)} bytes). Refusing to load it unverified.", path=path)
    tag = m.group(0)
    algorithm, digest, length = m.group(1).decode(), m.group(2).decode(), int(m.group(3))
    if len(data) != length + 2 + len(tag) or struct.unpack("<H", data[length:length + 2])[0] != len(tag):
        raise CorruptCheckpointError(
            f"{path} is {len(data)} bytes but its checksum covers {length} + {2 + len(tag)}: the file is "
            "truncated or has bytes appended. Refusing to load it.", path=path)
    body = data[:length]
    got = checksum(algorithm, body)
    if got != digest:
        raise CorruptCheckpointError(
            f"{path}: checksum mismatch ({algorithm} {got}, expected {digest}): the file is corrupt "
            "(torn write, bit flip or concurrent writers). Refusing to load it.", path=path)
    return body + b"\x00\x00"


def _topology(comm: Comm, directory: str) -> Topology:
    key = (id(comm.process_group), directory)
    if key not in _topologies:
        _topologies[key] = probe_storage_domains(comm, PosixStorage(directory), probe_prefix=".ckptguard-probe-")
    return _topologies[key]


def save_file(obj: Any, path: str | os.PathLike[str], *, process_group: Any = None,
              checksum_algorithm: str = DEFAULT_ALGORITHM) -> None:
    """Save ``obj`` to ``path``: one writer per storage domain, atomic replace, checksummed.

    Collective when a process group is initialised: every rank calls it with
    the same path, and the lowest rank of each set of ranks sharing the
    directory writes its ``obj`` (with DDP every rank holds the same state).
    It starts with a barrier, so the file is never replaced while another rank
    is still reading the previous version, and returns once it is durable.
    ``s3://bucket/key`` paths work too: rank 0 writes (every rank reaches the
    same bucket), and an object PUT replaces atomically.
    """
    comm = default_comm(process_group) if process_group is not None else _world_comm()
    if is_s3_url(path):
        _save_object(obj, os.fspath(path), comm, checksum_algorithm)
        return
    path = os.path.abspath(local_path(path))
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise from_os_error(e, directory, comm.rank) from e
    topo = None
    if comm.world_size > 1:
        topo = _topology(comm, directory)
        # Nobody may still be reading the previous version (load_file right after the last save_file).
        comm.step(f"finish reading the previous version of {path}")

    def write() -> None:
        if topo is None or topo.is_leader:
            buf = io.BytesIO()
            torch.save(obj, buf)
            try:
                replace_file(path, _seal(buf.getvalue(), checksum_algorithm))
            except OSError as e:  # the temporary file's own name would only confuse
                raise from_os_error(e, path, comm.rank, root=directory) from e

    comm.step(f"save {path}", write, where=directory)


def load_file(path: str | os.PathLike[str], *, map_location: Any = "cpu") -> Any:
    """Load a file written by ``save_file``, after checking its checksum; objects via weights_only."""
    if is_s3_url(path):
        path = os.fspath(path)
        data = _read_object(path)
    else:
        path = local_path(path)
        try:
            fd = open_regular(path)
            with os.fdopen(fd, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise CheckpointError(f"{path} does not exist", path=path) from None
        except OSError as e:
            raise from_os_error(e, path) from e
    body = _unseal(data, path)
    try:
        return torch.load(io.BytesIO(body), map_location=map_location, weights_only=True)
    except Exception as e:
        raise UnsafeObjectError(f"{path}: verified, but torch.load(weights_only=True) refused it: {e}",
                                path=path) from None


def _object_storage(path: str) -> tuple[StorageBackend, str]:
    """The store holding ``s3://bucket/key`` and the path of the object in it."""
    directory, _, name = path.rstrip("/").rpartition("/")
    if not name or directory.endswith(":/"):
        raise CheckpointError(f"{path}: expected s3://BUCKET/KEY", path=path)
    storage = open_storage(directory)
    return storage, storage.path(name)


def _save_object(obj: Any, path: str, comm: Comm, algorithm: str) -> None:
    storage, target = _object_storage(path)
    if comm.world_size > 1:
        comm.step(f"finish reading the previous version of {path}")

    def write() -> None:
        if comm.rank == 0:  # one namespace for every rank: one writer
            buf = io.BytesIO()
            torch.save(obj, buf)
            storage.replace(target, _seal(buf.getvalue(), algorithm))

    comm.step(f"save {path}", write, where=path)


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
