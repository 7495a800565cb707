"""Snapshots of a state dict in reused host memory, for saves that return before they are written.

The first async save allocates one host copy of the rank's state (pinned when
CUDA is present, so device-to-host copies run at full speed); later saves copy
into the same buffers. Memory therefore stays at one copy however many saves
run, and the time save() blocks is one memory copy. A state that does not fit
the budget is not staged (the caller saves synchronously instead).
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from ckptguard.dcp._torch_private import create_cpu_state_dict
from ckptguard.protocol.artifacts import ArtifactTarget, FileSnapshot, snapshot_files
from ckptguard.state import state_nbytes


class _Reshaped(Exception):
    """The state no longer matches the host buffers (structure, shape or dtype): allocate anew."""


_PLAIN = (int, float, str, bytes, bool, type(None))
#: Exactly these classes (no subclass: a DTensor or a tensor subclass takes the general path).
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})


class _AsIs:
    """In a device-only buffer set: the value is used as the caller passed it (a host tensor or
    anything that is not a tensor), not copied."""


_AS_IS = _AsIs()


def _on_device(value: Any) -> bool:
    """A CUDA tensor (or DTensor with a CUDA shard): what a DeviceStager copies."""
    if isinstance(value, DTensor):
        return value.to_local().device.type == "cuda"
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


def _device_buffers(src: Any, pin: bool) -> Any:
    """Host buffers for the device tensors of ``src`` alone; ``_AS_IS`` in place of everything else."""
    if isinstance(src, dict):
        return {k: _device_buffers(v, pin) for k, v in src.items()}
    if isinstance(src, list | tuple):
        return [_device_buffers(v, pin) for v in src]
    if _on_device(src):
        return create_cpu_state_dict({"t": src}, pin_memory=pin)["t"]
    return _AS_IS


def has_device_tensors(obj: Any) -> bool:
    if isinstance(obj, dict):
        return any(has_device_tensors(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(has_device_tensors(v) for v in obj)
    return _on_device(obj)


def device_nbytes(obj: Any) -> int:
    if isinstance(obj, dict):
        return sum(device_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(device_nbytes(v) for v in obj)
    return state_nbytes(obj) if _on_device(obj) else 0


def _twin(src: Any, buf: Any, srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> Any:
    """The snapshot of ``src`` in its buffer twin ``buf``: collects the (source, buffer) tensor pairs to
    copy and checks, in the same walk, that every tensor still fits its buffer (one pass over the state,
    so that save() blocks for little more than the copy itself)."""
    if buf is _AS_IS:  # a device-only set: host values are written from where they are
        if _on_device(src) or isinstance(src, dict | list | tuple):
            raise _Reshaped
        return src
    if isinstance(src, DTensor):
        if not isinstance(buf, DTensor):
            raise _Reshaped
        local, into = src.to_local(), buf.to_local()
        if local.shape != into.shape or local.dtype != into.dtype:
            raise _Reshaped
        if into is not local:  # DCP's buffers hold a 0-dim DTensor itself, not a copy
            srcs.append(local)
            dsts.append(into)
        return buf
    if isinstance(src, torch.Tensor):
        if not isinstance(buf, torch.Tensor) or isinstance(buf, DTensor):
            raise _Reshaped
        if src.shape != buf.shape or src.dtype != buf.dtype:
            raise _Reshaped
        srcs.append(src)
        dsts.append(buf)
        return buf
    if isinstance(src, dict):
        if not isinstance(buf, dict) or len(buf) != len(src):
            raise _Reshaped
        out: dict[Any, Any] = {}
        try:
            for k, v in src.items():
                into = buf[k]
                if type(v) in _PLAIN_TENSORS and type(into) is torch.Tensor:  # _twin's tensor case, inline:
                    if v.shape != into.shape or v.dtype != into.dtype:  # ~1 us per tensor less, with
                        raise _Reshaped  # states of 10,000s of them
                    srcs.append(v)
                    dsts.append(into)
                    out[k] = into
                else:
                    out[k] = _twin(v, into, srcs, dsts)
        except KeyError:
            raise _Reshaped from None
        return out
    if isinstance(src, list | tuple):
        if not isinstance(buf, list | tuple) or len(buf) != len(src):
            raise _Reshaped
        items = [_twin(v, b, srcs, dsts) for v, b in zip(src, buf, strict=True)]
        return tuple(items) if isinstance(src, tuple) else items
    if isinstance(src, _PLAIN):
        return src
    return copy.deepcopy(src)  # anything else is the caller's to change once save() returns


def _copy(srcs: list[torch.Tensor], dsts: list[torch.Tensor], streams: dict[torch.device, Any]) -> None:
    """Copy every pair in bulk (one dispatch per device, not one per tensor); device-to-host copies
    run on a side stream of their device, which waits for the work queued so far and is then the only
    thing waited for: training's later kernels keep running."""
    if not srcs:  # a state without tensors (torch's foreach refuses an empty list)
        return
    if all(s.is_cpu for s in srcs):
        torch._foreach_copy_(dsts, srcs)
        return
    by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for s, d in zip(srcs, dsts, strict=True):
        pair = by_device.setdefault(s.device, ([], []))
        pair[0].append(s)
        pair[1].append(d)
    for device, (src_list, dst_list) in by_device.items():
        if device.type == "cuda":
            stream = streams.get(device)
            if stream is None:
                stream = streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                torch._foreach_copy_(dst_list, src_list, non_blocking=True)
            stream.synchronize()
        else:
            torch._foreach_copy_(dst_list, src_list)


def _stage(
    state_dict: dict[str, Any], buffers: Any, allocate: Callable[[], Any], streams: dict[torch.device, Any]
) -> tuple[dict[str, Any], Any] | None:
    """``state_dict`` copied into ``buffers`` where they still fit it, else into what ``allocate()``
    gives (None: not staged); the snapshot and the buffers it lives in."""
    srcs: list[torch.Tensor] = []
    dsts: list[torch.Tensor] = []
    snapshot = None
    if buffers is not None:
        try:
            snapshot = _twin(state_dict, buffers, srcs, dsts)
        except _Reshaped:
            srcs.clear()
            dsts.clear()
    if snapshot is None:
        buffers = None  # the old set freed before a new one is allocated
        buffers = allocate()
        if buffers is None:
            return None
        snapshot = _twin(state_dict, buffers, srcs, dsts)
    with torch.no_grad():
        _copy(srcs, dsts, streams)
    return cast(dict[str, Any], snapshot), buffers


class HostStager:
    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        self._warned_budget = False
        self._buffers: dict[str, Any] | None = None
        self._streams: dict[torch.device, Any] = {}  # side streams of device-to-host copies
        self.allocations = 0  # how many times buffers had to be (re)allocated

    @property
    def buffer_bytes(self) -> int:
        return state_nbytes(self._buffers) if self._buffers is not None else 0

    def fits(self, state_dict: dict[str, Any], extra_bytes: int = 0) -> bool:
        if self.budget_bytes is None:
            return True
        return state_nbytes(state_dict) + extra_bytes <= self.budget_bytes

    def reuse(self, state_dict: dict[str, Any]) -> dict[str, Any] | None:
        """A snapshot into the buffers already allocated, or None where there are none or they no
        longer fit (nothing is allocated: a blocking save then uses the DeviceStager)."""
        staged = _stage(state_dict, self._buffers, lambda: None, self._streams)
        return staged[0] if staged is not None else None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A snapshot of ``state_dict`` in host buffers; training may change the original right after."""

        def allocate() -> Any:
            self._buffers = None  # free the old set before allocating the new one
            buffers = create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self.allocations += 1
            return buffers

        staged = _stage(state_dict, self._buffers, allocate, self._streams)
        assert staged is not None
        snapshot, self._buffers = staged
        return snapshot

    def snapshot(
        self, state_dict: dict[str, Any], targets: list[ArtifactTarget] | None
    ) -> tuple[dict[str, Any], list[Any]] | None:
        """Host copies of the state and of the files= contents (``targets``; None where they could not be
        resolved: that failure is reported by the save), or None if they exceed the budget (with a
        warning, once): the caller then saves synchronously."""
        file_bytes = sum(os.path.getsize(p) for t in targets or [] for p in _artifact_paths(t.path))
        if not self.fits(state_dict, file_bytes):
            if not self._warned_budget:
                self._warned_budget = True
                warnings.warn(
                    f"ckptguard: the state ({state_nbytes(state_dict) + file_bytes:,} bytes) exceeds "
                    f"async_budget_bytes={self.budget_bytes:,}; saving synchronously instead",
                    stacklevel=4,
                )
            return None
        return self.stage(state_dict), stage_files(targets or [])

    def release(self) -> None:
        self._buffers = None


class DeviceStager:
    """Host copies of the device tensors of a state, for a blocking save: one bulk copy per device into
    pinned buffers reused across saves (instead of a pageable ``.cpu()`` per tensor, serialized with
    the writes), host tensors and other values written from where they are. The buffers are one host
    copy of the rank's device tensors, kept while the state's shapes stay the same; a state over
    ``budget_bytes`` (a callable: it reads the memory available when asked) is not staged."""

    def __init__(self, budget_bytes: Callable[[], int]) -> None:
        self._budget_bytes = budget_bytes
        self._buffers: Any = None
        self._streams: dict[torch.device, Any] = {}
        self.allocations = 0

    @staticmethod
    def applies(state_dict: dict[str, Any]) -> bool:
        """Whether the state holds CUDA tensors (a cheap no where CUDA was never initialized)."""
        return bool(torch.cuda.is_initialized()) and has_device_tensors(state_dict)  # type: ignore[no-untyped-call]

    def stage(self, state_dict: dict[str, Any], shared: HostStager) -> dict[str, Any] | None:
        """The state with its device tensors replaced by host copies, or None where it has none or they
        exceed the budget (the writer then copies each tensor as it writes it). The async saves' buffers
        (``shared``) serve where they fit the state: one host copy of it, not two."""
        reused = shared.reuse(state_dict)
        if reused is not None:
            self._buffers = None
            return reused

        def allocate() -> Any:
            self._buffers = None
            if device_nbytes(state_dict) > self._budget_bytes():
                return None
            try:
                buffers = _device_buffers(state_dict, pin=torch.cuda.is_available())
            except (RuntimeError, MemoryError):  # pinned memory refused: the writer copies per tensor
                return None
            self.allocations += 1
            return buffers

        staged = _stage(state_dict, self._buffers, allocate, self._streams)
        if staged is None:
            return None
        snapshot, self._buffers = staged
        return snapshot

    def release(self) -> None:
        self._buffers = None


def stage_files(targets: list[ArtifactTarget]) -> list[FileSnapshot]:
    """The contents of this rank's files= artifacts, read now (they may change once save() returns)."""
    return snapshot_files(targets)


def _artifact_paths(path: str) -> list[str]:
    if os.path.isdir(path):
        return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if os.path.isfile(os.path.join(d, f))]
    return [path] if os.path.isfile(path) else []
