"""A small DDP training job on CPU/gloo that fails in one chosen, real way.

Run under torchrun by ``generate.py``; each scenario reproduces one failure class so
that ``ckptguard diagnose`` is tested on logs that real processes wrote, not on text
made up to match the signatures. ``FAIL_RANK`` picks the rank that fails first.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

SCENARIO = sys.argv[1]
FAIL_RANK = int(os.environ.get("FAIL_RANK", "1"))
CKPT_DIR = Path(os.environ.get("CKPT_DIR", "/tmp/ckptguard-fixture-ckpt"))
PG_TIMEOUT_S = float(os.environ.get("PG_TIMEOUT_S", "30"))
STEPS = int(os.environ.get("STEPS", "6"))

logging.basicConfig(
    level=logging.INFO,
    format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    stream=sys.stdout,
)
log = logging.getLogger("train")


def say(msg: str) -> None:
    """Print like a training script does, flushed so that the interleaving is real."""
    print(msg, flush=True)


if SCENARIO == "import_error":
    import ckptguard_fixture_missing_module  # noqa: F401  (fails on every rank)

if SCENARIO == "cuda_unavailable":
    torch.zeros(1).to(f"cuda:{os.environ['LOCAL_RANK']}")  # a GPU job started on CPU nodes

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
rank = dist.get_rank()
world = dist.get_world_size()
local_rank = int(os.environ["LOCAL_RANK"])
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
log.info("rank %d/%d started, pid %d", rank, world, os.getpid())


def batch(step: int) -> torch.Tensor:
    """A batch; in the nan scenario one rank reads a corrupt sample full of inf."""
    x = torch.randn(8, 64)
    if SCENARIO == "loss_nan" and rank == FAIL_RANK and step == 3:
        x[0, 0] = float("inf")
    return x


class ShardDataset(torch.utils.data.Dataset):
    """A dataset whose worker dies (dataloader_killed) or fills /dev/shm (dataloader_shm_full)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        if SCENARIO == "dataloader_killed" and i == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        if SCENARIO == "dataloader_shm_full":
            return torch.randn(1024, 1024)  # 4 MiB per sample through shared memory
        return torch.randn(64)


def save_dir_race(step: int) -> None:
    """OLMo's pre-fix `_temporary_wd`: every node's local rank 0 manages the step directory."""
    final = CKPT_DIR / f"step{step}"
    tmp = CKPT_DIR / f"step{step}-tmp"
    if local_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(exist_ok=True, parents=True)
    dist.barrier()
    (tmp / f"rank{rank}.pt").parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), tmp / f"rank{rank}.pt")
    dist.barrier()
    if local_rank == 0:
        if final.is_dir():
            shutil.rmtree(final, ignore_errors=True)
        tmp.replace(final)
    dist.barrier()


def main() -> None:
    if SCENARIO == "port_in_use":
        return
    CKPT_DIR.mkdir(parents=True, exist_ok=True)
    loader = None
    if SCENARIO in ("dataloader_killed", "dataloader_shm_full") and rank == FAIL_RANK:
        loader = iter(torch.utils.data.DataLoader(ShardDataset(), batch_size=4, num_workers=2))
    for step in range(STEPS):
        if loader is not None:
            next(loader)
        x = batch(step)
        loss = model(x).pow(2).mean()
        if SCENARIO == "loss_nan" and not torch.isfinite(loss):
            # The DETR / timm training-loop check, printed on the rank that saw it.
            say(f"Loss is {loss.item()}, stopping training")
            sys.exit(1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.info("step %d loss %.4f", step, loss.item())
        if step == 2 and rank == FAIL_RANK:
            fail_now(step)
        if SCENARIO == "gloo_timeout" and step == 2:
            t = torch.ones(4)
            if rank == FAIL_RANK:
                time.sleep(3600)  # a rank stuck in I/O or a deadlock: never joins
            dist.all_reduce(t)
        if SCENARIO == "dir_race":
            save_dir_race(step)
        if SCENARIO == "copytree_race" and step == 2:
            src = CKPT_DIR / f"rank{rank}_swap"
            src.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), src / "tensor.pt")
            dist.barrier()
            # DeepSpeed ZeRO-3 NVMe offload: every rank copies into one shared folder.
            shutil.copytree(src, CKPT_DIR / "offloaded_tensors")
            dist.barrier()
        if SCENARIO == "torch_save_same_path" and step == 2:
            for attempt in range(10):  # the race does not fire every time: save until it does
                path = CKPT_DIR / f"model_{attempt}.pt"
                say(f"rank {rank}: saving checkpoint to {path}")
                big = {f"layer{i}": torch.full((262_144,), float(rank)) for i in range(64)}
                torch.save(big, path)  # the bug: no `if rank == 0`
                dist.barrier()
                state = torch.load(path, weights_only=True)
                if len({float(t[0]) for t in state.values()}) > 1:
                    raise RuntimeError(f"checkpoint {path} holds tensors from several ranks")
                dist.barrier()
        if SCENARIO == "corrupt_load" and step == 2:
            path = CKPT_DIR / "latest.pt"
            if rank == 0:
                torch.save({"model": model.state_dict(), "pad": torch.zeros(1_000_000)}, path)
                # A save cut short by a crash or quota: the file is left truncated.
                with open(path, "r+b") as f:
                    f.truncate(os.path.getsize(path) // 2)
            dist.barrier()
            say(f"rank {rank}: resuming from {path}")
            model.load_state_dict(torch.load(path, weights_only=True)["model"])
    dist.barrier()
    dist.destroy_process_group()


def fail_now(step: int) -> None:
    """The one real failure of the scenario, on FAIL_RANK at step 2."""
    if SCENARIO == "exception":
        labels = {"input_ids": [1, 2]}
        labels_for_step = labels["labels"]  # user bug: KeyError in the training loop
        print(labels_for_step)
    elif SCENARIO == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)  # stands in for an external kill -9
    elif SCENARIO == "segfault":
        ctypes.string_at(0)  # a native crash: SIGSEGV
    elif SCENARIO == "oom_cgroup":
        cg = os.environ["OOM_CGROUP"]
        Path(cg, "cgroup.procs").write_text(str(os.getpid()))
        hog = []
        while True:  # the real kernel OOM killer of the memory cgroup ends this
            hog.append(torch.ones(16 * 1024 * 1024))
    elif SCENARIO in ("disk_full", "permission_denied"):
        CKPT_DIR.mkdir(parents=True, exist_ok=True)
        path = CKPT_DIR / f"step{step}.pt"
        say(f"saving checkpoint to {path}")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "extra": torch.zeros(2_000_000)}, path)


if __name__ == "__main__":
    main()
