"""Worker for tests/save/test_agreed_refusals.py: save() arguments that only rank 1 gets wrong.

Each case calls save() on every rank, with the bad argument on rank 1 only, and reports per rank the
error class, its message and how long the call took; then every rank saves a good step, so a rank
that moved on (and paired with the others' next save) shows. Every rank prints ``RESULT <json>`` lines.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import ckptguard

from tests.support.results import emit_result


def deep(n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for _ in range(n):
        out = {"x": out}
    return out


def cases(rank: int, tmp: str) -> dict[str, dict[str, Any]]:
    """name -> the keyword arguments of this rank's save() (the good ones on every rank but 1)."""
    bad = rank == 1
    return {
        "metadata_nan": {"metadata": {"loss": math.nan if bad else 1.0}},
        "metadata_inf": {"metadata": {"loss": math.inf if bad else 1.0}},
        "metadata_key": {"metadata": {("a", 1) if bad else "a": 1}},
        "metadata_deep": {"metadata": deep(500) if bad else {"x": 1}},
        "files_missing": {"files": {"notes": os.path.join(tmp, "absent" if bad else f"notes{rank}")}},
        "files_kind": {"files": {"notes": 3 if bad else os.path.join(tmp, f"notes{rank}")}},
        "state_key": {"state_extra": {1: torch.ones(1)} if bad else {}},
        "state_tensor": {"state_extra": {"m": torch.eye(2).to_sparse()} if bad else {}},
        "step_differs": {"step_offset": 1 if bad else 0},
        "step_negative": {"step_override": -1 if bad else None},
        "async_metadata_nan": {"metadata": {"loss": math.nan if bad else 1.0}, "blocking": False},
    }


def main() -> None:
    root, tmp = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    with open(os.path.join(tmp, f"notes{rank}"), "w") as f:
        f.write("notes")
    ck = ckptguard.Checkpointer(root, collective_timeout_s=60)
    state = {"w": torch.arange(100.0)}
    ck.save(0, state)
    for step, (name, kwargs) in enumerate(cases(rank, tmp).items(), start=1):
        call = dict(kwargs)
        extra = call.pop("state_extra", {})
        this_step = step + call.pop("step_offset", 0)
        override = call.pop("step_override", None)
        if override is not None:
            this_step = override
        started = time.monotonic()
        error: BaseException | None = None
        try:
            ck.save(this_step, {**state, **extra}, **call)
            ck.wait()
        except Exception as e:
            error = e
        emit_result(
            case=name,
            error=type(error).__name__ if error else None,
            message=str(error) if error else "",
            seconds=round(time.monotonic() - started, 2),
        )
    ck.save(100, {"w": torch.arange(100.0) + rank * 0})
    emit_result(case="after", steps=ck.steps())
    started = time.monotonic()
    try:  # each rank would read another step
        ck.load({"w": torch.zeros(100)}, step=0 if rank == 1 else 100)
        error: BaseException | None = None
    except Exception as e:
        error = e
    emit_result(
        case="load_step_differs",
        error=type(error).__name__ if error else None,
        message=str(error) if error else "",
        seconds=round(time.monotonic() - started, 2),
    )
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
