"""Per-rank artifacts (``files=``): a rank's private files or directory, such as offloaded optimizer state.

Each rank's artifacts are stored under that rank's own namespace in the
checkpoint and restored to the path the rank names on load. Before any byte is
written, the paths of all ranks are checked to be disjoint: two ranks naming one
directory is the DeepSpeed ``offloaded_tensors/`` race, and is refused.
"""

from ckptguard.protocol.artifact_restore import (
    RestoreSwap,
    abort_restore,
    finish_restore,
    stage_restore,
    swap_back,
    swap_in,
)
from ckptguard.protocol.artifact_store import FileSnapshot, snapshot_files, store
from ckptguard.protocol.artifact_targets import (
    ArtifactTarget,
    collision_error,
    collision_message,
    find_collisions,
    normalize,
    probe_anchor,
    probe_shared_paths,
    remove_quietly,
)

__all__ = [
    "ArtifactTarget",
    "FileSnapshot",
    "RestoreSwap",
    "abort_restore",
    "collision_error",
    "collision_message",
    "find_collisions",
    "finish_restore",
    "normalize",
    "probe_anchor",
    "probe_shared_paths",
    "remove_quietly",
    "snapshot_files",
    "stage_restore",
    "store",
    "swap_back",
    "swap_in",
]
