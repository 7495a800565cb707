"""Checksums of stored bytes.

xxh3-64 is the default: measured here at ~30 GB/s on one core against ~16 GB/s
for crc32c (both release the GIL), and both are far faster than any disk.
crc32c stays available because S3 computes and checks it natively.
"""

from __future__ import annotations

from collections.abc import Callable

import crc32c
import xxhash

Buffer = bytes | bytearray | memoryview

DEFAULT_ALGORITHM = "xxh3-64"


class Hasher:
    """Incremental checksum; ``hexdigest()`` is what manifests store."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        if algorithm == "xxh3-64":
            self._x = xxhash.xxh3_64()
            self._crc: int | None = None
        elif algorithm == "crc32c":
            self._crc = 0
        else:
            raise ValueError(f"unknown checksum algorithm {algorithm!r}; use 'xxh3-64' or 'crc32c'")

    def update(self, data: Buffer) -> None:
        if self._crc is None:
            self._x.update(data)
        else:
            self._crc = crc32c.crc32c(data, value=self._crc)

    def hexdigest(self) -> str:
        return self._x.hexdigest() if self._crc is None else f"{self._crc:08x}"


def _xxh3(data: Buffer) -> str:
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def _crc32c(data: Buffer) -> str:
    return f"{crc32c.crc32c(data):08x}"


_ONE_SHOT: dict[str, Callable[[Buffer], str]] = {"xxh3-64": _xxh3, "crc32c": _crc32c}
ALGORITHMS = tuple(_ONE_SHOT)


def checksum(algorithm: str, data: Buffer) -> str:
    try:
        fn = _ONE_SHOT[algorithm]
    except KeyError:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; use one of {ALGORITHMS}") from None
    return fn(data)
