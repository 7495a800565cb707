"""Names on disk. One place decides what a committed checkpoint, an attempt and the pointer are called.

ROOT/
  step-00000100/             committed step 100 (renamed into place from staging)
    MANIFEST.json            files, sizes, checksums, DCP metadata (JSON, never pickle)
    data/rank00003_0.bin     tensor and object bytes written by rank 3
    files/rank00003/<key>/   rank 3's private artifacts (files=)
  step-00000100.v2/          the same step saved again with overwrite=True (newest version wins)
  latest                     JSON pointer to the newest committed checkpoint (a hint for tools)
  tags/<name>                JSON: a name pinned to a committed step
  .ckptguard/
    lease.json               which job may write to this root (fencing)
    index.json               object stores: every attempt and its state (the catalog; epoch = fence)
    staging/step-00000100.<attempt>/   attempts in progress or abandoned
    trash/                   checkpoints being deleted (invalidated first, then removed)
    probe/                   storage-domain probes
    root-id                  the root's stable identity, created once (what pointers bind to)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MANIFEST = "MANIFEST.json"
LATEST = "latest"
CONTROL = ".ckptguard"
STAGING = f"{CONTROL}/staging"
TRASH = f"{CONTROL}/trash"
PROBE = f"{CONTROL}/probe"
LEASE = f"{CONTROL}/lease.json"
INDEX = f"{CONTROL}/index.json"
ROOT_ID = f"{CONTROL}/root-id"
TAGS = "tags"
DATA_DIR = "data"
FILES_DIR = "files"

_COMMITTED_RE = re.compile(r"^step-(\d{8,})(?:\.v(\d+))?$")
_STAGING_RE = re.compile(r"^step-(\d{8,})\.([0-9a-f]{16,})$")


@dataclass(frozen=True, order=True)
class CheckpointName:
    """A committed checkpoint directory: step and version (1 for the first save of a step)."""

    step: int
    version: int = 1

    @property
    def dirname(self) -> str:
        base = f"step-{self.step:08d}"
        return base if self.version == 1 else f"{base}.v{self.version}"

    @staticmethod
    def parse(name: str) -> CheckpointName | None:
        m = _COMMITTED_RE.match(name)
        if m is None:
            return None
        version = int(m.group(2)) if m.group(2) else 1
        if version < 1 or (m.group(2) is not None and version == 1):
            return None
        return CheckpointName(int(m.group(1)), version)


def staging_dirname(step: int, attempt: str) -> str:
    return f"step-{step:08d}.{attempt}"


def parse_staging(name: str) -> tuple[int, str] | None:
    m = _STAGING_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def data_file(rank: int, index: int) -> str:
    return f"{data_file_prefix(rank)}{index}.bin"


def data_file_prefix(rank: int) -> str:
    """The start of the names of every data file written by ``rank``."""
    return f"{DATA_DIR}/rank{rank:05d}_"


def artifact_prefix(rank: int, key: str) -> str:
    return f"{FILES_DIR}/rank{rank:05d}/{key}"


def newest_versions(names: list[CheckpointName]) -> dict[int, CheckpointName]:
    """The current (highest) version of each step."""
    out: dict[int, CheckpointName] = {}
    for n in names:
        if n.step not in out or n.version > out[n.step].version:
            out[n.step] = n
    return out


def is_plain_relpath(path: str) -> bool:
    """Whether ``path`` (a path a record names inside a checkpoint) is in its one canonical form:
    relative, ``/``-separated, with no empty, ``.`` or ``..`` part, no backslash and no NUL. A record
    can name a file only one way, so ``verify`` (which compares names with what is on disk) and
    ``load`` (which opens the name) see the same file, and no name leads out of the checkpoint."""
    return all(part not in ("", ".", "..") for part in path.split("/")) and "\\" not in path and "\0" not in path


def is_plain_name(name: str) -> bool:
    """Whether ``name`` is one canonical path part (a file directly in a directory)."""
    return is_plain_relpath(name) and "/" not in name
