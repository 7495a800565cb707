"""ckptguard: race-free, crash-safe checkpoints for distributed PyTorch.

    from ckptguard import Checkpointer
    ck = Checkpointer("/shared/ckpts", keep_last=3)
    ck.save(step, {"model": model, "optim": optim})
    step = ck.load({"model": model, "optim": optim})

The checkpoint API is imported on first use, so that `ckptguard diagnose`
starts without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptguard._version import __version__ as __version__
from ckptguard.errors import (
    BucketNotFoundError,
    CheckpointError,
    CommitOutcomeUnknownError,
    CorruptCheckpointError,
    DiskFullError,
    InvalidArgumentError,
    LeaseError,
    LeaseHeldError,
    LeaseLostError,
    MalformedRecordError,
    NotVisibleError,
    PathCollisionError,
    PeerError,
    ReplicatedValueError,
    StaleHandleError,
    StepExistsError,
    StepNotFoundError,
    StepRetiredError,
    StorageError,
    StoragePermissionError,
    TemplateMismatchError,
    TornLoadError,
    UnsafeObjectError,
    UnsupportedStorageError,
    UnsupportedValueError,
    WrongRegionError,
)

if TYPE_CHECKING:
    from ckptguard.checkpointer import Checkpointer
    from ckptguard.interop import DCPReader, export_checkpoint, import_checkpoint
    from ckptguard.rng import RNGState, rng_state, set_rng_state
    from ckptguard.settings import CheckpointerSettings
    from ckptguard.singlefile import load_file, save_file
    from ckptguard.state import PerRank

__all__ = [
    "BucketNotFoundError",
    "CheckpointError",
    "Checkpointer",
    "CheckpointerSettings",
    "CommitOutcomeUnknownError",
    "CorruptCheckpointError",
    "DCPReader",
    "DiskFullError",
    "InvalidArgumentError",
    "LeaseError",
    "LeaseHeldError",
    "LeaseLostError",
    "MalformedRecordError",
    "NotVisibleError",
    "PathCollisionError",
    "PeerError",
    "PerRank",
    "RNGState",
    "ReplicatedValueError",
    "StaleHandleError",
    "StepExistsError",
    "StepNotFoundError",
    "StepRetiredError",
    "StorageError",
    "StoragePermissionError",
    "TemplateMismatchError",
    "TornLoadError",
    "UnsafeObjectError",
    "UnsupportedStorageError",
    "UnsupportedValueError",
    "WrongRegionError",
    "export_checkpoint",
    "import_checkpoint",
    "load_file",
    "rng_state",
    "save_file",
    "set_rng_state",
]

_LAZY = {
    "Checkpointer": "ckptguard.checkpointer",
    "CheckpointerSettings": "ckptguard.settings",
    "PerRank": "ckptguard.state",
    "save_file": "ckptguard.singlefile",
    "load_file": "ckptguard.singlefile",
    "rng_state": "ckptguard.rng",
    "set_rng_state": "ckptguard.rng",
    "RNGState": "ckptguard.rng",
    "DCPReader": "ckptguard.interop",
    "export_checkpoint": "ckptguard.interop",
    "import_checkpoint": "ckptguard.interop",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckptguard' has no attribute {name!r}")
