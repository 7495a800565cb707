"""DeepSpeed with its optimizer state offloaded to "NVMe" (a directory), checkpointed through ckptguard or by DeepSpeed.

    torchrun --nproc-per-node 2 deepspeed_nvme_job.py --dir DIR --record PREFIX --swap SWAPDIR [--real]
             [--resume] [--default] [--kill-at-save N --kill-rank R] [--node-local] [--steps 8]

--real: ZeRO-3 with ``"offload_optimizer": {"device": "nvme", "nvme_path": SWAPDIR}``: DeepSpeed's own
optimizer swapper, which needs DeepSpeed's ``async_io`` op (libaio headers and a JIT build of the op).
Without --real: ZeRO-2 and a stand-in for that swapper (``StandInSwapper``): every step it writes this
rank's fp32 partition and Adam state as raw tensor files into ``SWAPDIR/optimizer/rank<R>`` (with a
``*_gradient_*`` file, which DeepSpeed's copy skips), and the optimizer gets ``swap_optimizer = True``,
``optimizer_swapper.swap_folder`` and ``reset_swap_buffers()`` (which reads the files back), so that
DeepSpeed's own ``save_checkpoint``/``load_checkpoint`` run their NVMe-offload branches unchanged.

A save every 2 steps (tag global_step<N>). --kill-at-save N --kill-rank R: rank R SIGKILLs itself inside
save N right after DeepSpeed copied its swap folder into ``<tag>/offloaded_tensors/rank<NN>``, when the
checkpoint engine's ``commit`` is called. --node-local: ``"checkpoint": {"use_node_local_storage": true}``.
Every rank appends JSON lines to PREFIX.rank<R>.jsonl: its loss per step, the sha256 of every file in its
swap folder before each save, the save's outcome, and on --resume what the load did to the swap folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
from torch import nn

from tests.support.frameworks import run_worker

EVERY = 2


def folder_digest(folder: str) -> dict[str, str]:
    out = {}
    for base, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return dict(sorted(out.items()))


class StandInSwapper:
    """What DeepSpeed's optimizer swapper keeps on NVMe, for a ZeRO-2 optimizer (which has none): this rank's
    fp32 partitions and their Adam state, one raw tensor file each."""

    def __init__(self, optimizer, folder: str) -> None:
        self.optimizer, self.swap_folder = optimizer, folder
        os.makedirs(folder, exist_ok=True)

    def _files(self):
        base = self.optimizer.optimizer
        for i, p in enumerate(self.optimizer.single_partition_of_fp32_groups):
            yield f"{i}.tensor.swp", p, p.shape
            for key in ("step", "exp_avg", "exp_avg_sq"):
                yield f"{i}_{key}.tensor.swp", base.state.get(p, {}).get(key), () if key == "step" else p.shape

    def swap_out(self) -> None:
        for name, t, shape in self._files():
            t = torch.zeros(shape) if t is None else t  # before the first step: zeros, as DeepSpeed initializes it
            with open(os.path.join(self.swap_folder, name), "wb") as f:
                f.write(t.detach().float().contiguous().numpy().tobytes())
        with open(os.path.join(self.swap_folder, "0_gradient_0_1.tensor.swp"), "wb") as f:
            f.write(os.urandom(64))  # scratch space: DeepSpeed's copy skips names with 'gradient'

    def reset_swap_buffers(self) -> None:
        """DeepSpeed calls this after copying a checkpoint's offloaded_tensors/rankNN into the swap folder."""
        base = self.optimizer.optimizer
        for i, p in enumerate(self.optimizer.single_partition_of_fp32_groups):

            def read(name: str, shape) -> torch.Tensor:
                with open(os.path.join(self.swap_folder, name), "rb") as f:
                    return torch.frombuffer(bytearray(f.read()), dtype=torch.float32).reshape(shape).clone()

            p.data.copy_(read(f"{i}.tensor.swp", p.shape))
            base.state[p] = {
                k: read(f"{i}_{k}.tensor.swp", () if k == "step" else p.shape)
                for k in ("step", "exp_avg", "exp_avg_sq")
            }


def main() -> None:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--record", required=True)
    p.add_argument("--swap", required=True)
    p.add_argument("--real", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--default", action="store_true", help="DeepSpeed's own checkpoint engine")
    p.add_argument("--kill-at-save", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--node-local", action="store_true")
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()

    def record(**kw) -> None:
        with open(f"{a.record}.rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(kw) + "\n")

    torch.manual_seed(0)
    # ~660k parameters: each rank's fp32 partition (>= 1 MiB) is large enough for DeepSpeed to swap it
    model = nn.Sequential(
        nn.Linear(4, 1024), nn.ReLU(), nn.Dropout(0.2), nn.Linear(1024, 640), nn.ReLU(), nn.Linear(640, 1)
    )
    zero: dict = {"stage": 2}
    if a.real:
        zero = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": a.swap}}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }
    if a.node_local:
        config["checkpoint"] = {"use_node_local_storage": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    opt = engine.optimizer
    stand_in = None
    if not a.real:
        stand_in = StandInSwapper(opt, os.path.join(a.swap, "optimizer", f"rank{rank}"))
        opt.optimizer_swapper, opt.swap_optimizer = stand_in, True
        opt.reset_swap_buffers = stand_in.reset_swap_buffers
        stand_in.swap_out()  # the initial state, as DeepSpeed's swapper writes it at initialization
    assert engine.zero_nvme_offload_optimizer()
    folder = opt.optimizer_swapper.swap_folder
    resets: list[dict[str, str]] = []
    swapper_reset = opt.reset_swap_buffers

    def reset_swap_buffers() -> None:
        resets.append(folder_digest(folder))  # what DeepSpeed copied in
        swapper_reset()

    opt.reset_swap_buffers = reset_swap_buffers
    if not a.default:
        from ckptguard.integrations.deepspeed import install

        install(engine)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(a.steps, 2, 4, 4, generator=g)

    start = 0
    if a.resume:
        torch.manual_seed(1234 + rank)  # a resume must restore the RNG it saved, not run on a fresh one
        path, client = engine.load_checkpoint(a.dir)
        assert path is not None, "nothing loaded"
        start = client["step"]
        torch.set_rng_state(client["rng"][rank])
        record(
            kind="loaded",
            step=start,
            path=os.path.relpath(path, a.dir),
            resets=len(resets),
            at_reset=resets[-1] if resets else None,
            after=folder_digest(folder),
        )

    saves = 0
    for step in range(start + 1, a.steps + 1):
        x = xs[step - 1, rank]
        loss = nn.functional.mse_loss(engine(x).squeeze(-1), x.sum(1).sin())
        engine.backward(loss)
        engine.step()
        if stand_in is not None:
            stand_in.swap_out()
        record(kind="loss", step=step, loss=float(loss.detach()))
        if step % EVERY == 0:
            saves += 1
            rngs = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(rngs, torch.get_rng_state())
            if a.kill_at_save == saves and rank == a.kill_rank:
                arm_kill_after_offload_copy(engine)
            record(kind="swap", step=step, files=folder_digest(folder))
            try:
                engine.save_checkpoint(a.dir, tag=f"global_step{step}", client_state={"step": step, "rng": rngs})
            except Exception as e:
                record(kind="save_error", step=step, error=f"{type(e).__name__}: {e}")
                raise
            record(kind="save", step=step)


def arm_kill_after_offload_copy(engine) -> None:
    """SIGKILL this rank when DeepSpeed calls the checkpoint engine's commit: its model and ZeRO files are
    written and its swap folder has been copied into <tag>/offloaded_tensors/rank<NN>."""
    ce = engine.checkpoint_engine

    def commit(info):
        os.kill(os.getpid(), signal.SIGKILL)

    ce.commit = commit


if __name__ == "__main__":
    run_worker(main)
