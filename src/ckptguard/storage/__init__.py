"""Storage backends: the few primitives the commit protocol needs."""

from ckptguard.storage.posix import PosixStorage

__all__ = ["PosixStorage"]
