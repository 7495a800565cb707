"""One load, phase by phase (which checkpoint it reads, and the fallback past corrupt or retired
ones: protocol/fallback.py).

    manifest  each domain's leader reads its manifest; every rank of the domain
              parses and checks the same bytes; the leader checks file sizes
    targets   files= destinations gathered, collisions refused
    read      DCP plans (resharding included), our reader reads and verifies
              every byte, writing nothing into the caller's state yet
    restore   files= artifacts staged next to their destinations, verified
    place     once every rank verified everything: files= artifacts renamed into
              place (moved back if any rank cannot), then tensors and objects
              copied into place
    apply     loaded values pushed into modules, optimizers and objects (also
              when a Ctrl-C or another rank's failure comes after this rank placed:
              its state whole, never half)

Nothing the caller can see changes before every rank has verified its whole part
(agreed), so a load that fails leaves the caller's state as it was, and a
fallback leaves no byte of the rejected checkpoint anywhere.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ckptguard._faults import FaultPhase, fault_point
from ckptguard._signals import signals_deferred
from ckptguard.comm import hostname
from ckptguard.dcp.codec import dtype_from_name, metadata_from_json
from ckptguard.dcp.drive import read_locally
from ckptguard.dcp.planners import SafeLoadPlanner
from ckptguard.dcp.reader import GuardedReader
from ckptguard.dcp.wholereads import find_whole_reads
from ckptguard.errors import CheckpointError
from ckptguard.progress import ByteProgress
from ckptguard.protocol import artifacts, layout
from ckptguard.protocol.artifacts import ArtifactTarget
from ckptguard.protocol.decisions import Listing
from ckptguard.protocol.fallback import first_intact
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import Manifest
from ckptguard.protocol.session import Session
from ckptguard.protocol.timing import PhaseTimer
from ckptguard.state import PreparedState, drop_placeholders, prepare_state

log = logging.getLogger("ckptguard")


@dataclass(frozen=True)
class LoadRequest:
    """What the caller asked a load to fill: its state, its files= destinations, whether every key must be
    in the checkpoint."""

    state: Mapping[str, Any]
    files: Mapping[str, Any] | None
    strict: bool


@dataclass(frozen=True)
class SharedManifest:
    """A manifest's bytes as the domain's leader read them, shared with its domain; or the leader's error."""

    raw: bytes | None
    read_error: BaseException | None


@dataclass(frozen=True)
class AgreedManifest:
    """A checkpoint every rank parsed and checked the same manifest of."""

    name: CheckpointName
    manifest: Manifest


def load(
    session: Session,
    step: int | None,
    state: Mapping[str, Any],
    files: Mapping[str, Any] | None,
    strict: bool,
    show_progress: bool,
) -> tuple[int | None, PhaseTimer | None, Listing]:
    """Load ``step``, or the checkpoint committed last (collective).

    Returns the step loaded (None if nothing is committed), its timings, and the
    agreed listing it was chosen from.
    """

    def attempt(name: CheckpointName, seq: int | None) -> PhaseTimer:
        stats = PhaseTimer(show_progress)
        load_one(session, name, seq, LoadRequest(state, files, strict), stats)
        return stats

    return first_intact(session, step, attempt)


def load_one(session: Session, name: CheckpointName, seq: int | None, request: LoadRequest, stats: PhaseTimer) -> None:
    """Load the checkpoint ``name``, listed with commit sequence number ``seq`` (collective)."""
    comm, root = session.comm, session.root
    started = time.perf_counter()
    # A rank mostly reads what the rank of its number wrote: warm those files while the manifest is
    # read, shared, checked and the load planned, and stop once the real reads start (or the load
    # fails: a missing or corrupt manifest only costs reads of files that may not exist).
    prefix = layout.data_file_prefix(comm.rank)
    stop_prefetch: Callable[[], None] | None = session.storage.prefetch(
        os.path.join(root.dir(name), os.path.dirname(prefix)), os.path.basename(prefix)
    )
    try:
        shared = share_manifest_bytes(session, name)
        manifest = agree_on_manifest(session, name, seq, shared)
        targets = _restore_targets(session, name, manifest, request.files)
        stats.seconds["manifest"] = time.perf_counter() - started
        _read_and_place(session, AgreedManifest(name, manifest), targets, request, stats, stop_prefetch)
    finally:
        if stop_prefetch is not None:
            stop_prefetch()


def share_manifest_bytes(session: Session, name: CheckpointName) -> SharedManifest:
    """The manifest's bytes, read by the domain's leader and shared with every rank of the domain
    (bytes travel far faster than a pickled object graph of one entry per tensor chunk); the leader's
    read error, if any, to be reported at the agreement of :func:`agree_on_manifest`."""
    raw: bytes | None = None
    read_error: BaseException | None = None
    if session.topo.is_leader:
        try:
            raw = session.root.read_manifest_bytes(name)
        except BaseException as e:  # reported at the next agreement, once every rank of the domain has the bytes
            read_error = e
    shared: bytes | None = session.comm.share_in_domain(raw, list(session.topo.domain))
    return SharedManifest(shared, read_error)


def agree_on_manifest(session: Session, name: CheckpointName, seq: int | None, shared: SharedManifest) -> Manifest:
    """Every rank parses and checks the shared bytes; the ranks of each storage domain share the
    lookups of its files' sizes (one per file: at thousands of ranks, one reader's lookups, a HEAD
    each on an object store, would take longer than the load) (collective). DCP's metadata is built
    from it where the names to read are known (:func:`manifest_metadata`)."""
    topo, root = session.topo, session.root

    def parse() -> Manifest:
        if shared.read_error is not None:
            raise shared.read_error
        assert shared.raw is not None
        part = (topo.domain.index(topo.rank), len(topo.domain))
        manifest = root.parse_manifest(name, shared.raw, seq, part)
        root.check_files(name, manifest, part)
        return manifest

    agreed: Manifest = session.comm.step(f"read checkpoint {name.dirname} in {session.url}", parse, where=session.url)
    return agreed


def manifest_metadata(
    session: Session, name: CheckpointName, manifest: Manifest, wanted: Collection[str] | None = None
) -> Metadata:
    """DCP's metadata of ``manifest``; of the names in ``wanted`` only, if given (a rank's template)."""
    return metadata_from_json(
        manifest.dcp, manifest.items, session.root.dir(name), domain_count=manifest.domain_count, wanted=wanted
    )


def _restore_targets(
    session: Session, name: CheckpointName, manifest: Manifest, files: Mapping[str, Any] | None
) -> list[ArtifactTarget]:
    """This rank's files= destinations, once no two ranks' collide (collective)."""
    comm, root = session.comm, session.root
    targets: list[ArtifactTarget] = []

    def destinations() -> list[ArtifactTarget]:
        targets.extend(artifacts.normalize(files, comm.rank, hostname(), False, root.local_dir()))
        if targets and manifest.world_size != comm.world_size:
            raise CheckpointError(
                f"step {name.step} was saved by {manifest.world_size} ranks and this job has "
                f"{comm.world_size}: per-rank files= artifacts cannot be resharded",
                rank=comm.rank,
            )
        return targets

    def refuse_collisions(gathered: list[list[ArtifactTarget]]) -> tuple[list[Any], str]:
        certain, uncertain = artifacts.find_collisions([t for g in gathered for t in g])
        if certain:
            raise artifacts.collision_error(*certain[0], where="on restore")
        return uncertain, uuid.uuid4().hex

    uncertain, nonce = comm.step(f"load step {name.step}", destinations, refuse_collisions)
    if uncertain:  # the same path on two hosts: refused if it is on storage they share
        artifacts.probe_shared_paths(comm, uncertain, nonce, where="on restore")
    return targets


def _read_and_place(
    session: Session,
    agreed: AgreedManifest,
    targets: list[ArtifactTarget],
    request: LoadRequest,
    stats: PhaseTimer,
    on_planned: Callable[[], None] | None,
) -> None:
    """Read and verify every byte, then (every rank verified) change the caller's state and files (collective).

    One function, longer than most: its steps share the reader, the staged files and the caller's
    prepared state, and the try/finally blocks that undo a half-done restore span them."""
    comm, root = session.comm, session.root
    name, manifest = agreed.name, agreed.manifest
    prepared: list[PreparedState] = []  # made inside the read's agreement: one rank's refusal reaches all
    planner = SafeLoadPlanner(allow_partial_load=not request.strict)
    data_dir = root.data_dir(name, manifest)
    topo = session.topo
    reader = GuardedReader(
        session.storage,
        data_dir,
        None,
        manifest.checksum_algorithm,
        comm.rank,
        session.options.io_threads,
        memory_bytes=session.options.load_memory_bytes,
        local_ranks=topo.hosts.count(topo.hosts[topo.rank]),
        domain_count=manifest.domain_count,
    )
    swaps: list[artifacts.RestoreSwap] = []

    def prepare_and_read() -> None:
        with stats.phase("metadata"):
            prepared.append(prepare_state(request.state, comm.rank, for_load=True))
            drop_placeholders(prepared[0], manifest.dcp["state_dict"])
            add_saved_optimizer_state(prepared[0], request.state, manifest.dcp)
        read_locally(
            prepared[0].state_dict,
            reader,
            planner,
            is_coordinator=comm.rank == 0,
            stats=stats,
            before_read=on_planned,
            metadata_for=lambda names: manifest_metadata(session, name, manifest, names),
            whole_reads_for=lambda flat: find_whole_reads(manifest.dcp, manifest.items, flat),
        )

    try:
        with ByteProgress(stats.show_progress, f"loading step {name.step}", None) as bar:
            reader.on_bytes = bar.callback
            # Read and verify; nothing of the caller's state changes in this step.
            comm.step(f"load step {name.step}", prepare_and_read, where=session.url)

        # files= artifacts too: every rank stages verified copies next to their destinations; they
        # replace them only once everything verified.
        def stage() -> None:
            swaps.extend(artifacts.stage_restore(session.storage, targets, manifest, data_dir))

        def place() -> None:
            reader.apply(planner)
            fault_point(FaultPhase.AFTER_PLACE, comm.rank)

        try:
            comm.step(f"restore its files= artifacts from step {name.step}", stage, where=root.dir(name))
            # Every rank verified every byte it needs. The files first: moved back on every rank if
            # one cannot move its own, while nothing of the state has changed yet.
            comm.step(
                f"move its restored files= artifacts of step {name.step} into place",
                lambda: artifacts.swap_in(swaps),
                where=root.dir(name),
            )
            # Now, and only now, the caller's state changes.
            with stats.phase("place"):
                comm.step(f"copy step {name.step} into place", place, where=session.url)
        except BaseException:
            if not reader.applied:
                artifacts.swap_back(swaps)  # the files as they were, the staged copies removed
            raise
    except BaseException:
        if reader.applied:
            # This rank's bytes are in place (a Ctrl-C after them, or another rank's torn read):
            # its state whole, not half (tensors new, objects, optimizers and files old).
            _finish(prepared[0], swaps, stats)
        elif prepared:
            prepared[0].undo()
        raise
    finally:
        reader.close()
    _finish(prepared[0], swaps, stats)
    stats.bytes = manifest.total_item_bytes
    stats.staged_bytes = reader.staged_bytes
    stats.verified_only_bytes = reader.verified_only_bytes
    stats.spilled_bytes = reader.spilled_bytes
    log.debug("ckptguard: loaded step %d: %s", name.step, stats)


def add_saved_optimizer_state(prepared: PreparedState, state: Mapping[str, Any], dcp: Mapping[str, Any]) -> None:
    """Give each optimizer of the template an entry to load into for every parameter the checkpoint holds
    state for and the template's optimizer does not (it never stepped on it yet): DCP plans the
    template's keys only, and that saved state was dropped. Only parameters the template's optimizer
    has (its param_groups name them) are added; the values are placeholders of the stored shape and
    dtype, filled by the read like any other."""
    stored: Mapping[str, Any] = dcp.get("state_dict", {})
    paths: Mapping[str, Any] = dcp.get("planner_data", {})
    for key, value in state.items():
        sd = prepared.state_dict.get(key)
        if not isinstance(value, torch.optim.Optimizer) or not isinstance(sd, dict):
            continue
        params = {
            p
            for g in sd.get("param_groups", [])
            if isinstance(g, dict)
            for p in g.get("params", [])
            if isinstance(p, str)
        }
        template = sd.get("state")
        if not isinstance(template, dict) or "<dict>" in template:  # an empty state, encoded: nothing planned
            continue
        added: dict[str, dict[str, Any]] = {}
        for flat, entry in stored.items():
            path = paths.get(flat)
            if (
                not isinstance(path, list)
                or len(path) != 4
                or path[:2] != [key, "state"]
                or path[2] not in params
                or not isinstance(path[3], str)
                or path[3] in template.get(path[2], {})
            ):
                continue
            if entry.get("type") == "tensor":
                placeholder: Any = torch.empty(entry["size"], dtype=dtype_from_name(entry["dtype"]))
            else:
                placeholder = None
            added.setdefault(path[2], {})[path[3]] = placeholder
        if added:
            merged = dict(template)
            for fqn, entries in added.items():
                merged[fqn] = {**merged.get(fqn, {}), **entries}
            prepared.state_dict[key] = {**sd, "state": merged}


def _finish(prepared: PreparedState, swaps: list[artifacts.RestoreSwap], stats: PhaseTimer) -> None:
    """Once this rank's bytes are in place: the loaded values into modules, optimizers and objects,
    the files the restored ones displaced removed; a Ctrl-C meanwhile is delivered afterwards."""
    with signals_deferred(), stats.phase("apply"):
        prepared.apply()
        artifacts.finish_restore(swaps)
