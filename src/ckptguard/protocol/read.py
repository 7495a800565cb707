"""A template-free read: the stored state dict of a committed checkpoint, nested as it was saved.

What a framework's ``load_checkpoint(path)`` needs: it has no modules to load into.
Every tensor comes back whole (resharded from however it was saved) on the CPU, every
value decoded (``values.decode_value``); ``PerRank`` values come back under their key,
this rank's own. The bytes are verified as in a load; a corrupt newest checkpoint falls
back to an older one, with a warning, when no step was asked for.

    manifest  each domain's leader reads its manifest; every rank of the domain checks it
    read      a flat destination built from DCP's metadata, read and verified, then nested
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ckptguard.dcp.drive import read_locally
from ckptguard.dcp.planners import SafeLoadPlanner
from ckptguard.dcp.reader import GuardedReader
from ckptguard.dcp.values import decode_value, split_per_rank_key, unflatten
from ckptguard.errors import StepNotFoundError
from ckptguard.protocol.decisions import Listing, commit_order
from ckptguard.protocol.fallback import first_intact
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.load import agree_on_manifest, manifest_metadata, share_manifest_bytes
from ckptguard.protocol.manifest import Manifest
from ckptguard.protocol.session import Session
from ckptguard.protocol.validate import check_whole_reads


def read(
    session: Session, step: int | None, keep: Callable[[str], bool] | None = None
) -> tuple[int | None, dict[str, Any] | None, Listing]:
    """(step, state) of ``step``, or of the checkpoint committed last with the fallback and relisting
    of a load (load.first_intact); and the agreed listing (collective). ``keep``: which top-level keys."""
    return first_intact(session, step, lambda name, seq: read_one(session, name, seq, keep))


def read_one(
    session: Session, name: CheckpointName, seq: int | None, keep: Callable[[str], bool] | None = None
) -> dict[str, Any]:
    manifest = agree_on_manifest(session, name, seq, share_manifest_bytes(session, name))
    comm = session.comm
    out: dict[str, Any] = {}

    def read() -> None:
        out.update(read_stored(session, name, manifest, comm.rank, is_coordinator=comm.rank == 0, keep=keep))

    comm.step(f"read step {name.step}", read, where=session.url)
    return out


def read_stored(
    session: Session,
    name: CheckpointName,
    manifest: Manifest,
    rank: int,
    *,
    is_coordinator: bool = True,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """This rank's view of the stored state dict (local: no agreement)."""
    metadata = manifest_metadata(session, name, manifest)
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    chosen: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        top = str(paths.get(fqn, (fqn,))[0])
        own = split_per_rank_key(top)
        if own is not None and own[1] != rank:
            continue  # another rank's own value: not this rank's to read
        if keep is not None and not keep(top if own is None else own[0]):
            continue
        chosen[fqn] = entry
    flat = allocate_whole(manifest, chosen, session.root.dir(name))
    reader = GuardedReader(
        session.storage,
        session.root.data_dir(name, manifest),
        metadata,
        manifest.checksum_algorithm,
        rank,
        session.options.io_threads,
        memory_bytes=session.options.load_memory_bytes,
        backup=False,
        domain_count=manifest.domain_count,
    )
    planner = SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        read_locally(flat, reader, planner, is_coordinator=is_coordinator)  # read and verify
        reader.apply(planner)  # into the fresh buffers above: nothing of the caller's can tear
    finally:
        reader.close()
    nested = unflatten(planner.state_dict, paths)
    result: dict[str, Any] = {}
    for key, value in nested.items():
        own = split_per_rank_key(key)
        result[own[0] if own is not None else key] = decode_value(value)
    return result


def allocate_whole(manifest: Manifest, entries: dict[str, Any], path: str) -> dict[str, Any]:
    """A fresh tensor for each tensor entry of DCP's metadata (None for an object), once the manifest's
    bytes were found to bound them all (validate.check_whole_reads)."""
    declared = {
        fqn: math.prod(e.size) * e.properties.dtype.itemsize
        for fqn, e in entries.items()
        if isinstance(e, TensorStorageMetadata)
    }
    check_whole_reads(manifest, declared, path)
    return {
        fqn: torch.empty(e.size, dtype=e.properties.dtype) if fqn in declared else None for fqn, e in entries.items()
    }


def read_metadata(session: Session, step: int, current: Listing) -> dict[str, Any]:
    """The ``metadata=`` saved with committed ``step``, as rank 0 reads it from that version's
    manifest; every rank gets it, or the same error (collective)."""
    require_committed(session, step, current)
    name = CheckpointName(step, current[step].version)

    def leader_reads() -> dict[str, Any] | None:
        return session.root.read_manifest(name).user_metadata if session.comm.rank == 0 else None

    meta: dict[str, Any] = session.comm.step(
        f"read the metadata of step {step}", leader_reads, lambda got: got[0], where=session.url
    )
    return meta


def require_committed(session: Session, step: int, current: Listing) -> None:
    if step not in current:
        raise StepNotFoundError(
            f"step {step} is not a committed checkpoint in {session.url}; committed steps: "
            f"{commit_order(current) or 'none'}"
        )
