"""The ckptguard demo: train, crash in the middle of a save, resume, catch a hang, verify, diagnose.

A simulated 2-node torchrun job (2 agents x 2 processes, gloo, CPU) trains a
small character-level model with DDP and checkpoints every 10 steps into one
shared directory. On the first run, rank 3 (on node 1) is SIGKILLed halfway
through writing the step-39 checkpoint. The job is then restarted: it resumes
from the newest committed checkpoint (step 29). At step 42 rank 2 stops (a read
that never returns); `ckptguard run --hang-timeout` captures every rank's
stack, names rank 2 and the file it waits on, stops the job and, since a hang
is transient (`--max-restarts 1`), restarts it from step 39 to the end. Finally
`ckptguard ls`, `ckptguard verify` and `ckptguard diagnose` (on the crashed
run's logs) are run.

    python examples/demo/run_demo.py [--workdir runs/demo]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NODES, PROCS = 2, 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def banner(text: str) -> None:
    print(f"\n{'=' * 78}\n{text}\n{'=' * 78}", flush=True)


def run_job(name: str, root: Path, logs: Path, extra_env: dict[str, str], run_opts: tuple[str, ...] = ()) -> int:
    """Start both torchrun agents, each under `ckptguard run` (one shared log directory, `logs/run`);
    each agent's console (with [rankN]: prefixes) also goes to a file, for the demo's own summary."""
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {
        **os.environ,
        "CKPT_ROOT": str(root),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:",
        **extra_env,
    }
    agents = []
    for node in range(NODES):
        cmd = [
            sys.executable,
            "-m",
            "ckptguard",
            "run",
            "--logs",
            str(logs / "run"),
            "--checkpoints",
            str(root),
            *run_opts,
            "--",
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={NODES}",
            f"--nproc-per-node={PROCS}",
            "--rdzv-backend=static",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            f"--node-rank={node}",
            "--max-restarts=0",
            "--tee=3",
            f"--log-dir={logs / f'torchrun-node{node}'}",
            str(HERE / "train.py"),
        ]
        out = open(logs / f"node{node}.log", "w")  # noqa: SIM115 - closed below
        agents.append((subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT), out))
    codes = []
    for proc, out in agents:
        try:
            codes.append(proc.wait(timeout=300))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
        out.close()
    text = "".join((logs / f"node{n}.log").read_text(errors="replace") for n in range(NODES))
    for line in text.splitlines():
        m = re.search(r"\[demo\] (.*)", line)
        if m:
            print(f"  {m.group(1)}")
    status = "ok" if all(c == 0 for c in codes) else f"FAILED (agent exit codes {codes})"
    print(f"--> {name}: {status}; logs in {logs}", flush=True)
    for n in range(NODES):  # what `ckptguard run` printed on the failing node's terminal
        block = (logs / f"node{n}.log").read_text(errors="replace").partition("ckptguard run: the command failed")
        if block[1]:
            # What `ckptguard run` itself printed (its lines), not the job's output after a restart.
            tail = [
                x
                for x in f"{block[1]}{block[2]}".splitlines()
                if x.startswith(("ckptguard run:", "  ")) and not re.match(r"\s*\[rank\d+\]", x)
            ]
            print(f"\n  [node {n}'s terminal]\n  " + "\n  ".join(tail), flush=True)
            break
    return 0 if all(c == 0 for c in codes) else 1


def losses(logs: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for f in logs.glob("node*.log"):
        for m in re.finditer(r"\[demo\] step +(\d+) loss ([0-9.]+)", f.read_text(errors="replace")):
            out[int(m.group(1))] = float(m.group(2))
    return out


def ckptguard(*args: str) -> int:
    cmd = [sys.executable, "-m", "ckptguard.cli", *args]
    print(f"\n$ ckptguard {' '.join(args)}", flush=True)
    return subprocess.run(cmd).returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="runs/demo")
    args = p.parse_args()
    work = Path(args.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    root = work / "shared-checkpoints"

    banner("1. train on 2 simulated nodes; rank 3 is SIGKILLed halfway through writing the step-39 checkpoint")
    crashed = run_job("first run", root, work / "logs" / "run1-crash", {"DEMO_CRASH_AT": "39:3"})
    before = losses(work / "logs" / "run1-crash")

    banner(
        "2. restart the same job: it resumes from the newest committed checkpoint; at step 42 rank 2 stops\n"
        "   (a read that never returns): --hang-timeout catches it, --max-restarts resumes from step 39"
    )
    resumed = run_job(
        "second run",
        root,
        work / "logs" / "run2-resume",
        {"DEMO_HANG_AT": "42:2"},
        ("--hang-timeout", "6", "--max-restarts", "1", "--restart-backoff", "1", "--job-id", "demo-run2"),
    )
    after = losses(work / "logs" / "run2-resume")
    replayed = sorted(set(before) & set(after))
    if after:
        first = min(after)
        print(
            f"\n  loss before the crash: step {first - 1} = {before.get(first - 1, float('nan')):.4f} "
            f"(last committed checkpoint), step {max(before)} = {before[max(before)]:.4f} (last step run)"
        )
        print(
            f"  loss after the resume: step {first} = {after[first]:.4f}, final step {max(after)} = "
            f"{after[max(after)]:.4f}"
        )
    exact = bool(replayed) and all(before[s] == after[s] for s in replayed)
    if replayed:
        print(
            f"  steps {replayed[0]}-{replayed[-1]} ran twice (lost with the crash, redone after the resume): "
            + (
                "the losses match exactly, the resume restored model, optimizer and data order"
                if exact
                else "the losses DIFFER"
            )
        )

    banner("3. what is in the checkpoint directory, and is it intact?")
    ckptguard("ls", str(root))
    verify_rc = ckptguard("verify", str(root))

    banner("4. afterwards, the same whole-job answer from the first run's log directory (offline)")
    ckptguard("diagnose", str(work / "logs" / "run1-crash" / "run"), "--checkpoints", str(root))

    ok = crashed != 0 and resumed == 0 and verify_rc == 0 and exact
    banner("demo " + ("finished: crash contained, run resumed, checkpoints intact" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
