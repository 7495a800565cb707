"""The one exception hierarchy of ckptguard."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A save, load or verification that cannot proceed safely.

    ``rank`` is the rank that failed first (None where no single rank is to blame),
    ``path`` the file or directory involved, where one is.
    """

    def __init__(self, message: str, *, rank: int | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.path = path
