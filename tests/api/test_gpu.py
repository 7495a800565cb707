"""Checkpoints of a state on a CUDA device: what the CPU suite cannot show.

Skipped without a GPU (CI has none); run where one is lent (``pytest tests/api/test_gpu.py``). The
async save's host copy runs on a side stream that must first wait for the kernels already queued on
the training stream and must not see the ones queued after ``save()`` returns; loads into device
tensors are all-or-nothing like loads into host tensors; and a job whose default process group is
NCCL (what every GPU job uses) saves and resumes FSDP2 state through ckptguard's own gloo group.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ckptguard import Checkpointer, CorruptCheckpointError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _mixed_state(device: torch.device) -> dict[str, object]:
    g = torch.Generator(device=device).manual_seed(0)
    return {
        "model": {
            "w": torch.randn(1024, 1024, device=device, generator=g),
            "b16": torch.randn(333, device=device, generator=g).to(torch.bfloat16),
            "h": torch.randn(7, 5, device=device, generator=g).to(torch.float16),
            "ids": torch.arange(10_000, device=device, dtype=torch.int64),
            "mask": torch.rand(4096, device=device, generator=g) > 0.5,
            "scalar": torch.tensor(3.5, device=device),
        },
        "step_count": 17,
    }


def _clone(state: dict[str, object]) -> dict[str, object]:
    return {"model": {k: v.clone() for k, v in state["model"].items()}, "step_count": state["step_count"]}  # type: ignore[union-attr]


def _empty_like(state: dict[str, object]) -> dict[str, object]:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step_count": 0}  # type: ignore[union-attr]


def _equal(a: dict[str, object], b: dict[str, object]) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])  # type: ignore[index]


def test_an_async_save_holds_the_kernels_queued_before_it_and_none_queued_after(tmp_path: Path) -> None:
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    state = {"model": {"w": torch.zeros(4096, 4096, device=device)}}
    with Checkpointer(tmp_path / "ck") as ck:
        for step in range(1, 4):
            # Queued, not yet run when save() starts: a matmul chain whose result lands in w.
            out = a
            for _ in range(8):
                out = out @ a / 64
            state["model"]["w"].copy_(out)
            expected = out.clone()  # queued on the same stream: the value w holds at save()
            ck.save(step, state, blocking=False)
            state["model"]["w"].fill_(float("nan"))  # training goes on as soon as save() returns
            state["model"]["w"].add_(a @ a)
            ck.wait()
            into = {"model": {"w": torch.empty_like(expected)}}
            assert ck.load(into, step=step) == step
            assert torch.equal(into["model"]["w"], expected), f"step {step}: the snapshot is not the state at save()"
            a = a + 1


def test_device_tensors_of_every_dtype_round_trip_bitwise_sync_and_async(tmp_path: Path) -> None:
    device = torch.device("cuda")
    state = _mixed_state(device)
    saved = _clone(state)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state)
        ck.save(2, state, blocking=False)
        ck.wait()
    for step in (1, 2):
        into = _empty_like(state)
        assert Checkpointer(tmp_path / "ck", read_only=True).load(into, step=step) == step
        assert into["step_count"] == 17 and _equal(into, saved)
        assert all(t.device.type == "cuda" for t in into["model"].values())  # type: ignore[union-attr]
    on_host = {"model": {k: torch.zeros_like(v, device="cpu") for k, v in state["model"].items()}, "step_count": 0}  # type: ignore[union-attr]
    Checkpointer(tmp_path / "ck", read_only=True).load(on_host, step=1)
    assert all(torch.equal(on_host["model"][k], v.cpu()) for k, v in saved["model"].items())  # type: ignore[union-attr]


def test_blocking_saves_copy_device_tensors_once_into_buffers_that_never_go_stale(tmp_path: Path) -> None:
    device = torch.device("cuda")
    host = torch.arange(1000, dtype=torch.float64)  # written from where it is, never copied
    with Checkpointer(tmp_path / "ck") as ck:
        for step, (rows, dtype) in enumerate(
            [(64, torch.float32), (64, torch.float32), (96, torch.float32), (96, torch.bfloat16)], start=1
        ):
            state = {
                "model": {"w": torch.randn(rows, 128, device=device).to(dtype), "host": host + step},
                "extra": {"count": step, "nested": [torch.full((3,), float(step), device=device)]},
            }
            ck.save(step, state)
            assert "device copy" in ck.last_save_stats.seconds  # type: ignore[union-attr]
            into = {
                "model": {
                    "w": torch.empty(rows, 128, device=device, dtype=dtype),
                    "host": torch.empty(1000, dtype=torch.float64),
                },
                "extra": {"count": 0, "nested": [torch.empty(3, device=device)]},
            }
            ck.load(into, step=step)
            assert torch.equal(into["model"]["w"], state["model"]["w"]), f"step {step}: shape/dtype change went stale"
            assert torch.equal(into["model"]["host"], host + step) and into["extra"]["count"] == step
            assert torch.equal(into["extra"]["nested"][0], state["extra"]["nested"][0])
        assert ck._saves.device_stager.allocations == 3  # same shapes reuse; each change of shape or dtype reallocates
        ck.save(10, state, blocking=False)  # the async buffers now hold the state: sync saves use them
        ck.wait()
        ck.save(11, state)
        assert ck._saves.device_stager.allocations == 3 and ck._saves.host_stager.allocations == 1
        assert ck.load(into, step=11) == 11 and torch.equal(into["model"]["w"], state["model"]["w"])


def test_a_corrupt_step_leaves_every_device_tensor_as_it_was(tmp_path: Path) -> None:
    device = torch.device("cuda")
    state = _mixed_state(device)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state)
    files = sorted((tmp_path / "ck" / "step-00000001" / "data").iterdir())
    victim = max(files, key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x40  # the last tensor written: every earlier one would already be in place
    victim.write_bytes(bytes(data))
    into = _empty_like(state)
    before = _clone(into)
    with pytest.raises(CorruptCheckpointError):
        Checkpointer(tmp_path / "ck", read_only=True).load(into, step=1)
    assert _equal(into, before), "a failed load changed device tensors"


_FSDP2_JOB = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from ckptguard import Checkpointer

    root = sys.argv[1]
    dist.init_process_group("nccl", init_method="file://" + root + ".pg", rank=0, world_size=1)
    torch.cuda.set_device(0)

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).cuda()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train(model, optim, steps):
        for _ in range(steps):
            x = torch.randn(64, 256, device="cuda")
            loss = (model(x) - x).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()

    model, optim = build()
    with Checkpointer(root) as ck:
        train(model, optim, 3)
        ck.save(3, {"model": model, "optim": optim})
        train(model, optim, 2)
        ck.save(5, {"model": model, "optim": optim}, blocking=False)
        ck.wait()
        want = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        want_opt = {k: v.full_tensor().clone() for k, v in optim.state_dict()["state"][0].items()
                    if hasattr(v, "full_tensor")}
        train(model, optim, 2)
    fresh, fresh_opt = build()
    with Checkpointer(root) as ck:
        assert ck.load({"model": fresh, "optim": fresh_opt}) == 5
    got = {k: v.full_tensor() for k, v in fresh.state_dict().items()}
    assert all(torch.equal(got[k], want[k]) for k in want), "model differs after resume"
    got_opt = fresh_opt.state_dict()["state"][0]
    assert all(torch.equal(got_opt[k].full_tensor(), v) for k, v in want_opt.items()), "optimizer differs"
    train(fresh, fresh_opt, 1)  # the resumed state trains
    dist.destroy_process_group()
    print("FSDP2-NCCL-OK")
""")


def test_an_fsdp2_job_on_nccl_saves_and_resumes_on_the_device(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-c", _FSDP2_JOB, str(tmp_path / "ck")], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "FSDP2-NCCL-OK" in proc.stdout, proc.stdout + proc.stderr
