"""A 2-rank DeepSpeed ZeRO-2 run on CPU (DS_ACCELERATOR=cpu, gloo), checkpointed through ckptguard or by DeepSpeed.

    torchrun --nproc-per-node 2 deepspeed_job.py --dir DIR --record PREFIX [--resume] [--default]
             [--crash-at-save N] [--stage 2]

A save every 2 steps of 8 (tag global_step<N>). --crash-at-save N: rank 1 dies inside save N before
writing its ZeRO optimizer shard (with DeepSpeed's own engine: once rank 0 has written ``latest``
naming the new tag, which it does without waiting for the other ranks' shards). Every rank appends JSON
lines to PREFIX.rank<R>.jsonl: its loss per step, a digest of its model and optimizer state at every
save and right after a resume's load.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
from torch import nn

from tests.support.frameworks import run_worker

EVERY, STEPS = 2, 8


def digest(engine) -> str:
    h = hashlib.sha256()
    for k, v in engine.module.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().float().numpy().tobytes())
    sd = engine.optimizer.state_dict()
    base = sd.get("base_optimizer_state", {})
    for pid, st in sorted(base.get("state", {}).items()):
        for k, v in sorted(st.items()):
            h.update(f"{pid}.{k}".encode())
            h.update(v.detach().float().numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    for t in sd.get("single_partition_of_fp32_groups", []):
        h.update(t.detach().float().numpy().tobytes())
    return h.hexdigest()


def wait_for(pred, what: str) -> None:
    deadline = time.monotonic() + 120
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def main() -> None:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--record", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--default", action="store_true", help="DeepSpeed's own checkpoint engine")
    p.add_argument("--crash-at-save", type=int, default=0)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--export16", action="store_true", help="save_16bit_model twice at the end (the last tag's step)")
    a = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()

    def record(**kw) -> None:
        with open(f"{a.record}.rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(kw) + "\n")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}},
        "zero_optimization": {"stage": a.stage},
        "steps_per_print": 1000,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if not a.default:
        from ckptguard.integrations.deepspeed import install

        install(engine)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, 2, 4, 4, generator=g)

    start = 0
    if a.resume:
        torch.manual_seed(1234 + rank)  # a resume must restore the RNG it saved, not run on a fresh one
        path, client = engine.load_checkpoint(a.dir)
        assert path is not None, "nothing loaded"
        start = client["step"]
        torch.set_rng_state(client["rng"][rank])
        record(kind="loaded", step=start, path=os.path.relpath(path, a.dir), digest=digest(engine))

    saves = 0
    for step in range(start + 1, STEPS + 1):
        x = xs[step - 1, rank]
        loss = nn.functional.mse_loss(engine(x).squeeze(-1), x.sum(1).sin())
        engine.backward(loss)
        engine.step()
        record(kind="loss", step=step, loss=float(loss.detach()))
        if step % EVERY == 0:
            saves += 1
            rngs = [None, None]
            torch.distributed.all_gather_object(rngs, torch.get_rng_state())
            if a.crash_at_save == saves and rank == 1:
                arm_rank1_crash(engine, a.dir, f"global_step{step}", a.default)
            engine.save_checkpoint(a.dir, tag=f"global_step{step}", client_state={"step": step, "rng": rngs})
            record(kind="save", step=step, digest=digest(engine))
    if a.export16:  # DeepSpeed wraps this export in the engine's create/commit too, with the last tag's name
        for _ in range(2):  # the second replaces the first
            assert engine.save_16bit_model(a.dir)


def arm_rank1_crash(engine, save_dir: str, tag: str, default: bool) -> None:
    """Rank 1 dies before writing its ZeRO shard of this save."""
    ce = engine.checkpoint_engine
    real_save = ce.save

    def save(state_dict, path):
        if "zero_pp_rank_1" in os.path.basename(path):
            if default:  # DeepSpeed's own: rank 0 writes `latest` without waiting for the others' shards
                latest = os.path.join(save_dir, "latest")
                wait_for(lambda: os.path.exists(latest) and Path(latest).read_text().strip() == tag, "latest")
            # ckptguard's: whenever rank 0 gets there, its commit waits for rank 1, which never comes
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(state_dict, path)

    ce.save = save


if __name__ == "__main__":
    run_worker(main)
