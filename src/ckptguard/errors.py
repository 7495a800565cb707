"""The one exception hierarchy of ckptguard."""

from __future__ import annotations

from typing import Any


class CheckpointError(RuntimeError):
    """A save, load or verification that cannot proceed safely.

    ``rank`` is the rank that failed first (None where no single rank is to blame),
    ``path`` the file or directory involved, where one is.
    """

    def __init__(self, message: str, *, rank: int | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors travel between ranks pickled; keep rank and path.
        return (_rebuild, (type(self), str(self), self.rank, self.path))


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint whose bytes do not match its manifest (bit rot, truncation, deletion)."""


def _rebuild(cls: type[CheckpointError], message: str, rank: int | None, path: str | None) -> CheckpointError:
    return cls(message, rank=rank, path=path)
