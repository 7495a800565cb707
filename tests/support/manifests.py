"""Manifests in tests: one for a root's control plane (one storage domain, one rank, no items), and
a committed item damaged by the byte (its manifest still intact)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

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


def flip_last_byte(root: Path, step: int, fqn: str) -> None:
    """Flip the last byte of item ``fqn`` of step ``step`` (version 1) of the POSIX root ``root``."""
    step_dir = root / f"step-{step:08d}"
    mpath = step_dir / "MANIFEST.json"
    (row,) = [r for r in Manifest.from_json(mpath.read_bytes(), str(mpath)).items if r.fqn == fqn]
    path = step_dir / row.file
    data = bytearray(path.read_bytes())
    data[row.offset + row.length - 1] ^= 0x01  # the last byte of the item
    path.write_bytes(bytes(data))
