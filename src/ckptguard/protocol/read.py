"""A template-free read: the stored state dict of a committed checkpoint, nested as it was saved.

What a framework's ``load_checkpoint(path)`` needs: it has no modules to load into.
Every tensor comes back whole (resharded from however it was saved) on the CPU, every
value decoded (``codec.decode_value``); ``PerRank`` values come back under their key,
this rank's own. The bytes are verified as in a load; a corrupt newest checkpoint falls
back to an older one, with a warning, when no step was asked for.

    manifest  each domain's leader reads its manifest; every rank of the domain checks it
    read      a flat destination built from DCP's metadata, read and verified, then nested
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ckptguard.dcp.codec import decode_value, metadata_from_json, unflatten
from ckptguard.dcp.drive import read_locally
from ckptguard.dcp.planners import SafeLoadPlanner
from ckptguard.dcp.reader import GuardedReader
from ckptguard.errors import CorruptCheckpointError, StepNotFoundError
from ckptguard.protocol.decisions import Listing, commit_order
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.load import falls_back
from ckptguard.protocol.manifest import Manifest
from ckptguard.protocol.session import Session

_PER_RANK = re.compile(r"^(.+)@rank(\d{5,})$")


def read_first_intact(session: Session, candidates: list[int], current: Listing, fallback: bool
                      ) -> tuple[int | None, dict[str, Any] | None]:
    """(step, state) of the first intact candidate; (None, None) if there is none (collective)."""
    errors: list[str] = []
    for s in candidates:
        try:
            return s, read_one(session, CheckpointName(s, current[s].version))
        except BaseException as e:
            if not fallback or not falls_back(e):
                raise
            errors.append(f"step {s}: {e}")
            if session.comm.rank == 0:
                warnings.warn(f"ckptguard: checkpoint step {s} in {session.url} is corrupt ({e}); "
                              "falling back to the previous committed checkpoint", stacklevel=4)
    if errors:
        raise CorruptCheckpointError(f"every committed checkpoint in {session.url} is corrupt: " + "; ".join(errors))
    return None, None


def read_manifest(session: Session, name: CheckpointName) -> Manifest:
    """The checkpoint's manifest: read by each domain's leader, checked by every rank (collective)."""
    comm, topo, root = session.comm, session.topo, session.root
    raw: bytes | None = None
    read_error: BaseException | None = None
    if topo.is_leader:
        try:
            raw = root.read_manifest_bytes(name)
        except BaseException as e:  # reported at the agreement below
            read_error = e
    raw = comm.share_in_domain(raw, list(topo.domain))

    def parse() -> Manifest:
        if read_error is not None:
            raise read_error
        assert raw is not None
        manifest = root.parse_manifest(name, raw)
        if topo.is_leader:
            root.check_files(name, manifest)
        return manifest

    manifest: Manifest = comm.step(f"read checkpoint {name.dirname} in {session.url}", parse, where=session.url)
    return manifest


def read_one(session: Session, name: CheckpointName) -> dict[str, Any]:
    manifest = read_manifest(session, name)
    comm = session.comm
    out: dict[str, Any] = {}

    def read() -> None:
        out.update(read_stored(session, name, manifest, comm.rank, is_coordinator=comm.rank == 0))

    comm.step(f"read step {name.step}", read, where=session.url)
    return out


def read_stored(session: Session, name: CheckpointName, manifest: Manifest, rank: int, *,
                is_coordinator: bool = True, keep: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """This rank's view of the stored state dict (local: no agreement)."""
    metadata = metadata_from_json(manifest.dcp, manifest.items)
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    flat: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        top = str(paths.get(fqn, (fqn,))[0])
        m = _PER_RANK.match(top)
        if m is not None and int(m.group(2)) != rank:
            continue  # another rank's own value: not this rank's to read
        if keep is not None and not keep(top if m is None else m.group(1)):
            continue
        if isinstance(entry, TensorStorageMetadata):
            flat[fqn] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            flat[fqn] = None
    reader = GuardedReader(session.storage, session.root.data_dir(name, manifest), metadata,
                           manifest.checksum_algorithm, rank, session.options.io_threads,
                           memory_bytes=session.options.load_memory_bytes)
    planner = SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        read_locally(flat, reader, planner, is_coordinator=is_coordinator)  # read and verify
        reader.apply(planner)  # into the fresh buffers above: nothing of the caller's can tear
    finally:
        reader.close()
    nested = unflatten(planner.state_dict, paths)
    result: dict[str, Any] = {}
    for key, value in nested.items():
        m = _PER_RANK.match(key)
        result[m.group(1) if m is not None else key] = decode_value(value)
    return result


def candidates(session: Session, step: int | None, current: Listing) -> list[int]:
    """What a read (or ``path``) may pick: ``step`` if it is committed, else every step, the one
    committed last first."""
    if step is None:
        return list(reversed(commit_order(current)))
    if step not in current:
        raise StepNotFoundError(f"step {step} is not a committed checkpoint in {session.url}; committed steps: "
                                f"{commit_order(current) or 'none'}")
    return [step]
