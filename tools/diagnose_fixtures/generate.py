"""Produce the real crash logs under tests/diagnose/fixtures/ by running failing torchrun jobs.

Usage (as root, on CPU; one-off, about five minutes on two cores):

    python tools/diagnose_fixtures/generate.py [NAME ...]

Each scenario starts real torchrun agents (gloo on loopback) around ``worker.py`` and
captures what a user would see: the agent's console output with the workers' output
(``--tee``, a log-line prefix template, per-rank files, or nothing), as one file, or a
directory of per-rank files. Nothing in the captured text is edited; the only rewrite is
the masking of this machine's hostname (see ``MASK_HOST``), noted in the fixtures README.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "diagnose" / "fixtures"
WORKER = Path(__file__).with_name("worker.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
MASK_HOST = "fixturehost"


@dataclass
class Scenario:
    """One failing job: what the workers do and how the launcher is asked to log."""

    name: str
    scenario: str
    nproc: int = 4
    nodes: int = 1
    env: dict[str, str] = field(default_factory=dict)
    launcher_args: list[str] = field(default_factory=lambda: ["--tee", "3"])
    per_rank_dir: bool = False
    note: str = ""


SCENARIOS = [
    Scenario(
        "exception_keyerror",
        "exception",
        env={"FAIL_RANK": "2"},
        note="rank 2 raises KeyError in user code; --tee 3 ([defaultN]: prefixes).",
    ),
    Scenario(
        "sigkill_rank1",
        "sigkill",
        env={"FAIL_RANK": "1", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:"},
        note="rank 1 sends itself SIGKILL (stands in for an external kill -9); [rankN]: prefixes.",
    ),
    Scenario(
        "segfault_rank3",
        "segfault",
        env={"FAIL_RANK": "3", "PYTHONFAULTHANDLER": "1"},
        note="rank 3 reads address 0 through ctypes (SIGSEGV), faulthandler on; --tee 3.",
    ),
    Scenario(
        "disk_full_rank0",
        "disk_full",
        env={"FAIL_RANK": "0"},
        launcher_args=[],
        note="rank 0 saves a checkpoint into a 1 MiB tmpfs; no prefixes (plain console).",
    ),
    Scenario(
        "dir_race_2nodes",
        "dir_race",
        nproc=2,
        nodes=2,
        launcher_args=[],
        note="OLMo #894 pattern: each node's local rank 0 rmtree/mkdir/renames stepN-tmp in "
        "one shared directory; two static-rendezvous agents, one merged console.",
    ),
    Scenario(
        "copytree_race",
        "copytree_race",
        env={"FAIL_RANK": "-1"},
        note="every rank copytree()s into one shared offloaded_tensors/ (DeepSpeed NVMe offload pattern); --tee 3.",
    ),
    Scenario(
        "torch_save_same_path",
        "torch_save_same_path",
        env={"FAIL_RANK": "-1"},
        launcher_args=["--redirects", "3"],
        per_rank_dir=True,
        note="every rank torch.save()s to one path and loads it back; per-rank files from "
        "--log-dir/--redirects 3 plus the agent console in console.log.",
    ),
    Scenario(
        "port_in_use",
        "port_in_use",
        env={"FAIL_RANK": "-1"},
        note="the master port is already bound by another process (static rendezvous).",
    ),
    Scenario(
        "gloo_timeout",
        "gloo_timeout",
        env={"FAIL_RANK": "3", "PG_TIMEOUT_S": "8"},
        note="rank 3 never joins an all_reduce; the others hit the 8 s gloo timeout.",
    ),
    Scenario(
        "oom_cgroup",
        "oom_cgroup",
        env={"FAIL_RANK": "1", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:"},
        note="rank 1 moves itself into a cgroup-v1 memory cgroup limited to 512 MiB and "
        "allocates until the kernel OOM killer SIGKILLs it (a real OOM kill).",
    ),
    Scenario(
        "dataloader_killed",
        "dataloader_killed",
        env={"FAIL_RANK": "2"},
        note="a DataLoader worker of rank 2 is SIGKILLed; --tee 3.",
    ),
    Scenario(
        "dataloader_shm_full",
        "dataloader_shm_full",
        env={"FAIL_RANK": "1"},
        note="rank 1's DataLoader workers pass 4 MiB tensors through a /dev/shm that is a "
        "2 MiB tmpfs (unshare --mount): shm full, not a SIGBUS; --tee 3.",
    ),
    Scenario(
        "loss_nan",
        "loss_nan",
        env={"FAIL_RANK": "1", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:"},
        note="rank 1 reads a sample with inf; the DETR-style check prints 'Loss is nan, "
        "stopping training' and exits 1.",
    ),
    Scenario(
        "import_error",
        "import_error",
        env={"FAIL_RANK": "-1"},
        note="every rank imports a module that is not installed; --tee 3.",
    ),
    Scenario(
        "cuda_unavailable",
        "cuda_unavailable",
        env={"FAIL_RANK": "-1"},
        note="a GPU script (torch.cuda.set_device) started on a CPU-only machine.",
    ),
    Scenario(
        "corrupt_load",
        "corrupt_load",
        env={"FAIL_RANK": "-1"},
        note="rank 0 writes a checkpoint that ends truncated to half (as a save cut short "
        "by a crash leaves it); every rank then loads it.",
    ),
    Scenario(
        "permission_denied",
        "permission_denied",
        env={"FAIL_RANK": "0"},
        note="the job runs as root without CAP_DAC_OVERRIDE (setpriv); the checkpoint "
        "directory belongs to user nobody, mode 755, so rank 0 gets EACCES.",
    ),
    Scenario(
        "gloo_bad_ifname",
        "exception",
        env={"FAIL_RANK": "-1", "GLOO_SOCKET_IFNAME": "ib0"},
        note="GLOO_SOCKET_IFNAME names an interface this machine does not have.",
    ),
    Scenario(
        "rdzv_timeout",
        "exception",
        nproc=2,
        nodes=2,
        env={"FAIL_RANK": "-1"},
        note="a 2-node c10d rendezvous where the second node never starts; join_timeout 15 s.",
    ),
]


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(sc: Scenario, ckpt: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "CKPT_DIR": str(ckpt),
            "PYTHONPATH": "",
        }
    )
    env.update(sc.env)
    return env


def agent_cmd(sc: Scenario, port: int, node_rank: int, log_dir: Path | None) -> list[str]:
    cmd = [TORCHRUN, f"--nproc-per-node={sc.nproc}", f"--nnodes={sc.nodes}"]
    if sc.name == "rdzv_timeout":
        cmd += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=fx",
            "--rdzv-conf=join_timeout=15",
        ]
    else:
        cmd += ["--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}", f"--node-rank={node_rank}"]
    cmd += sc.launcher_args
    if log_dir is not None:
        cmd += ["--log-dir", str(log_dir)]
    return [*cmd, str(WORKER), sc.scenario]


def run(sc: Scenario) -> None:
    """Run one scenario and write its fixture (a file, or a directory of per-rank logs)."""
    work = Path(tempfile.mkdtemp(prefix=f"ckfx-{sc.name}-"))
    ckpt = work / "ckpt"
    port = free_port()
    env = base_env(sc, ckpt)
    prefix: list[str] = []
    cleanup: list[list[str]] = []
    blocker = None
    if sc.scenario == "disk_full":
        ckpt.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ckpt)], check=True)
        cleanup.append(["umount", str(ckpt)])
    if sc.scenario == "permission_denied":
        # Root that lost CAP_DAC_OVERRIDE obeys file modes like any user: a checkpoint
        # directory owned by another user (nobody), mode 755, refuses its writes (EACCES).
        ckpt.mkdir()
        os.chown(ckpt, 65534, 65534)
        os.chmod(ckpt, 0o755)
        prefix = [
            "setpriv",
            "--bounding-set=-dac_override,-dac_read_search",
            "--inh-caps=-dac_override,-dac_read_search",
        ]
    if sc.scenario == "oom_cgroup":
        cg = Path("/sys/fs/cgroup/memory") / f"ckfx-{os.getpid()}"
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(512 * 1024 * 1024))
        env["OOM_CGROUP"] = str(cg)
        cleanup.append(["rmdir", str(cg)])
    if sc.scenario == "dataloader_shm_full":
        inner = 'mount -t tmpfs -o size=2m tmpfs /dev/shm && exec "$@"'
        prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner, "sh"]
    if sc.scenario == "port_in_use":
        blocker = socket.socket()
        blocker.bind(("0.0.0.0", port))
        blocker.listen()
    log_dir = work / "logs" if sc.per_rank_dir else None
    console = work / "console.log"
    nodes_to_start = 1 if sc.name == "rdzv_timeout" else sc.nodes
    with console.open("wb") as out:
        procs = [
            subprocess.Popen(
                prefix + agent_cmd(sc, port, n, log_dir),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=work,
                start_new_session=True,
            )
            for n in range(nodes_to_start)
        ]
        deadline = time.time() + 150
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    if blocker is not None:
        blocker.close()
    for c in cleanup:
        subprocess.run(c, check=False)
    codes = [p.returncode for p in procs]
    host = socket.gethostname()
    if sc.per_rank_dir:
        dest = OUT / sc.name
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for f in sorted((log_dir or work).rglob("*.log")):
            if f.stat().st_size == 0:
                continue
            rel = f.relative_to(log_dir)  # <run_id>/attempt_0/<local_rank>/stderr.log
            parts = rel.parts
            name = f"{parts[-2]}/{parts[-1]}" if parts[-2].isdigit() else parts[-1]
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_text(mask(f.read_text(errors="replace"), host))
        (dest / "console.log").write_text(mask(console.read_text(errors="replace"), host))
    else:
        (OUT / f"{sc.name}.log").write_text(mask(console.read_text(errors="replace"), host))
    print(f"{sc.name}: agents exited {codes}", flush=True)
    shutil.rmtree(work, ignore_errors=True)


def mask(text: str, host: str) -> str:
    """The one edit made to captured text: this machine's hostname."""
    return re.sub(rf"\b{re.escape(host)}\b", MASK_HOST, text) if host else text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="scenarios to run (default: all)")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for sc in SCENARIOS:
        if not args.names or sc.name in args.names:
            run(sc)


if __name__ == "__main__":
    main()
