"""A 2-rank Lightning FSDP2 training run on CPU: ModelParallelStrategy, ``fully_shard`` over gloo.

    torchrun --nproc-per-node 2 lightning_fsdp_job.py --root DIR --out PREFIX [--resume] [--crash-at-save N]
                                                      [--lightning-own]

Checkpointed through ckptguard's CkptguardModelParallelStrategy, or with ``--lightning-own`` through
Lightning's own sharded save (DCP into ``DIR/<name>.ckpt/``). Each rank appends JSON lines to
PREFIX.rank<N>.jsonl: its loss at every step, a digest of its own shards of model and optimizer
state at every save and right after a resume's load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from ckptguard import _faults
from ckptguard.integrations.lightning import CkptguardModelParallelStrategy

from tests.support.frameworks import state_digest

warnings.filterwarnings("ignore")


class Net(L.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        self.out = out

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--crash-at-save", type=int, default=0)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lightning-own", action="store_true", help="Lightning's own ModelParallelStrategy save")
    a = p.parse_args()
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8, shuffle=False)
    sizes = {"data_parallel_size": 2, "tensor_parallel_size": 1}
    strategy: ModelParallelStrategy
    if a.lightning_own:
        strategy = ModelParallelStrategy(**sizes)
        if a.crash_at_save and int(os.environ.get("RANK", "0")) == 0:
            kill_in_dcp_finish_at(a.crash_at_save)
    elif a.crash_at_save:
        strategy = CrashingStrategy(a.crash_at_save, **sizes)
    else:
        strategy = CkptguardModelParallelStrategy(**sizes)
    ckpt = ModelCheckpoint(dirpath=a.root, every_n_epochs=1, save_top_k=2, monitor="gstep", mode="max",
                           save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=a.epochs, callbacks=[ckpt],
                        logger=False, enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    model = Net(a.out)
    trainer.fit(model, data, ckpt_path="last" if a.resume else None)
    if trainer.global_rank == 0:
        model.record(kind="done", files=sorted(os.listdir(a.root)),
                     best_k=sorted(os.path.basename(k) for k in ckpt.best_k_models))
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
