"""ckptguard: race-free, crash-safe checkpoints for distributed PyTorch."""

from ckptguard.errors import CheckpointError

__all__ = ["CheckpointError"]
__version__ = "0.1.0"
