"""Where one rank of a hung job is, from its stacks and its blocked system call (``classify``).

The states: ``io`` (blocked in a system call on a file), ``collective`` (which one), ``dataloader``,
``device``, ``user`` (its own code), ``unknown`` (no Python stack).
"""

from __future__ import annotations

import os
import re
from typing import Any

_COLLECTIVE_FILES = ("torch/distributed/distributed_c10d.py",)
_DATA_FILES = ("torch/utils/data/",)
_DEVICE_FILES = ("torch/cuda/", "torch/xpu/", "torch/mps/")
_LIBRARY = re.compile(r"/lib/python\d[.\d]*/|<frozen |/site-packages/|/dist-packages/")


def main_thread(threads: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The main thread: the one whose outermost frame is a module's top level (a script's
    ``<module>``, ``runpy``), else the thread that took the signal."""
    tops = [t for t in threads if t[-1]["func"] == "<module>"]
    if tops:
        return tops[0]
    current = [t for t in threads if t[0]["current"]]
    return current[0] if current else (threads[0] if threads else [])


def classify(
    threads: list[list[dict[str, Any]]],
    syscall: str | None,
    path: str | None,
    checkpoints: str | None,
    wchan: str | None = None,
) -> tuple[str, str]:
    """Where a rank is: ``(state, detail)``, state one of ``io``, ``collective``, ``dataloader``,
    ``device``, ``user``, ``unknown`` (no stack). The main thread decides, except that a rank with
    any thread inside a collective (an async save's thread in ckptguard's protocol while the main
    thread waits for it) waits in that collective."""
    frames = main_thread(threads)
    if not frames:
        kernel = f"; blocked in {syscall}()" if syscall else ""
        kernel += f" on {path}" if syscall and path else ""
        kernel += f"; sleeping in the kernel in {wchan}" if wchan else ""
        return "unknown", "no Python stack (not a Python process, or it did not answer the signal)" + kernel
    where = _user_frame(frames)
    at = f"{where['func']} ({where['file']}:{where['line']})"
    in_data = any(any(d in f["file"] for d in _DATA_FILES) for f in frames)
    if syscall is not None and path is not None and path.startswith("/") and not path.startswith("/dev/"):
        ck = " (the checkpoint path)" if is_under(path, checkpoints) or _in_checkpointer(frames) else ""
        loader = ", inside the data loader" if in_data else ""
        return "io", f"blocked in {syscall}() on {path}{ck}{loader}, at {at}"
    for t in [frames] + [t for t in threads if t is not frames]:
        op = _collective(t)
        if op is not None:
            return "collective", op
    if in_data:
        return "dataloader", f"waiting for the next batch of the data loader, at {at}"
    for f in frames:
        if any(d in f["file"] for d in _DEVICE_FILES) or f["func"] in ("synchronize", "cuda_synchronize"):
            return "device", f"in a device call ({f['func']}), at {at}"
    return "user", f"in user code at {at}"


def _collective(frames: list[dict[str, Any]]) -> str | None:
    """The collective a thread waits in, or None."""
    for f in frames:
        if any(c in f["file"] for c in _COLLECTIVE_FILES) and not f["func"].startswith("_") and f["func"] != "wrapper":
            return str(f["func"])
        # DDP's collectives run inside the autograd engine (the gradient all-reduce in backward) and
        # in its forward (buffer broadcast): the Python stack ends there.
        if "torch/autograd/" in f["file"] and f["func"] in ("backward", "_engine_run_backward"):
            return "backward (DDP's gradient all-reduce)"
        if "torch/nn/parallel/distributed.py" in f["file"] and not f["func"].startswith("_"):
            return f"DDP {f['func']}"
    return None


def _in_checkpointer(frames: list[dict[str, Any]]) -> bool:
    return any("ckptguard/" in f["file"] and f["func"] in ("save", "load", "_save_now") for f in frames)


def is_under(path: str, root: str | None) -> bool:
    if not root or "://" in root:
        return False
    try:
        r = os.path.realpath(root)
        return os.path.commonpath([os.path.realpath(path), r]) == r
    except ValueError:
        return False


def _user_frame(frames: list[dict[str, Any]]) -> dict[str, Any]:
    for f in frames:
        if not _LIBRARY.search(f["file"]) and "ckptguard/" not in f["file"]:
            return f
    return frames[0]
