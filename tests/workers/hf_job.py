"""A 2-rank Hugging Face Trainer run on CPU (DDP, gloo), checkpointed by CkptguardTrainer or by Trainer.

    torchrun --nproc-per-node 2 hf_job.py --out DIR --record PREFIX [--resume] [--default]
             [--crash-at-save N] [--default-crash-at-save N]

Every rank appends JSON lines to PREFIX.rank<R>.jsonl: its loss at every step, a digest of model,
optimizer and scheduler at every save, and right after a resume's load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import warnings

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments

from ckptguard import _faults
from ckptguard.integrations.hf import CkptguardTrainer

from tests.support.frameworks import run_worker, state_digest


class TinyConfig(PretrainedConfig):
    model_type = "ckptguard-tiny"

    def __init__(self, d: int = 4, hidden: int = 16, dropout: float = 0.2, **kw):
        self.d, self.hidden, self.dropout = d, hidden, dropout
        super().__init__(**kw)


class TinyModel(PreTrainedModel):
    config_class = TinyConfig
    base_model_prefix = "tiny"

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        # dropout: the run depends on every rank's RNG, so a resume must restore them all
        self.net = nn.Sequential(
            nn.Linear(config.d, config.hidden), nn.ReLU(), nn.Dropout(config.dropout), nn.Linear(config.hidden, 1)
        )
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        pass  # nn.Linear's own init, under the seed

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.net(x).squeeze(-1)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(1).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class Recorder:
    """Mixin for either trainer: losses per step, digests at save and after a resume's load."""

    log_prefix = ""
    crash_at = 0
    default_crash_at = 0
    saves = 0

    def record(self, **kw) -> None:
        with open(f"{self.log_prefix}.rank{self.args.process_index}.jsonl", "a") as f:
            f.write(json.dumps(kw) + "\n")

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.record(kind="loss", step=self.state.global_step + 1, loss=float(loss.detach()))
        return loss

    def _save_checkpoint(self, model, trial):
        self.saves += 1
        if self.crash_at == self.saves and self.args.process_index == 0:
            # ckptguard: rank 0 dies inside the commit of this save, its data written (chosen point)
            _faults.arm("before_publish:0:kill")
        super()._save_checkpoint(model, trial)
        self.record(
            kind="save", step=self.state.global_step, digest=state_digest(self.model, self.optimizer, self.lr_scheduler)
        )

    def _save_rng_state(self, output_dir: str) -> None:
        if self.default_crash_at == self.saves and self.args.process_index == 1:
            # Trainer's default: rank 1 dies before writing its rng_state_1.pth, once rank 0 has written
            # all of its part (trainer_state.json is its last file): the point is chosen, not timed.
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(output_dir, "trainer_state.json")) and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
        super()._save_rng_state(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.record(
                kind="loaded",
                step=self.state.global_step,
                path=os.path.basename(checkpoint),
                digest=state_digest(self.model, self.optimizer, self.lr_scheduler),
            )


class RecordingTrainer(Recorder, Trainer):
    pass


class RecordingCkptguardTrainer(Recorder, CkptguardTrainer):
    pass


def main() -> None:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--record", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--default", action="store_true", help="transformers' own Trainer")
    p.add_argument("--crash-at-save", type=int, default=0)
    p.add_argument("--default-crash-at-save", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=8)
    a = p.parse_args()
    args = TrainingArguments(
        output_dir=a.out,
        max_steps=a.max_steps,
        per_device_train_batch_size=4,
        learning_rate=0.05,
        lr_scheduler_type="linear",
        warmup_steps=0,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_backend="gloo",
    )
    cls = RecordingTrainer if a.default else RecordingCkptguardTrainer
    cls.log_prefix, cls.crash_at, cls.default_crash_at = a.record, a.crash_at_save, a.default_crash_at_save
    torch.manual_seed(0)
    trainer = cls(model=TinyModel(TinyConfig()), args=args, train_dataset=Data())
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    if args.process_index == 0:
        trainer.record(kind="done", files=sorted(os.listdir(a.out)))


if __name__ == "__main__":
    run_worker(main)
