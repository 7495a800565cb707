"""A 2-rank Lightning training run on CPU (gloo): DDP, or FSDP2 (ModelParallelStrategy, ``fully_shard``).

    torchrun --nproc-per-node 2 lightning_job.py --root DIR --out PREFIX [--strategy ddp|fsdp2]
                                                 [--resume] [--crash-at-save N] [--lightning-own]

Checkpointed through ckptguard: under ``ddp`` its CkptguardCheckpointIO, under ``fsdp2`` its
CkptguardModelParallelStrategy. With ``--lightning-own``, through Lightning's own saving instead:
TorchCheckpointIO (one file), or ModelParallelStrategy's sharded save (DCP into ``DIR/<name>.ckpt/``).
``--crash-at-save N`` kills rank 0 inside its Nth save, at a point chosen per way of saving.

Each rank appends JSON lines to PREFIX.rank<N>.jsonl: its loss at every step, a digest of its model and
optimizer state (under FSDP2 its own shards) at every save and right after a resume's load; rank 0
ends with a ``done`` record of the files in DIR and ModelCheckpoint's top-k.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from ckptguard import _faults
from ckptguard.integrations.lightning import CkptguardCheckpointIO, CkptguardModelParallelStrategy

from tests.support.frameworks import run_worker, state_digest

warnings.filterwarnings("ignore")


class Net(L.LightningModule):
    def __init__(self, out: str, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.out = out

    def record(self, **kw: object) -> None:
        with open(f"{self.out}.rank{self.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(kw) + "\n")

    def digest(self) -> str:
        return state_digest(self, self.trainer.optimizers[0])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.record(kind="loss", step=self.global_step + 1, loss=float(loss))
        self.log("gstep", float(self.global_step + 1), on_step=False, on_epoch=True, reduce_fx="max")
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.record(kind="save", step=self.global_step, digest=self.digest())

    def on_train_start(self) -> None:
        if self.global_step:
            self.record(kind="loaded", step=self.global_step, digest=self.digest())


class ShardedNet(Net):
    """FSDP2: ``fully_shard`` on each layer and on the whole over the data-parallel mesh."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


# -- DDP: the kills inside a save ------------------------------------------------------------------
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


# -- FSDP2: the kills inside a sharded save --------------------------------------------------------
class CrashingStrategy(CkptguardModelParallelStrategy):
    """Kills rank 0 inside its Nth save: every rank's shards are written, the commit is not (chosen point)."""

    def __init__(self, crash_at: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.crash_at, self.saves = crash_at, 0

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        self.saves += 1
        if self.saves == self.crash_at:
            _faults.arm("before_publish:0:kill")
        super().save_checkpoint(checkpoint, filepath, storage_options)


def kill_in_dcp_finish_at(n: int) -> None:
    """Lightning's own sharded save: DCP writes every rank's shard file, gathers the results on rank 0,
    and rank 0 writes ``.metadata`` in FileSystemWriter.finish; then Lightning's rank 0 writes
    ``meta.pt``. Kill rank 0 on entering its Nth finish: every shard file is written, ``.metadata``
    and ``meta.pt`` are not (the same point as ckptguard's before_publish)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    real = FileSystemWriter.finish
    calls = [0]

    def finish(self, metadata, results):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, metadata, results)

    FileSystemWriter.finish = finish


def ddp(crash_at: int, lightning_own: bool) -> dict:
    """Trainer arguments for DDP: a 4→8→1 MLP, ckptguard's CheckpointIO or Lightning's own."""
    if lightning_own:
        if crash_at and int(os.environ.get("RANK", "0")) == 0:
            kill_mid_copy_at(crash_at)
        return {"strategy": "ddp", "plugins": None}
    return {"strategy": "ddp", "plugins": [CrashingIO(crash_at) if crash_at else CkptguardCheckpointIO()]}


def fsdp2(crash_at: int, lightning_own: bool) -> dict:
    """Trainer arguments for FSDP2 over 2 data-parallel ranks: ckptguard's strategy or Lightning's own."""
    sizes = {"data_parallel_size": 2, "tensor_parallel_size": 1}
    if lightning_own:
        if crash_at and int(os.environ.get("RANK", "0")) == 0:
            kill_in_dcp_finish_at(crash_at)
        return {"strategy": ModelParallelStrategy(**sizes)}
    return {"strategy": CrashingStrategy(crash_at, **sizes) if crash_at else CkptguardModelParallelStrategy(**sizes)}


# strategy name: (Trainer arguments, the LightningModule, its hidden width)
STRATEGIES = {"ddp": (ddp, Net, 8), "fsdp2": (fsdp2, ShardedNet, 16)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="ddp")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--crash-at-save", type=int, default=0)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument(
        "--lightning-own",
        action="store_true",
        help="Lightning's own saving: TorchCheckpointIO (ddp), ModelParallelStrategy's (fsdp2)",
    )
    a = p.parse_args()
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8, shuffle=False)
    trainer_args, module, hidden = STRATEGIES[a.strategy]
    ckpt = ModelCheckpoint(dirpath=a.root, every_n_epochs=1, save_top_k=2, monitor="gstep", mode="max", save_last=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_epochs=a.epochs,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        **trainer_args(a.crash_at_save, a.lightning_own),
    )
    model = module(a.out, hidden)
    # The one line a script runs unchanged on a fresh start and on a restart (--resume only names the run).
    trainer.fit(model, data, ckpt_path="last")
    if trainer.global_rank == 0:
        model.record(
            kind="done",
            files=sorted(os.listdir(a.root)),
            best_k=sorted(os.path.basename(k) for k in ckpt.best_k_models),
        )


if __name__ == "__main__":
    run_worker(main)
