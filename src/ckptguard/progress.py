"""A progress bar for long saves and loads (rich, on stderr, rank 0 only, off unless asked)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


class ByteProgress:
    """Counts bytes from I/O threads; a no-op when disabled."""

    def __init__(self, enabled: bool, description: str, total: int | None) -> None:
        self._progress: Progress | None = None
        self._lock = threading.Lock()
        if enabled:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._task = self._progress.add_task(description, total=total)

    def __enter__(self) -> ByteProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def advance(self, n: int) -> None:
        if self._progress is not None:
            with self._lock:
                self._progress.advance(self._task, n)

    @property
    def callback(self) -> Callable[[int], None] | None:
        return self.advance if self._progress is not None else None
