"""A 2-process Accelerate training run on CPU (DDP over gloo), checkpointed through ckptguard or by Accelerate.

    torchrun --nproc-per-node 2 accelerate_job.py --project DIR --record PREFIX [--resume] [--default]
             [--crash-at-save N] [--crash-at-commit N] [--record-load-error]

ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2); a save every 2 steps of 8.
Every process appends JSON lines to PREFIX.rank<R>.jsonl: its loss at every step, a digest of
model, optimizer and scheduler at every save, and right after a resume's load.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import warnings

import accelerate.checkpointing
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from torch import nn

from ckptguard import _faults
from ckptguard.integrations.accelerate import CkptguardAccelerator

from tests.support.frameworks import run_worker, state_digest

EVERY, STEPS = 2, 8


def kill_while_writing_optimizer_of_save(n: int) -> None:
    """Rank 0 dies while Accelerate writes optimizer.bin of its nth save_state: models written, the rest not."""
    real = accelerate.checkpointing.save
    seen = [0]

    def save(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.bin"):
            seen[0] += 1
            if seen[0] == n:
                buf = io.BytesIO()
                torch.save(obj, buf)
                with open(f, "wb") as out:  # half of it written when the process dies
                    out.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                    out.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        return real(obj, f, *args, **kwargs)

    accelerate.checkpointing.save = save


def main() -> None:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--project", required=True)
    p.add_argument("--record", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--default", action="store_true", help="Accelerate's own save_state/load_state")
    p.add_argument("--crash-at-save", type=int, default=0, help="rank 0 dies writing optimizer.bin of save N")
    p.add_argument("--crash-at-commit", type=int, default=0, help="rank 0 dies inside ckptguard's commit of save N")
    p.add_argument(
        "--record-load-error",
        action="store_true",
        help="a resume whose load_state raises records the exception's class and message, and stops",
    )
    a = p.parse_args()
    config = ProjectConfiguration(project_dir=a.project, automatic_checkpoint_naming=True, total_limit=2)
    cls = Accelerator if a.default else CkptguardAccelerator
    accelerator = cls(cpu=True, project_config=config)
    rank = accelerator.process_index

    def record(**kw) -> None:
        with open(f"{a.record}.rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(kw) + "\n")

    set_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LinearLR(optim, start_factor=1.0, end_factor=0.1, total_iters=STEPS)
    model, optim, sched = accelerator.prepare(model, optim, sched)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, 2, 4, 4, generator=g)  # step, rank, batch, features: a batch is a function of the step

    start = 0
    if a.resume:
        try:
            iteration = accelerator.load_state()  # default: the highest-numbered folder; ckptguard: newest committed
        except Exception as e:
            if not a.record_load_error:
                raise
            record(kind="load_error", error=type(e).__name__, message=str(e))
            return
        if iteration is None:  # Accelerate's own returns nothing: it loaded the folder before save_iteration
            iteration = int(
                sorted(os.listdir(os.path.join(a.project, "checkpoints")), key=lambda n: int(n.split("_")[-1]))[
                    -1
                ].split("_")[-1]
            )
            accelerator.project_configuration.iteration = iteration + 1
        start = (iteration + 1) * EVERY
        record(
            kind="loaded",
            step=start,
            iteration=iteration,
            digest=state_digest(accelerator.unwrap_model(model), optim, sched),
        )
    if a.crash_at_save and rank == 0:
        kill_while_writing_optimizer_of_save(a.crash_at_save)
    saves = 0
    for step in range(start + 1, STEPS + 1):
        x = xs[step - 1, rank]
        loss = nn.functional.mse_loss(model(x).squeeze(-1), x.sum(1).sin())
        accelerator.backward(loss)
        optim.step()
        sched.step()
        optim.zero_grad()
        record(kind="loss", step=step, loss=float(loss.detach()))
        if step % EVERY == 0:
            saves += 1
            if a.crash_at_commit == saves and rank == 0:
                _faults.arm("before_publish:0:kill")
            accelerator.save_state()
            record(kind="save", step=step, digest=state_digest(accelerator.unwrap_model(model), optim, sched))
    accelerator.wait_for_everyone()
    if rank == 0:
        record(kind="done", files=sorted(os.listdir(os.path.join(a.project, "checkpoints"))))
    accelerator.end_training()


if __name__ == "__main__":
    run_worker(main)
