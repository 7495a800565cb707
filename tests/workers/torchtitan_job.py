"""A 2-rank torchtitan training run on CPU (FSDP2 over gloo), checkpointed by ckptguard's
``CkptguardCheckpointManager`` or by torchtitan's own DCP ``CheckpointManager``, each built from its
``Config`` and driven the way torchtitan's ``Trainer.train`` drives ``config.checkpoint.build(...)``.

    torchrun --nproc-per-node 2 torchtitan_job.py --dump DIR --record PREFIX [--manager ckptguard|dcp]
             [--load-step N] [--data-seed S] [--stop-after N] [--async]
             [--fault SPEC --fault-at N] [--kill-rank1-at N]

A tiny MLP built in code, ``fully_shard`` per layer and at the root; torchtitan's real
``OptimizersContainer`` (``default_adamw``) and ``LRSchedulersContainer`` (warmup, linear decay) built
from their Configs; a Stateful dataloader laid out like torchtitan's ``ParallelAwareDataloader``
(``{"dp_rank_<r>": pickled position, "world_size": 2}``) whose batches are a function of its own
position, and a ``train_state`` like the Trainer's. A save every 2 of 8 steps, ``keep_latest_k=2``,
the last step model-only (torchtitan's defaults).

- ``--fault SPEC --fault-at N``: ckptguard's fault hook (``CKPTGUARD_FAULT`` syntax), armed for the save
  of step N;
- ``--kill-rank1-at N``: in the save of step N, rank 1 SIGKILLs itself before writing its shard, once rank 0
  has written (and fsynced) its own: rank 0 leaves a marker file after its storage writer's
  ``write_data``, rank 1's waits for it. The same point for either manager's writer; never timing.
- ``--stop-after N``: leave after step N's save, as a job whose allocation ended.

Every rank appends JSON lines to PREFIX.rank<R>.jsonl: ``loaded`` (step and a digest of this rank's own
shards of model and optimizer state plus scheduler, train state and its dataloader state) right after
the load, ``loss`` at every step, ``state`` (the same digest) right before every save that saves.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import signal
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tests.support.frameworks import run_worker

STEPS, INTERVAL = 8, 2
SAVING = {"step": -1}  # the step whose save is running (for the kill hook)


class Data:
    """Stateful, per-rank: torchtitan's dataloader state layout; batch i is a function of (seed, rank, i)."""

    def __init__(self, rank: int, world: int, seed: int) -> None:
        self.rank, self.world, self.seed, self.position = rank, world, seed, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 1009 + self.position)
        self.position += 1
        x = torch.randn(4, 8, generator=g)
        return x, torch.stack([x.sum(1).sin(), x[:, 0].cos()], 1)

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.rank}": pickle.dumps({"position": self.position}), "world_size": self.world}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        assert sd["world_size"] == self.world
        self.position = pickle.loads(sd[f"dp_rank_{self.rank}"])["position"]


class TrainState:
    """What torchtitan's Trainer saves as ``train_state``."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def local_digest(*objs: Any) -> str:
    """SHA-256 of this rank's own shards (DTensors' local parts) and every other value, in key order."""
    h = hashlib.sha256()

    def feed(v: Any) -> None:
        if isinstance(v, DTensor):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            h.update(v.detach().contiguous().numpy().tobytes())
        else:
            h.update(repr(v).encode())

    for obj in objs:
        for k, v in sorted(obj.state_dict().items()):
            h.update(str(k).encode())
            feed(v)
    return h.hexdigest()


def kill_rank1_in_save(writer_cls: type, step: int, marker: str, rank: int) -> None:
    """Rank 1 dies in ``writer_cls.write_data`` of step ``step``'s save, before writing, once rank 0 wrote."""
    real = writer_cls.write_data

    def write_data(self, plan, planner):
        armed = SAVING["step"] == step
        if armed and rank == 1:
            deadline = time.monotonic() + 120
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        fut = real(self, plan, planner)
        if armed and rank == 0:
            fut.wait()  # written and fsynced (DCP's sync_files, ckptguard's own)
            with open(marker, "w") as f:
                f.write("rank 0 wrote its shard\n")
        return fut

    writer_cls.write_data = write_data


def main() -> None:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--dump", required=True)
    p.add_argument("--record", required=True)
    p.add_argument("--manager", choices=["ckptguard", "dcp"], default="ckptguard")
    p.add_argument("--load-step", type=int, default=-1)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--stop-after", type=int, default=0)
    p.add_argument("--async", dest="async_", action="store_true")
    p.add_argument("--fault", default="")
    p.add_argument("--fault-at", type=int, default=0)
    p.add_argument("--kill-rank1-at", type=int, default=0)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from ckptguard import _faults
    from ckptguard.integrations.torchtitan import CkptguardCheckpointManager

    def record(**kw: Any) -> None:
        with open(f"{a.record}.rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(kw) + "\n")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = default_adamw(lr=0.02).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    data, train_state = Data(rank, world, a.data_seed), TrainState()

    if a.manager == "ckptguard":
        config = CkptguardCheckpointManager.Config(
            enable=True,
            interval=INTERVAL,
            keep_latest_k=2,
            load_step=a.load_step,
            async_mode="async" if a.async_ else "disabled",
        )
        from ckptguard.dcp.writer import GuardedWriter as writer_cls
    else:
        config = CheckpointManager.Config(
            enable=True,
            interval=INTERVAL,
            keep_latest_k=2,
            load_step=a.load_step,
            async_mode="async" if a.async_ else "disabled",
        )
        from torch.distributed.checkpoint.filesystem import FileSystemWriter as writer_cls
    if a.kill_rank1_at:
        kill_rank1_in_save(writer_cls, a.kill_rank1_at, f"{a.record}.rank0-wrote-{a.kill_rank1_at}", rank)
    checkpointer = config.build(
        dataloader=data,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=a.dump,
    )

    def digest() -> str:
        return local_digest(model, optimizers, lr_schedulers, train_state, data)

    checkpointer.load(step=config.load_step)  # what Trainer.train() does first
    if train_state.step:
        record(kind="loaded", step=train_state.step, digest=digest())
    while train_state.step < STEPS:
        train_state.step += 1
        step = train_state.step
        optimizers.zero_grad()
        x, y = data.next()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        train_state.ntokens_seen += x.numel()
        record(kind="loss", step=step, loss=float(loss.detach()))
        last = step == STEPS
        if last or step % INTERVAL == 0:
            record(kind="state", step=step, digest=digest())
        if a.fault and step == a.fault_at:
            _faults.arm(a.fault)
        SAVING["step"] = step
        checkpointer.save(step, last_step=last)
        if step == a.stop_after:
            break
    checkpointer.close()
    dist.barrier()
    record(kind="done", step=train_state.step)


if __name__ == "__main__":
    run_worker(main)
