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
    CheckpointError,
    CorruptCheckpointError,
    DiskFullError,
    LeaseError,
    LeaseHeldError,
    LeaseLostError,
    NotVisibleError,
    PathCollisionError,
    PeerError,
    StaleHandleError,
    StepExistsError,
    StepNotFoundError,
    StepRetiredError,
    StorageError,
    StoragePermissionError,
    TornLoadError,
    UnsafeObjectError,
    UnsupportedStorageError,
)

if TYPE_CHECKING:
    from ckptguard.checkpointer import Checkpointer
    from ckptguard.singlefile import load_file, save_file
    from ckptguard.state import PerRank

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "CorruptCheckpointError",
    "DiskFullError",
    "LeaseError",
    "LeaseHeldError",
    "LeaseLostError",
    "NotVisibleError",
    "PathCollisionError",
    "PeerError",
    "PerRank",
    "StaleHandleError",
    "StepExistsError",
    "StepNotFoundError",
    "StepRetiredError",
    "StorageError",
    "StoragePermissionError",
    "TornLoadError",
    "UnsafeObjectError",
    "UnsupportedStorageError",
    "load_file",
    "save_file",
]

_LAZY = {"Checkpointer": "ckptguard.checkpointer", "PerRank": "ckptguard.state", "save_file": "ckptguard.singlefile",
         "load_file": "ckptguard.singlefile"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckptguard' has no attribute {name!r}")
