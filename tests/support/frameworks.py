"""What the framework-integration tests share: a 2-rank torchrun of a worker script, the JSONL
records each rank writes (``<prefix>.rank<N>.jsonl``), and a digest of model and optimizer state
that the workers compare across a save and a resume."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from .jobs import run_workers

REPO = Path(__file__).resolve().parents[2]


def torchrun(
    worker: Path, *args: str, env: Mapping[str, str] | None = None, nproc: int = 2, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``worker`` on ``nproc`` local ranks (gloo on loopback) as ``torchrun --standalone`` would, without
    its agent (:func:`tests.support.jobs.run_workers`); the library and ``tests.support`` importable from this
    checkout."""
    full_env = {
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    }
    return run_workers([str(worker), *args], nproc=nproc, env=full_env, timeout=timeout)


def records(prefix: Path, rank: int) -> list[dict[str, Any]]:
    f = Path(f"{prefix}.rank{rank}.jsonl")
    return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []


def losses(prefix: Path, rank: int) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(prefix, rank) if r["kind"] == "loss"}


def tail(r: subprocess.CompletedProcess[str]) -> str:
    return r.stdout[-3000:] + r.stderr[-3000:]


def state_digest(model: Any, optim: Any, sched: Any = None) -> str:
    """SHA-256 of a module's state, an optimizer's per-parameter state and (optionally) a scheduler's;
    of this rank's own shards where they are DTensors (FSDP2)."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(v: Any) -> Any:
        return v.to_local() if isinstance(v, DTensor) else v

    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(local(v).detach().numpy().tobytes())
    for pid, st in sorted(optim.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{pid}.{k}".encode())
            h.update(local(v).detach().numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    if sched is not None:
        h.update(repr(sorted(sched.state_dict().items())).encode())
    return h.hexdigest()


def run_worker(main: Callable[[], None]) -> NoReturn:
    """A framework worker's ``__main__``: run ``main``, tear the process group down and leave without the
    interpreter's own teardown, where torch's gloo threads can abort a rank that has finished and
    recorded its work ("terminate called without an active exception", exit -6)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
