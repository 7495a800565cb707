"""A Ctrl-C that lands the instant a file is opened leaks no descriptor, whichever open it follows.

Python runs a signal handler right after a builtin call returns: a KeyboardInterrupt raised as
``os.open`` hands back its descriptor dropped the only reference to it, one descriptor leaked per
interrupted save or load, unless the descriptor is owned at once. Each test
interrupts the k-th ``os.open`` of a save or a load, for every k that operation reaches.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptguard import Checkpointer
from ckptguard.storage import open_storage

_real_open = os.open


def _fds() -> set[int]:
    gc.collect()  # objects that own a descriptor and were dropped close it when collected
    return {int(name) for name in os.listdir("/proc/self/fd")}


def _interrupting_nth_open(n: int, opened: list[str]) -> Callable[..., int]:
    def fake_open(path: str | os.PathLike[str], flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        fd = _real_open(path, flags, mode, dir_fd=dir_fd)
        if threading.current_thread() is not threading.main_thread():
            return fd  # a Ctrl-C is handled in the main thread only
        opened.append(os.fspath(path))
        if len(opened) == n:
            signal.raise_signal(signal.SIGINT)  # handled as this call returns, like a Ctrl-C just then
        return fd

    return fake_open


def _state(seed: float) -> dict[str, object]:
    return {"model": {f"w{i}": torch.full((64,), seed + i) for i in range(6)}, "meta": {"seed": seed}}


def _interrupt_every_open(monkeypatch: pytest.MonkeyPatch, operation: Callable[[int, Callable[[], None]], None]) -> int:
    """Run ``operation(n, arm)`` once per os.open it reaches after calling ``arm()``, interrupted right
    after that open (its Checkpointer closed before the descriptors are counted); returns how many."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        n = 0
        while True:
            n += 1
            opened: list[str] = []
            before = _fds()
            interrupted = False
            fake = _interrupting_nth_open(n, opened)
            try:
                operation(n, lambda fake=fake: monkeypatch.setattr(os, "open", fake))
            except KeyboardInterrupt:
                interrupted = True
            finally:
                monkeypatch.setattr(os, "open", _real_open)
            leaked = _fds() - before
            for _ in range(30):  # a leak stays; a descriptor another thread holds for a moment does not
                if not leaked:
                    break
                time.sleep(0.1)
                leaked = _fds() - before
            assert not leaked, f"interrupted after open #{n} ({opened[n - 1]}): descriptors leaked: " + ", ".join(
                f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}"
                for fd in sorted(leaked)
                if os.path.exists(f"/proc/self/fd/{fd}")
            )
            if not interrupted:
                return n - 1  # the operation opened fewer than n files: every one was interrupted once
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_right_after_any_open_of_a_save_leaks_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def save(n: int, arm: Callable[[], None]) -> None:
        ck = Checkpointer(tmp_path / f"ck{n}", process_group="local", lease_ttl_s=600)
        try:
            ck.save(1, _state(1.0))  # a step before: the save of step 2 lists and keeps it
            arm()
            ck.save(2, _state(2.0))
        finally:
            monkeypatch.setattr(os, "open", _real_open)
            ck.close()

    assert _interrupt_every_open(monkeypatch, save) >= 3  # the data file, the manifest, the commit at least


def test_a_ctrl_c_right_after_any_open_of_a_load_leaks_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Checkpointer(tmp_path / "ck", process_group="local") as ck:
        ck.save(1, _state(1.0))

    def load(n: int, arm: Callable[[], None]) -> None:
        reader = Checkpointer(tmp_path / "ck", read_only=True, process_group="local", lease_ttl_s=600)
        try:
            arm()
            reader.load(_state(0.0), step=1)
        finally:
            monkeypatch.setattr(os, "open", _real_open)
            reader.close()

    assert _interrupt_every_open(monkeypatch, load) >= 2


@pytest.mark.parametrize("kind", ["write", "read"])
def test_a_handle_dropped_by_a_ctrl_c_before_its_owner_holds_it_closes_its_descriptor(
    tmp_path: Path, kind: str
) -> None:
    """The descriptor belongs to a FileIO from the instant it exists: however the handle is dropped,
    it is closed by C code that no second Ctrl-C can interrupt (a Python __del__ can be, leaving the
    descriptor open for good)."""
    storage = open_storage(tmp_path)
    (tmp_path / "existing").write_bytes(b"x" * 100)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    before = _fds()
    try:
        with pytest.raises(KeyboardInterrupt):
            handle = (
                storage.open_new(str(tmp_path / "new"))
                if kind == "write"
                else storage.open_read(str(tmp_path / "existing"))
            )
            signal.raise_signal(signal.SIGINT)  # before anyone owns the handle: dropped with the frame
            handle.close()
    finally:
        signal.signal(signal.SIGINT, previous)
    del handle
    assert not _fds() - before
