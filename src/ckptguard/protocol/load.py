"""One load, phase by phase, and the fallback to an older checkpoint when the newest is corrupt.

    manifest  each domain's leader reads its manifest; every rank of the domain
              parses and checks the same bytes; the leader checks file sizes
    targets   files= destinations gathered, collisions refused
    read      DCP plans (resharding included), our reader reads and verifies
    restore   files= artifacts staged next to their destinations, verified,
              then all renamed into place once every rank staged its own
    apply     loaded values pushed into modules, optimizers and objects
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from ckptguard.comm import agreed_failures, hostname
from ckptguard.dcp.codec import metadata_from_json
from ckptguard.dcp.drive import read_locally
from ckptguard.dcp.planners import SafeLoadPlanner
from ckptguard.dcp.reader import GuardedReader
from ckptguard.errors import CheckpointError, CorruptCheckpointError
from ckptguard.progress import ByteProgress
from ckptguard.protocol import artifacts, layout
from ckptguard.protocol.artifacts import ArtifactTarget
from ckptguard.protocol.decisions import Listing
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import Manifest
from ckptguard.protocol.session import Session
from ckptguard.protocol.timing import PhaseTimer
from ckptguard.state import prepare_state

log = logging.getLogger("ckptguard")


def falls_back(err: BaseException) -> bool:
    """Whether a failed load may try an older checkpoint: decided from what every rank agreed on,
    so that all ranks take the same branch (never on an interrupt)."""
    failures = agreed_failures(err)
    if not failures or any(f.interrupted for f in failures):
        return False
    return any(issubclass(f.error_class, CorruptCheckpointError) for f in failures)


def load_first_intact(session: Session, candidates: list[int], current: Listing, state: Mapping[str, Any],
                      files: Mapping[str, Any] | None, strict: bool, fallback: bool,
                      show_progress: bool) -> tuple[int | None, PhaseTimer | None]:
    """Load the first candidate that is intact; its step (None if there was none) and its timings."""
    errors: list[str] = []
    for s in candidates:
        stats = PhaseTimer(show_progress)
        try:
            load_one(session, CheckpointName(s, current[s].version), current[s].seq, state, files, strict, stats)
            return s, stats
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


def load_one(session: Session, name: CheckpointName, seq: int | None, state: Mapping[str, Any],
             files: Mapping[str, Any] | None, strict: bool, stats: PhaseTimer) -> None:
    comm, topo, root = session.comm, session.topo, session.root
    started = time.perf_counter()
    raw: bytes | None = None
    read_error: BaseException | None = None
    if topo.is_leader:
        try:
            raw = root.read_manifest_bytes(name)
        except BaseException as e:  # reported at the next agreement, once every rank of the domain has the bytes
            read_error = e
    # The leader reads; every rank of the domain parses and checks the same bytes at once
    # (bytes travel far faster than a pickled object graph of one entry per tensor chunk).
    raw = comm.share_in_domain(raw, list(topo.domain))
    stop_prefetch: Callable[[], None] | None = None
    if raw is not None:
        # A rank mostly reads what the rank of its number wrote: warm those files while the manifest
        # is checked and the load planned, and stop once the real reads start.
        prefix = layout.data_file_prefix(comm.rank)
        stop_prefetch = session.storage.prefetch(os.path.join(root.dir(name), os.path.dirname(prefix)),
                                                 os.path.basename(prefix))
    try:
        _load_from_manifest(session, name, seq, raw, read_error, state, files, strict, stats, started,
                            stop_prefetch)
    finally:
        if stop_prefetch is not None:
            stop_prefetch()


def _load_from_manifest(session: Session, name: CheckpointName, seq: int | None, raw: bytes | None,
                        read_error: BaseException | None,
                        state: Mapping[str, Any], files: Mapping[str, Any] | None, strict: bool, stats: PhaseTimer,
                        started: float, on_planned: Callable[[], None] | None) -> None:
    comm, topo, root = session.comm, session.topo, session.root

    def parse() -> Manifest:
        if read_error is not None:
            raise read_error
        assert raw is not None
        manifest = root.parse_manifest(name, raw, seq)
        if topo.is_leader:
            root.check_files(name, manifest)
        return manifest

    manifest: Manifest = comm.step(f"read checkpoint {name.dirname} in {session.url}", parse, where=session.url)

    targets: list[ArtifactTarget] = []

    def destinations() -> list[ArtifactTarget]:
        targets.extend(artifacts.normalize(files, comm.rank, hostname(), must_exist=False))
        if targets and manifest.world_size != comm.world_size:
            raise CheckpointError(
                f"step {name.step} was saved by {manifest.world_size} ranks and this job has "
                f"{comm.world_size}: per-rank files= artifacts cannot be resharded", rank=comm.rank)
        return targets

    def refuse_collisions(gathered: list[list[ArtifactTarget]]) -> None:
        certain, _ = artifacts.find_collisions([t for g in gathered for t in g])
        if certain:
            raise artifacts.collision_error(*certain[0], where="on restore")

    comm.step(f"load step {name.step}", destinations, refuse_collisions)
    stats.seconds["manifest"] = time.perf_counter() - started
    with stats.phase("metadata"):
        metadata = metadata_from_json(manifest.dcp, manifest.items)
        prepared = prepare_state(state, comm.rank)
    with ByteProgress(stats.show_progress, f"loading step {name.step}", None) as bar:
        reader = GuardedReader(session.storage, root.dir(name), metadata, manifest.checksum_algorithm, comm.rank,
                               session.options.io_threads, on_bytes=bar.callback)
        comm.step(f"load step {name.step}", lambda: read_locally(
            prepared.state_dict, reader, SafeLoadPlanner(allow_partial_load=not strict),
            is_coordinator=comm.rank == 0, stats=stats, before_read=on_planned), where=session.url)
    # files= artifacts in two phases: every rank stages verified copies, then all rename them
    # into place, so a corrupt artifact anywhere changes nothing before load falls back.
    staged: list[tuple[str, str]] = []

    def stage() -> None:
        staged.extend(artifacts.stage_restore(session.storage, targets, manifest, root.dir(name)))

    try:
        comm.step(f"restore its files= artifacts from step {name.step}", stage, where=root.dir(name))
    except BaseException:
        artifacts.abort_restore(staged)
        raise
    comm.step(f"move its restored files= artifacts of step {name.step} into place",
              lambda: artifacts.commit_restore(staged), where=root.dir(name))
    with stats.phase("apply"):
        prepared.apply()
    stats.bytes = sum(i.length for i in manifest.items)
    log.debug("ckptguard: loaded step %d: %s", name.step, stats)
