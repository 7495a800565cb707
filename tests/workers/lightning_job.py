"""A 2-rank Lightning DDP training run on CPU, checkpointed through ckptguard's CheckpointIO.

    torchrun --nproc-per-node 2 lightning_job.py --root DIR --out FILE [--resume] [--crash-at-save N] [--default-io]

Rank 0 appends JSON lines to FILE: the loss of every step, a digest of the model and
optimizer state at every save, and right after a resume's load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckptguard import _faults
from ckptguard.integrations.lightning import CkptguardCheckpointIO

from tests.support.frameworks import state_digest

warnings.filterwarnings("ignore")




class Net(L.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.out = out

    def record(self, **kw: object) -> None:
        if self.global_rank == 0:
            with open(self.out, "a") as f:
                f.write(json.dumps(kw) + "\n")

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.record(kind="loss", step=self.global_step + 1, loss=float(loss))
        self.log("gstep", float(self.global_step + 1), on_step=False, on_epoch=True, reduce_fx="max")
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.record(kind="save", step=self.global_step, digest=state_digest(self, self.trainer.optimizers[0]))

    def on_train_start(self) -> None:
        if self.global_step:
            self.record(kind="loaded", step=self.global_step, digest=state_digest(self, self.trainer.optimizers[0]))


class CrashingIO(CkptguardCheckpointIO):
    """Kills rank 0 inside its Nth save, after the data is written, before the commit (chosen point)."""

    def __init__(self, crash_at: int) -> None:
        super().__init__()
        self.crash_at, self.saves = crash_at, 0

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.saves += 1
        if self.saves == self.crash_at:
            _faults.arm("before_publish:0:kill")
        super().save_checkpoint(checkpoint, path, storage_options)


def kill_mid_copy_at(n: int) -> None:
    """Lightning's default TorchCheckpointIO: fsspec writes the checkpoint to a temporary file in the
    system temp dir and moves it into place; across filesystems (TMPDIR elsewhere, as on NFS/Lustre)
    the move is copy-then-delete. Kill rank 0 halfway through the copy of its Nth checkpoint."""
    import shutil
    import signal

    real = shutil.move
    calls = [0]

    def move(src, dst, *args, **kwargs):
        if str(dst).endswith(".ckpt"):
            calls[0] += 1
            if calls[0] == n:
                try:
                    os.rename(src, dst)  # what shutil.move tries first: atomic on one filesystem
                except OSError:  # EXDEV: shutil.move copies, then deletes the source
                    with open(src, "rb") as fi, open(dst, "wb") as fo:
                        data = fi.read()
                        fo.write(data[: len(data) // 2])
                        fo.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                return dst
        return real(src, dst, *args, **kwargs)

    shutil.move = move


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--crash-at-save", type=int, default=0)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--default-io", action="store_true", help="Lightning's own TorchCheckpointIO")
    a = p.parse_args()
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8, shuffle=False)
    io: object = CrashingIO(a.crash_at_save) if a.crash_at_save else CkptguardCheckpointIO()
    if a.default_io:
        io = None
        if a.crash_at_save and int(os.environ.get("RANK", "0")) == 0:
            kill_mid_copy_at(a.crash_at_save)
    ckpt = ModelCheckpoint(dirpath=a.root, every_n_epochs=1, save_top_k=2, monitor="gstep", mode="max",
                           save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=a.epochs, plugins=[io] if io else None,
                        callbacks=[ckpt], logger=False, enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True)
    trainer.fit(Net(a.out), data, ckpt_path="last" if a.resume else None)
    if trainer.global_rank == 0:
        with open(a.out, "a") as f:
            f.write(json.dumps({"kind": "done", "files": sorted(os.listdir(a.root)),
                                "best_k": sorted(os.path.basename(k) for k in ckpt.best_k_models)}) + "\n")
    # Tear the process group down before exit: left to interpreter shutdown, gloo's teardown
    # aborted a rank now and then ("terminate called without an active exception") after the work was done.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
    # Leave without the interpreter's own teardown, where torch's gloo threads can abort a rank
    # ("terminate called without an active exception", exit -6) after the work is done and recorded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
