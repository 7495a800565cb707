"""A Ctrl-C as a save hands the removal of retired steps to its thread leaves close() waiting for it.

A KeyboardInterrupt inside the thread pool's bookkeeping (its worker started, not yet recorded) must
not leave a removal that close() does not wait for: run once the lease is released, it finds the lease
file gone and removes nothing ("this job no longer holds the lease"), leaving the retired step behind.
"""

from __future__ import annotations

import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ckptguard import Checkpointer


class _InterruptedAsRecorded(set):  # type: ignore[type-arg]
    """The pool's set of workers: a Ctrl-C arrives as the new worker is recorded."""

    def add(self, thread: object) -> None:
        signal.raise_signal(signal.SIGINT)
        super().add(thread)


def test_a_ctrl_c_as_the_removal_of_retired_steps_starts_leaves_close_waiting_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    state = {"w": torch.arange(16.0)}
    ck = Checkpointer(tmp_path / "ck", process_group="local", keep_last=1)
    ck.save(1, state)
    removed: list[str] = []
    root = ck._session.root
    real_remove = root.remove_retired

    def slow_remove(path: str) -> None:  # the removal still runs when close() is called
        time.sleep(0.5)
        real_remove(path)
        removed.append(path)

    monkeypatch.setattr(root, "remove_retired", slow_remove)
    ck._saves.cleaner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptguard-cleanup")  # no idle worker
    ck._saves.cleaner._threads = _InterruptedAsRecorded()  # type: ignore[attr-defined]
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with caplog.at_level(logging.WARNING, logger="ckptguard"), pytest.raises(KeyboardInterrupt):
            ck.save(2, state)
        ck.close()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert removed, "close() returned before the removal of the retired step ran"
    assert "no longer holds the lease" not in caplog.text
    assert not (tmp_path / "ck" / "step-00000001").exists()
    with Checkpointer(tmp_path / "ck", read_only=True, process_group="local") as reader:
        into = {"w": torch.zeros(16)}
        assert reader.load(into) == 2 and torch.equal(into["w"], state["w"])
