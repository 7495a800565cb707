"""Snapshots of a state dict in reused host memory, for saves that return before they are written.

The first async save allocates one host copy of the rank's state (pinned when
CUDA is present, so device-to-host copies run at full speed); later saves copy
into the same buffers. Memory therefore stays at one copy however many saves
run, and the time save() blocks is one memory copy. A state that does not fit
the budget is not staged (the caller saves synchronously instead).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckptguard.dcp._torch_private import copy_state_dict, create_cpu_state_dict
from ckptguard.protocol.artifacts import ArtifactTarget, FileSnapshot, snapshot_files
from ckptguard.state import state_nbytes


def _signature(obj: Any) -> Any:
    """What must match for buffers to be reused: structure, shapes, dtypes."""
    if isinstance(obj, DTensor):
        return ("D", tuple(obj.to_local().shape), obj.dtype)
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return tuple(_signature(v) for v in obj)
    return None


class HostStager:
    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        self._warned_budget = False
        self._buffers: dict[str, Any] | None = None
        self._signature: Any = None
        self.allocations = 0  # how many times buffers had to be (re)allocated

    @property
    def buffer_bytes(self) -> int:
        return state_nbytes(self._buffers) if self._buffers is not None else 0

    def fits(self, state_dict: dict[str, Any], extra_bytes: int = 0) -> bool:
        if self.budget_bytes is None:
            return True
        return state_nbytes(state_dict) + extra_bytes <= self.budget_bytes

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A snapshot of ``state_dict`` in host buffers; training may change the original right after."""
        sig = _signature(state_dict)
        if self._buffers is None or sig != self._signature:
            self._buffers = None  # free the old set before allocating the new one
            self._buffers = create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._signature = sig
            self.allocations += 1
        snapshot = copy_state_dict(state_dict, self._buffers)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return snapshot

    def snapshot(self, state_dict: dict[str, Any], targets: list[ArtifactTarget] | None
                 ) -> tuple[dict[str, Any], list[Any]] | None:
        """Host copies of the state and of the files= contents (``targets``; None where they could not be
        resolved: that failure is reported by the save), or None if they exceed the budget (with a
        warning, once): the caller then saves synchronously."""
        file_bytes = sum(os.path.getsize(p) for t in targets or [] for p in _artifact_paths(t.path))
        if not self.fits(state_dict, file_bytes):
            if not self._warned_budget:
                self._warned_budget = True
                warnings.warn(f"ckptguard: the state ({state_nbytes(state_dict) + file_bytes:,} bytes) exceeds "
                              f"async_budget_bytes={self.budget_bytes:,}; saving synchronously instead",
                              stacklevel=4)
            return None
        return self.stage(state_dict), stage_files(targets or [])

    def release(self) -> None:
        self._buffers = None
        self._signature = None


def stage_files(targets: list[ArtifactTarget]) -> list[FileSnapshot]:
    """The contents of this rank's files= artifacts, read now (they may change once save() returns)."""
    return snapshot_files(targets)


def _artifact_paths(path: str) -> list[str]:
    if os.path.isdir(path):
        return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if os.path.isfile(os.path.join(d, f))]
    return [path] if os.path.isfile(path) else []
