"""Where the data path put each item: the rows a manifest lists (NamedTuples: millions at scale)."""

from __future__ import annotations

from typing import NamedTuple


class StoredItem(NamedTuple):
    """One DCP storage item (a tensor chunk or a serialized object) inside a data file.

    A NamedTuple, not a dataclass: manifests hold one per tensor chunk (millions
    at scale), and tuples are created, pickled and hashed several times faster.
    """

    fqn: str
    offsets: tuple[int, ...] | None  # chunk offsets for tensors, None for objects
    file: str
    offset: int
    length: int
    checksum: str
    dtype: str | None = None  # tensors only
    shape: tuple[int, ...] | None = None  # tensors only: the stored chunk's shape

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None


class FileEntry(NamedTuple):
    """A file of the checkpoint. Data files are covered item by item; artifacts carry their own checksum."""

    path: str
    size: int
    rank: int
    checksum: str | None = None
