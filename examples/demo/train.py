"""A small but real DDP training job (character-level language model) that checkpoints with ckptguard.

Run by run_demo.py as a simulated 2-node torchrun job. Every rank trains on its
own slice of the text; gradients are averaged by DDP; every SAVE_EVERY steps the
model, the optimizer, the step and the RNG state are checkpointed into one
shared directory. Set DEMO_CRASH_AT=<step>:<rank> to SIGKILL that rank halfway
through writing that step's checkpoint (ckptguard's fault-injection hook), and
DEMO_HANG_AT=<step>:<rank> to make that rank stop at that step, reading a file
that nobody writes (once: a marker next to the checkpoints says it happened).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ckptguard import Checkpointer, PerRank
from ckptguard._faults import arm

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
    "of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season "
    "of Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair, "
    "we had everything before us, we had nothing before us, we were all going direct to Heaven, we "
    "were all going direct the other way. "
) * 4
CONTEXT, BATCH, STEPS, SAVE_EVERY = 16, 32, int(os.environ.get("DEMO_STEPS", 60)), 10


class CharModel(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 32)
        self.mlp = nn.Sequential(nn.Linear(32 * CONTEXT, 128), nn.GELU(), nn.Linear(128, vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(x).flatten(1))


def batch(data: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=gen)
    x = torch.stack([data[i : i + CONTEXT] for i in idx])
    return x, data[idx + CONTEXT]


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = sorted(set(TEXT))
    data = torch.tensor([vocab.index(c) for c in TEXT])
    torch.manual_seed(0)
    model = DDP(CharModel(len(vocab)))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1000 + rank)
    progress = PerRank({"step": 0, "rng": gen.get_state()})  # each rank's own data order

    ck = Checkpointer(os.environ["CKPT_ROOT"], keep_last=3)
    if rank == 0:
        print(f"[demo] ckptguard: {ck.topology.describe()}", flush=True)
    resumed = ck.load({"model": model, "optim": optim, "progress": progress})
    start = 0
    if resumed is not None:
        start = progress.value["step"] + 1
        gen.set_state(progress.value["rng"])
        if rank == 0:
            print(f"[demo] resumed from committed step {resumed}; checkpoints seen: {ck.steps()}", flush=True)
    elif rank == 0:
        print("[demo] no checkpoint yet: starting from scratch", flush=True)

    crash_step, crash_rank = (int(x) for x in os.environ.get("DEMO_CRASH_AT", "-1:-1").split(":"))
    hang_step, hang_rank = (int(x) for x in os.environ.get("DEMO_HANG_AT", "-1:-1").split(":"))
    hang_marker = os.environ["CKPT_ROOT"].rstrip("/") + ".hang-done"
    loss_fn = nn.CrossEntropyLoss()
    for step in range(start, STEPS):
        if step == hang_step and rank == hang_rank and not os.path.exists(hang_marker):
            stall(hang_marker, rank, step)
        x, y = batch(data, gen)
        loss = loss_fn(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        if rank == 0:
            print(f"[demo] step {step:3d} loss {avg.item() / world:.4f}", flush=True)
        if step % SAVE_EVERY == SAVE_EVERY - 1 or step == STEPS - 1:
            if step == crash_step:
                arm(f"mid_write:{crash_rank}")  # this rank SIGKILLs itself halfway through its write
            progress.value.update(step=step, rng=gen.get_state())
            ck.save(
                step,
                {"model": model, "optim": optim, "progress": progress},
                metadata={"loss": round(avg.item() / world, 4)},
            )
            if rank == 0:
                print(f"[demo] step {step:3d} checkpoint committed; checkpoints: {ck.steps()}", flush=True)
    ck.close()
    dist.barrier()
    dist.destroy_process_group()


def stall(marker: str, rank: int, step: int) -> None:
    """Stop here the way a rank does on a stalled file system: a read that never returns."""
    open(marker, "w").close()
    print(f"[demo] rank {rank} stops at step {step}: it reads {marker}.fifo, which nobody writes", flush=True)
    if not os.path.exists(marker + ".fifo"):
        os.mkfifo(marker + ".fifo")
    with open(marker + ".fifo", "rb") as f:
        f.read()


if __name__ == "__main__":
    main()
