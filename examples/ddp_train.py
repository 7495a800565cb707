"""DDP training with crash-safe checkpoints: torchrun --nproc-per-node 2 examples/ddp_train.py /tmp/ckpts

Kill it at any moment and start it again: it resumes from the newest committed checkpoint,
model, optimizer and every rank's RNG states included.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ckptguard
from ckptguard import Checkpointer, PerRank


def main(root: str, steps: int = 200, every: int = 20) -> None:
    dist.init_process_group("gloo")  # "nccl" on GPUs
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = Checkpointer(root, keep_last=3)
    torch.manual_seed(1 + rank)  # each rank its own data stream
    state = {"model": model, "optim": optim, "rng": PerRank(ckptguard.RNGState()), "meta": {"step": 0}}
    start = ck.load(state) or 0  # None on a fresh start
    for step in range(start + 1, steps + 1):
        x = torch.randn(32, 16)
        loss = (model(x) - x.sum(1, keepdim=True).sin()).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % every == 0:
            state["meta"]["step"] = step
            ck.save(step, state, metadata={"loss": loss.item()}, blocking=False)
            if rank == 0:
                print(f"step {step} loss {loss.item():.4f} (committed: {ck.steps()})", flush=True)
    ck.close()  # waits for the last background save
    if rank == 0:  # rank 0 alone: a rank-local, read-only Checkpointer and save_file need no collective
        with Checkpointer(root, process_group="local", read_only=True) as reader:
            ckptguard.save_file(reader.read()["model"], os.path.join(root, "model.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ckptguard-ddp")
