"""Rank 0's decisions: pure functions from what every rank reported to what every rank does.

Keeping them free of I/O and collectives makes them testable on their own and
measurable at 16,384 simulated ranks (``bench/bench_protocol_scale.py``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from ckptguard.errors import ReplicatedValueError, StepExistsError
from ckptguard.protocol import artifacts
from ckptguard.protocol.artifacts import ArtifactTarget
from ckptguard.protocol.itemtable import ItemTable
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import Artifact, FileEntry, Manifest, StoredItem
from ckptguard.protocol.quarantine import QuarantineRecord
from ckptguard.protocol.topology import Topology

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint as every storage domain agrees on it: the step's current version, and
    its commit sequence number (None: its manifest is damaged, and a load reports it corrupt)."""

    version: int
    seq: int | None


Listing = dict[int, Committed]  # step -> its current version, agreed by every storage domain
DomainListing = dict[int, dict[int, int | None]]  # what one domain's leader sees: step -> {version: seq}


@dataclass(frozen=True)
class LeaderView:
    """What a domain leader sees of the root before a save."""

    versions: list[int]  # every committed version of the step being saved
    listing: DomainListing
    max_seq: int = 0  # the highest commit sequence number this domain has seen (checkpoints and `latest`)
    #: the quarantine records this domain holds (checkpoints a load found corrupt)
    quarantined: dict[CheckpointName, QuarantineRecord] = field(default_factory=dict)


@dataclass(frozen=True)
class PlanReport:
    """One rank's report for planning a save."""

    targets: list[ArtifactTarget]
    leader_view: LeaderView | None  # domain leaders only
    #: the step and overwrite= this rank was called with (every rank must give the same)
    call: tuple[int, bool] | None = None


@dataclass(frozen=True)
class PlanDecision:
    attempt: str
    version: int
    seq: int  # the commit sequence number this save's manifests record
    uncertain: list[tuple[ArtifactTarget, ArtifactTarget]]  # same path on two hosts: probe
    previous: int | None  # newest agreed step before this save, for error messages
    #: agreed steps quarantined (other than the one saved: it is replaced), which retention drops first
    quarantined: frozenset[int] = frozenset()


@dataclass
class RankWrites:
    """What one rank wrote, sent to rank 0 for the manifests."""

    files: list[FileEntry] = field(default_factory=list)
    artifacts: list[Artifact] = field(default_factory=list)
    #: Where each of its items is stored: the rank sends them as an ItemTable (columns), which the
    #: leader joins without a Python object per row.
    items: Sequence[StoredItem] = field(default_factory=list)


def agreed_listing(listings: list[DomainListing | None]) -> Listing:
    """What every domain leader reported committed (non-leaders report None).

    For each step, the newest version present in *every* domain: an overwrite that
    published in some domains and crashed before publishing in the others leaves the
    old version agreed, never the step dropped (*committed is immutable*).
    """
    views = [x for x in listings if x is not None]
    if not views:
        return {}
    out: Listing = {}
    for step, versions in views[0].items():
        common = set(versions)
        for other in views[1:]:
            common &= set(other.get(step, {}))
        if common:
            version = max(common)
            seqs = [v[step][version] for v in views]
            known = [q for q in seqs if q is not None]
            out[step] = Committed(version, max(known) if known else None)
    return out


def quarantined_steps(listing: Listing, records: Sequence[dict[CheckpointName, QuarantineRecord]]) -> dict[int, str]:
    """The steps of ``listing`` whose agreed commit some storage domain holds a quarantine record of
    (a load found it corrupt), with the reason recorded. A record of another version, or of an earlier
    commit of the same name (another sequence number), quarantines nothing."""
    out: dict[int, str] = {}
    for found in records:
        for name, record in found.items():
            committed = listing.get(name.step)
            if committed is not None and committed.version == name.version and record.matches(committed.seq):
                out.setdefault(name.step, record.reason)
    return out


def order_key(step: int, committed: Committed) -> tuple[int, int, int]:
    """Commit order: checkpoints without a sequence number (a damaged manifest) first, by step; then
    every sequenced one by its sequence number."""
    if committed.seq is None:
        return (0, step, 0)
    return (1, committed.seq, step)


def commit_order(listing: Listing) -> list[int]:
    """The committed steps, committed first to committed last (the last is the one to resume)."""
    return sorted(listing, key=lambda s: order_key(s, listing[s]))


def abandoned(listing: Listing) -> set[int]:
    """Steps on an abandoned branch: a checkpoint of a lower step was committed after them (the run
    was rolled back past them, e.g. load(step=100) then saves of 110, 120... while 200, 300 exist)."""
    out: set[int] = set()
    lowest_later: int | None = None
    for step in reversed(commit_order(listing)):
        if lowest_later is not None and step > lowest_later:
            out.add(step)
        lowest_later = step if lowest_later is None else min(lowest_later, step)
    return out


def newest(listing: Listing) -> int | None:
    order = commit_order(listing)
    return order[-1] if order else None


def decide_plan(root: str, step: int, overwrite: bool, reports: list[PlanReport]) -> PlanDecision:
    """The verdict on a save before anything is written: refused (raises), or its attempt and version."""
    calls = {r.call for r in reports if r.call is not None}
    if len(calls) > 1:
        first = reports[0].call
        other = next(i for i, r in enumerate(reports) if r.call is not None and r.call != first)
        call = reports[other].call
        assert first is not None and call is not None
        raise ReplicatedValueError(
            f"save() was called with step={first[0]}, overwrite={first[1]} on rank 0 and step={call[0]}, "
            f"overwrite={call[1]} on rank {other}: every rank must save the same step. Nothing was written.",
            rank=other,
        )
    views = [r.leader_view for r in reports if r.leader_view is not None]
    agreed = agreed_listing([v.listing for v in views])
    previous = newest(agreed)
    quarantined = quarantined_steps(agreed, [v.quarantined for v in views])
    if step in agreed and not overwrite and step not in quarantined:  # a quarantined step is replaced
        raise StepExistsError(
            f"step {step} is already committed in {root} ({CheckpointName(step, agreed[step].version).dirname}); "
            "committed checkpoints are never modified. Pass overwrite=True to replace it atomically."
        )
    certain, uncertain = artifacts.find_collisions([t for r in reports for t in r.targets])
    if certain:
        raise artifacts.collision_error(*certain[0])
    versions = [v for view in views for v in view.versions]
    version = max(versions) + 1 if versions else 1
    # One more than anything any domain has seen: the sequence only grows, also across domains
    # whose listings differ (a leftover of a failed save counts too: it is retired, never reordered).
    seq = max((v.max_seq for v in views), default=0) + 1
    return PlanDecision(uuid.uuid4().hex, version, seq, uncertain, previous, frozenset(quarantined) - {step})


def retention(
    agreed: Listing,
    new_step: int,
    keep_last: int | None,
    keep_every: int | None,
    quarantined: frozenset[int] = frozenset(),
) -> list[int]:
    """Which committed steps to delete now that ``new_step`` is committed everywhere.

    Counted in commit order, not by step number. Checkpoints on an abandoned branch
    (rolled back past) rank below every checkpoint of the current line: ``keep_last``
    keeps the newest of the current line first, and the newest abandoned ones only if
    room is left, so the checkpoint a run was rolled back to outlives the branch it
    abandoned. ``keep_every`` keeps every step that is a multiple of it, on any branch.
    ``quarantined`` steps (a load found them corrupt) rank below both: they never take the
    place of a checkpoint that loads, and ``keep_every`` does not keep them.
    """
    if keep_last is None or new_step not in agreed:
        return []
    order = commit_order(agreed)
    dropped = abandoned(agreed)
    ranked = (
        [s for s in order if s in quarantined]
        + [s for s in order if s in dropped and s not in quarantined]
        + [s for s in order if s not in dropped and s not in quarantined]
    )
    keep = set(ranked[-keep_last:])
    if keep_every:
        keep |= {s for s in order if s % keep_every == 0 and s not in quarantined}
    keep.add(new_step)
    return [s for s in order if s not in keep]


def stray_versions(domain: DomainListing, agreed: Listing) -> list[CheckpointName]:
    """Checkpoint directories of one domain that are not the agreed version of their step.

    Older versions are superseded (every domain has a newer one); newer versions, and
    steps some domains lack, are leftovers of a save that crashed between the domains'
    publishing renames. Only called after a save committed everywhere, under the lease.
    """
    out = []
    for step, versions in domain.items():
        for version in versions:
            if step not in agreed or agreed[step].version != version:
                out.append(CheckpointName(step, version))
    return sorted(out)


def build_manifests(
    topo: Topology,
    name: CheckpointName,
    attempt: str,
    algorithm: str,
    writes: list[RankWrites],
    user_metadata: dict[str, Any],
    dcp: dict[str, Any] | Metadata,
    seq: int | None = None,
) -> dict[int, Manifest]:
    """One manifest per storage domain, keyed by the domain leader's rank.

    Each domain's manifest lists only the files its ranks wrote (replicated
    tensors were written once per domain), with DCP's metadata shared by all:
    ``dcp`` as JSON, or DCP's global Metadata, encoded here with the chunk lists
    of its large tensors taken from the ranks' item tables (see _dcp_json).
    (Eight parameters: each is one field of the manifest from a different phase of the save; a pure
    function, so the bench and the unit tests call it with plain values.)
    """
    now = time.time()
    out: dict[int, Manifest] = {}
    joined: dict[tuple[int, ...], ItemTable] = {}
    domain_files: list[list[FileEntry]] = []
    for domain in topo.domains:
        ranks = list(map(writes.__getitem__, domain))
        domain_files.append(list(chain.from_iterable(map(_FILES, ranks))))
        joined[tuple(domain)] = ItemTable.join(_rank_tables(ranks, domain_files[-1]))
    dcp_json = dcp if isinstance(dcp, dict) else _dcp_json(dcp, writes, joined)
    for index, (domain, files) in enumerate(zip(topo.domains, domain_files, strict=True)):
        arts: list[Artifact] = list(chain.from_iterable(writes[r].artifacts for r in domain))
        items = joined[tuple(domain)]
        out[domain[0]] = Manifest(
            step=name.step,
            version=name.version,
            attempt=attempt,
            created_at=now,
            world_size=topo.world_size,
            domain_index=index,
            domain_count=len(topo.domains),
            domain_ranks=list(domain),
            hosts=list(topo.hosts),
            checksum_algorithm=algorithm,
            dcp=dcp_json,
            files=files,
            items=items,
            artifacts=arts,
            user_metadata=user_metadata,
            commit_seq=seq,
        )
    return out


#: A tensor with fewer chunks than this has its chunk list read from DCP's objects: grouping the
#: items by name costs more than walking a few chunks.
_TABLE_CHUNKS_FROM = 64


def _dcp_json(md: Metadata, writes: list[RankWrites], joined: dict[tuple[int, ...], ItemTable]) -> dict[str, Any]:
    """DCP's global metadata as JSON, byte for byte what ``metadata_to_json(md)`` gives, with the
    chunk lists of tensors of many chunks (a tensor sharded over every rank) built from the items
    the ranks stored, in rank order, instead of from a million ChunkStorageMetadata objects.

    Why the two agree: DCP's metadata lists a tensor's chunks plan by plan in rank order (its
    global plan after de-duplication), and each rank stores one item per write item of its final
    plan, with the chunk's offsets and the written tensor's shape (the chunk's sizes). Where there
    is one storage domain the stored items are exactly the de-duplicated plan items; with several,
    replicated items are also stored once more per domain, so a tensor's items outnumber its
    chunks. metadata_to_json takes a tensor's list from the items only where their count is DCP's
    count of chunks, each rank holds at most one of them (a rank's own order is not kept by the
    writer) and each has as many offsets and sizes as the tensor has dimensions; any other tensor's
    chunks are read from DCP's objects."""
    from ckptguard.dcp.codec import metadata_to_json

    everyone = tuple(range(len(writes)))
    table = joined.get(everyone)
    if table is None:  # several domains: every rank's items, in rank order
        table = ItemTable.join(_rank_tables(writes, list(chain.from_iterable(map(_FILES, writes)))))
    known = table.flat_chunks(list(map(len, map(_ITEMS, writes))), _TABLE_CHUNKS_FROM)
    return metadata_to_json(md, known)


_FILES, _ITEMS, _PATH, _PATHS = attrgetter("files"), attrgetter("items"), attrgetter("path"), attrgetter("paths")


def _rank_tables(ranks: list[RankWrites], files: list[FileEntry]) -> list[ItemTable]:
    """Each rank's rows as a table whose file indices point into that rank's files. The tables ranks
    send are used as they are when each lists exactly its rank's files, checked for the whole domain
    at once (per-table work is what counts at 16,384 ranks); any other rows are made into tables."""
    tables = list(map(_ITEMS, ranks))
    if (
        all(map(isinstance, tables, repeat(ItemTable)))
        and list(map(len, map(_PATHS, tables))) == list(map(len, map(_FILES, ranks)))
        and list(chain.from_iterable(map(_PATHS, tables))) == list(map(_PATH, files))
    ):
        return tables
    return [ItemTable.from_items(w.items, [f.path for f in w.files]) for w in ranks]
