"""ckptguard: race-free, crash-safe checkpoints for distributed PyTorch.

    from ckptguard import Checkpointer
    ck = Checkpointer("/shared/ckpts", keep_last=3)
    ck.save(step, {"model": model, "optim": optim})
    step = ck.load({"model": model, "optim": optim})
"""

from ckptguard.checkpointer import Checkpointer
from ckptguard.errors import CheckpointError, CorruptCheckpointError
from ckptguard.singlefile import load_file, save_file

__all__ = ["CheckpointError", "Checkpointer", "CorruptCheckpointError", "load_file", "save_file"]
__version__ = "0.1.0"
