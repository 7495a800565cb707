"""One committed step out to the rest of the ecosystem: a ``torch.save`` file, ``.safetensors`` or plain DCP.

The CLI's ``ckptguard export`` (:func:`export_checkpoint`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from ckptguard.checksum import DEFAULT_ALGORITHM
from ckptguard.errors import (
    CheckpointError,
)
from ckptguard.interop.reader import read_checkpoint
from ckptguard.storage import local_path

EXPORT_FORMATS = ("torch", "safetensors", "dcp")


def flatten_tensors(state: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every tensor of a nested state as ``a.b.c`` names; and the names of what is not a tensor."""
    tensors: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    if isinstance(state, torch.Tensor):
        tensors[prefix] = state
    elif isinstance(state, dict):
        for k, v in state.items():
            t, s = flatten_tensors(v, f"{prefix}.{k}" if prefix else str(k))
            tensors.update(t)
            skipped.extend(s)
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            t, s = flatten_tensors(v, f"{prefix}.{i}" if prefix else str(i))
            tensors.update(t)
            skipped.extend(s)
    else:
        skipped.append(prefix)
    return tensors, skipped


def export_checkpoint(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    to: str,
    *,
    step: int | None = None,
    key: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Write one committed step as ``to`` ("torch", "safetensors" or "dcp") to ``out``.

    The CLI's ``ckptguard export``. Every byte is verified as it is read.

    Args:
        path: A root (a path, ``file://`` or ``s3://bucket/prefix``) or one committed step's directory.
        out: A local path: the file (``torch``, ``safetensors``) or directory (``dcp``) to write.
        to: ``"torch"``: a ``save_file`` (a ``torch.save`` zip, checksummed; ``torch.load`` and
            ``load_file`` read it; numpy values stay numpy arrays, which only
            ``torch.load(..., weights_only=False)`` reads). ``"safetensors"``: the tensors, named
            ``a.b.c``. ``"dcp"``: a plain DCP directory (``.metadata`` + ``.distcp``) that ``dcp.load``
            and ``dcp_to_torch_save`` read.
        step: The step to export from a root; default: the one committed last.
        key: Export one entry of the state (e.g. ``"model"``).
        storage_options: Options of the storage backend.

    Returns:
        The names of the values left out (non-tensor values, for ``safetensors``).

    Raises:
        StepNotFoundError: ``step`` is not committed in the root.
        CorruptCheckpointError: A byte of the step does not match its checksum.
        ValueError: ``to`` is not one of the three formats.
        KeyError: ``key`` is not in the state.
        CheckpointError: ``out`` is a directory that is not empty (``dcp``).
    """
    from ckptguard.singlefile import save_file, save_local

    if to not in EXPORT_FORMATS:
        raise ValueError(f"to must be one of {EXPORT_FORMATS}, not {to!r}")
    state = read_checkpoint(path, step, decode=to != "dcp", storage_options=storage_options)
    if key is not None:
        if key not in state:
            raise KeyError(f"no {key!r} in the checkpoint; its keys: {sorted(state)}")
        state = state[key] if isinstance(state[key], dict) else {key: state[key]}
    out = os.path.abspath(local_path(out))
    if to == "torch":  # for plain torch.load: numpy values stay numpy, as saved
        save_local(state, out, "torch", DEFAULT_ALGORITHM, loadable=False)
        return []
    if to == "safetensors":
        tensors, skipped = flatten_tensors(state)
        save_file(tensors, out, format="safetensors")
        return skipped
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    if os.path.exists(out) and os.listdir(out):
        raise CheckpointError(f"{out} exists and is not empty: choose a new directory for the DCP export", path=out)
    dcp_save(state, storage_writer=FileSystemWriter(out), no_dist=True)
    return []
