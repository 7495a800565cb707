"""FSDP2 (fully_shard, DTensor) training with crash-safe checkpoints:

    torchrun --nproc-per-node 2 examples/fsdp2_train.py /tmp/ckpts

Every rank saves only its shards; loading at another world size reshards. On CPU it runs
with gloo; on GPUs use "nccl" and move the model to the rank's device first.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import ckptguard
from ckptguard import Checkpointer, PerRank


def main(root: str, steps: int = 100, every: int = 20) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1 + rank)
    state = {"model": model, "optim": optim, "rng": PerRank(ckptguard.RNGState())}
    with Checkpointer(root, keep_last=2) as ck:
        start = ck.load(state) or 0
        for step in range(start + 1, steps + 1):
            x = torch.randn(32, 16)
            loss = (model(x) - x.sum(1, keepdim=True).sin()).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            if step % every == 0:
                ck.save(step, state)
                if rank == 0:
                    print(f"step {step} loss {loss.item():.4f} committed {ck.steps()}", flush=True)
        full = ck.read()  # collective, like every method: full tensors, no model needed
        if rank == 0 and full is not None:
            print("read without a template:", {k: tuple(v.shape) for k, v in full["model"].items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ckptguard-fsdp2")
