"""Manifests for tests of a root's control plane: one storage domain, one rank, no items."""

from __future__ import annotations

import time
from collections.abc import Sequence

from ckptguard.protocol.manifest import FileEntry, Manifest


def one_rank_manifest(
    step: int, version: int, attempt: str, files: Sequence[FileEntry] = (), seq: int | None = None
) -> Manifest:
    """The manifest a one-rank save of ``files`` as ``step`` (``version``, ``attempt``) commits;
    its commit sequence number ``seq``, by default the step."""
    return Manifest(
        step=step,
        version=version,
        attempt=attempt,
        created_at=time.time(),
        world_size=1,
        domain_index=0,
        domain_count=1,
        domain_ranks=[0],
        hosts=["h"],
        checksum_algorithm="crc32c",
        dcp={},
        files=list(files),
        items=[],
        commit_seq=step if seq is None else seq,
    )
