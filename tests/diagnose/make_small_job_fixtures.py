"""Produce the real fixtures that small inline jobs make (torch CPU, gloo on loopback, this machine).

    PYTHONPATH=src python tests/diagnose/make_small_job_fixtures.py [NAME ...]

Each scenario is a small real job that fails in one way; its console (stdout and stderr
together, as a user pastes it) is written to ``tests/diagnose/fixtures/NAME.log``. Exact pids,
ports and times change from run to run. The machine's hostname is replaced by ``fixturehost``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).parent / "fixtures"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}

INIT = """
import os, sys, time, datetime, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank = dist.get_rank()
"""

SCENARIOS: dict[str, tuple[str, str]] = {
    # every rank resumes from a checkpoint file that a crashed save left empty
    "empty_ckpt_load": (
        "torchrun",
        INIT
        + """
open("model.pt", "wb").close()
dist.barrier()
state = torch.load("model.pt", map_location="cpu")
""",
    ),
    # resume into a model whose layer sizes changed
    "state_dict_size_mismatch": (
        "torchrun",
        INIT
        + """
torch.save(torch.nn.Linear(8, 4).state_dict(), f"ckpt{rank}.pt")
model = torch.nn.Linear(8, 6)
model.load_state_dict(torch.load(f"ckpt{rank}.pt", map_location="cpu"))
""",
    ),
    # every rank renames its own staging dir onto the one final checkpoint dir (the HF Trainer
    # tmp-checkpoint regression): the second rename finds the target populated
    "rename_not_empty": (
        "torchrun",
        INIT
        + """
os.makedirs(f"out/tmp-checkpoint-{rank}", exist_ok=True)
open(f"out/tmp-checkpoint-{rank}/model.safetensors", "w").write("x")
print(f"[rank{rank}] Saving model checkpoint to out/checkpoint-10", flush=True)
time.sleep(rank * 1.0)
os.rename(f"out/tmp-checkpoint-{rank}", "out/checkpoint-10")
dist.barrier()
""",
    ),
    # torch.distributed.checkpoint: resume into a model of another shape
    "dcp_size_mismatch": (
        "torchrun",
        INIT
        + """
import torch.distributed.checkpoint as dcp
dcp.save({"w": torch.zeros(8, 4)}, checkpoint_id="dcp_ckpt")
state = {"w": torch.zeros(6, 4)}
dcp.load(state, checkpoint_id="dcp_ckpt")
""",
    ),
    # mp.spawn: one worker is SIGKILLed (standing in for the OOM killer)
    "spawn_sigkill": (
        "spawn",
        """
import os, signal, time, datetime, torch, torch.distributed as dist, torch.multiprocessing as mp
def run(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20))
    print(f"rank {rank} step 1 loss 2.31", flush=True)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)
if __name__ == "__main__":
    mp.spawn(run, args=(2,), nprocs=2)
""",
    ),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(name: str) -> None:
    kind, code = SCENARIOS[name]
    with tempfile.TemporaryDirectory(prefix=f"ckfx-{name}-") as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(code)
        port = _port()
        if kind == "torchrun":
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node=2",
                f"--master-port={port}",
                str(script),
            ]
        else:
            cmd = [sys.executable, str(script)]
        proc = subprocess.run(
            cmd, cwd=tmp, env={**ENV, "PORT": str(port)}, capture_output=True, text=True, timeout=120, check=False
        )
    text = (proc.stdout + proc.stderr).replace(socket.gethostname(), "fixturehost")
    text = text.replace(tmp, "/tmp/job")
    (OUT / f"{name}.log").write_text(text)
    print(f"{name}: exit {proc.returncode}, {len(text.splitlines())} lines")


if __name__ == "__main__":
    for n in sys.argv[1:] or list(SCENARIOS):
        run(n)
