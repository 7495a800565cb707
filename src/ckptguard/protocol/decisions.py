"""Rank 0's decisions: pure functions from what every rank reported to what every rank does.

Keeping them free of I/O and collectives makes them testable on their own and
measurable at 16,384 simulated ranks (``bench/bench_protocol_scale.py``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ckptguard.errors import StepExistsError
from ckptguard.protocol import artifacts
from ckptguard.protocol.artifacts import ArtifactTarget
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import Artifact, FileEntry, Manifest, StoredItem
from ckptguard.protocol.topology import Topology

Listing = dict[int, int]  # committed step -> its current version, as one storage domain sees it


@dataclass(frozen=True)
class LeaderView:
    """What a domain leader sees of the root before a save."""

    versions: list[int]  # every committed version of the step being saved
    listing: Listing


@dataclass(frozen=True)
class PlanReport:
    """One rank's report for planning a save."""

    targets: list[ArtifactTarget]
    leader_view: LeaderView | None  # domain leaders only


@dataclass(frozen=True)
class PlanDecision:
    attempt: str
    version: int
    uncertain: list[tuple[ArtifactTarget, ArtifactTarget]]  # same path on two hosts: probe
    previous: int | None  # newest agreed step before this save, for error messages


@dataclass
class RankWrites:
    """What one rank wrote, sent to rank 0 for the manifests."""

    files: list[FileEntry] = field(default_factory=list)
    artifacts: list[Artifact] = field(default_factory=list)
    items: list[StoredItem] = field(default_factory=list)  # where each of its items is stored


def intersect(listings: list[Listing]) -> Listing:
    """Steps committed with the same version in every domain."""
    if not listings:
        return {}
    common = set(listings[0].items())
    for other in listings[1:]:
        common &= set(other.items())
    return dict(common)


def agreed_listing(listings: list[Listing | None]) -> Listing:
    """The steps every domain leader reported committed (non-leaders report None)."""
    return intersect([x for x in listings if x is not None])


def decide_plan(root: str, step: int, overwrite: bool, reports: list[PlanReport]) -> PlanDecision:
    """The verdict on a save before anything is written: refused (raises), or its attempt and version."""
    views = [r.leader_view for r in reports if r.leader_view is not None]
    agreed = intersect([v.listing for v in views])
    previous = max(agreed) if agreed else None
    if step in agreed and not overwrite:
        raise StepExistsError(
            f"step {step} is already committed in {root} ({CheckpointName(step, agreed[step]).dirname}); "
            "committed checkpoints are never modified. Pass overwrite=True to replace it atomically.")
    certain, uncertain = artifacts.find_collisions([t for r in reports for t in r.targets])
    if certain:
        raise artifacts.collision_error(*certain[0])
    versions = [v for view in views for v in view.versions]
    version = max(versions) + 1 if versions else 1
    return PlanDecision(uuid.uuid4().hex, version, uncertain, previous)


def retention(agreed: Listing, new_step: int, keep_last: int | None, keep_every: int | None) -> list[int]:
    """Which committed steps to delete now that ``new_step`` is committed everywhere."""
    steps = sorted(agreed)
    if keep_last is None or new_step not in agreed:
        keep = set(steps)
    else:
        keep = set(steps[-keep_last:])
        if keep_every:
            keep |= {s for s in steps if s % keep_every == 0}
        keep.add(new_step)
    return [s for s in steps if s not in keep]


def build_manifests(
    topo: Topology,
    name: CheckpointName,
    attempt: str,
    algorithm: str,
    writes: list[RankWrites],
    user_metadata: dict[str, Any],
    dcp_json: dict[str, Any],
) -> dict[int, Manifest]:
    """One manifest per storage domain, keyed by the domain leader's rank.

    Each domain's manifest lists only the files its ranks wrote (replicated
    tensors were written once per domain), with DCP's metadata shared by all.
    """
    now = time.time()
    out: dict[int, Manifest] = {}
    for index, domain in enumerate(topo.domains):
        items: list[StoredItem] = []
        files: list[FileEntry] = []
        arts: list[Artifact] = []
        for r in domain:
            items.extend(writes[r].items)
            files.extend(writes[r].files)
            arts.extend(writes[r].artifacts)
        out[domain[0]] = Manifest(
            step=name.step, version=name.version, attempt=attempt, created_at=now,
            world_size=topo.world_size, domain_index=index, domain_count=len(topo.domains),
            domain_ranks=list(domain), hosts=list(topo.hosts), checksum_algorithm=algorithm,
            dcp=dcp_json, files=files, items=items, artifacts=arts, user_metadata=user_metadata,
        )
    return out
