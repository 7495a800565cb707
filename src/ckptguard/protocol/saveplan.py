"""What one save carries from phase to phase: the request, the agreed plan, this rank's writes, the outcome."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptguard.dcp.writer import WriteOutcome
from ckptguard.protocol.artifacts import ArtifactTarget
from ckptguard.protocol.decisions import Listing, RankWrites
from ckptguard.protocol.itemtable import ItemTable
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import Artifact, FileEntry
from ckptguard.protocol.session import Options

#: What a rank's files= artifacts became in the attempt: their records, and their files.
StoredArtifacts = tuple[list[Artifact], list[FileEntry]]


@dataclass(frozen=True)
class SavePlan:
    step: int
    name: CheckpointName
    attempt: str
    staging: str
    targets: list[ArtifactTarget]
    previous: int | None  # newest agreed step before this save, for error messages
    seq: int  # commit sequence number of this save
    quarantined: frozenset[int] = frozenset()  # agreed steps a load found corrupt (retention drops them first)

    @property
    def intact(self) -> str:
        if self.previous is None:
            return " Nothing was committed."
        return f" Nothing was committed; the previous checkpoint, step {self.previous}, is intact."

    def kept_after_failure(self, url: str) -> str:
        """What is true when this leader published the step and could not take it back."""
        return (
            f" Step {self.step} was published in {url} and could not be taken back: it may be committed; "
            f"`ckptguard ls {url}` lists it if it is, `ckptguard verify {url}` checks it."
        )

    def fenced_during_commit(self, url: str) -> str:
        """What is true of the step when this job lost the root during its commit: a leader may have
        published it first (then it is committed, and that leader's message says so)."""
        return (
            f" This job lost the root while committing step {self.step}: unless a storage domain's leader "
            f"says above that it had published it (then it is committed), nothing was committed; "
            f"`ckptguard ls {url}` lists the step if it is."
        )


@dataclass(frozen=True)
class SaveRequest:
    step: int
    state_dict: dict[str, Any]
    targets: list[ArtifactTarget]
    file_items: list[Any]  # the targets themselves, or their contents snapshotted for an async save
    overwrite: bool
    user_metadata: dict[str, Any]
    local_error: BaseException | None  # a local problem found before the save (reported at the plan)
    keep: frozenset[int] = field(default=frozenset(), kw_only=True)  # steps retention keeps whatever the policy
    options: Options = field(kw_only=True)  # the settings at the call, snapshotted (a background save's too)


@dataclass(frozen=True)
class Written:
    """What this rank's write step produced, for the commit: a failure is reported at its first agreement."""

    outcome: WriteOutcome[StoredArtifacts] = field(default_factory=WriteOutcome)  # files, artifacts, items
    digests: dict[str, str] = field(default_factory=dict)  # replicated values' digests (per-rank divergence)
    metadata: Any = None  # DCP's metadata of the whole checkpoint (rank 0 only)
    error: BaseException | None = None

    def report(self) -> RankWrites:
        """This rank's files, artifacts and item table, for the leader's manifests."""
        arts, art_files = self.outcome.before_write or ([], [])
        files = [*self.outcome.files, *art_files]
        return RankWrites(files, arts, ItemTable.from_items(list(self.outcome.stored), [f.path for f in files]))


@dataclass(frozen=True)
class SaveOutcome:
    committed: Listing  # what is committed now, agreed by every rank
    retired: list[str]  # what this leader took out of sight, to be removed in the background
