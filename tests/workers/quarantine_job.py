"""Worker for tests/load/test_quarantine.py: the quarantine with several storage domains (node-local roots,
one per node: CKPT_ROOT). Steps 1 and 2 are saved; node 1's copy of step 2 is then damaged (one bit of
a data file), so the load of step 2 fails on rank 1 alone and every rank falls back to step 1; each
domain's leader records step 2 as corrupt in its own root; the loop's next save(2) replaces it on
both. Every rank prints ``RESULT <json>`` lines."""

from __future__ import annotations

import datetime
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import ckptguard
from ckptguard.protocol.manifest import Manifest

from tests.support.results import emit_result


def state_of(step: int) -> dict[str, object]:
    return {"w": torch.arange(1000.0) + step, "step": step}


def flip(root: Path, step: int) -> None:
    step_dir = root / f"step-{step:08d}"
    mpath = step_dir / "MANIFEST.json"
    (row,) = [r for r in Manifest.from_json(mpath.read_bytes(), str(mpath)).items if r.fqn == "w"]
    path = step_dir / row.file
    data = bytearray(path.read_bytes())
    data[row.offset + row.length - 1] ^= 0x01
    path.write_bytes(bytes(data))


def records(root: Path) -> list[str]:
    return sorted(p.name for p in (root / ".ckptguard" / "quarantine").glob("*.json"))


def main() -> None:
    root = Path(os.environ["CKPT_ROOT"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    ck = ckptguard.Checkpointer(root, collective_timeout_s=60)
    ck.save(1, state_of(1))
    ck.save(2, state_of(2))
    if rank == 1:
        flip(root, 2)
    dist.barrier()
    out = {"w": torch.zeros(1000), "step": -1}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded = ck.load(out)
    emit_result(
        phase="fallback", loaded=loaded, step=out["step"], records=records(root), warned=[str(w.message) for w in seen]
    )
    ck.save(2, state_of(20))  # the loop goes on: no StepExistsError
    out = {"w": torch.zeros(1000), "step": -1}
    loaded = ck.load(out)
    emit_result(
        phase="resaved",
        loaded=loaded,
        step=out["step"],
        records=records(root),
        dirs=sorted(p.name for p in root.glob("step-*")),
    )
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
