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
from ckptguard.comm import Comm, LocalComm, agree, default_comm
from ckptguard.errors import CheckpointError, CorruptCheckpointError
from ckptguard.storage.posix import PosixStorage, explain_os_error, makedirs_durable, replace_file
from ckptguard.topology import Topology, probe_storage_domains

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
    """
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    comm = default_comm(process_group) if process_group is not None else _world_comm()
    makedirs_durable(directory)
    topo = None
    if comm.world_size > 1:
        topo = _topology(comm, directory)
        # Nobody may still be reading the previous version (load_file right after the last save_file).
        comm.barrier()
    err: BaseException | None = None
    if topo is None or topo.is_leader:
        try:
            buf = io.BytesIO()
            torch.save(obj, buf)
            data = _seal(buf.getvalue(), checksum_algorithm)
            replace_file(path, data)
        except OSError as e:
            err = explain_os_error(e, path, comm.rank, needed_bytes=None, root=directory)
        except Exception as e:  # every failure must reach the agreement
            err = e
    if comm.world_size > 1:
        agree(comm, err, f"save {path}")
    elif err is not None:
        raise err


def load_file(path: str | os.PathLike[str], *, map_location: Any = "cpu") -> Any:
    """Load a file written by ``save_file``, after checking its checksum; objects via weights_only."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist", path=path) from None
    body = _unseal(data, path)
    try:
        return torch.load(io.BytesIO(body), map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: verified, but torch.load(weights_only=True) refused it: {e}",
                              path=path) from None


_world: tuple[object, Comm] | None = None


def _world_comm() -> Comm:
    """One control-plane group per default process group (creating groups is collective: reuse it)."""
    global _world
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return LocalComm()
    if _world is None or _world[0] is not dist.group.WORLD:
        _world = (dist.group.WORLD, default_comm())
    return _world[1]
