"""OLMo's (legacy) ``_temporary_wd`` save protocol, re-implemented as a torchrun worker.

Why: ckptguard's tests must show that the beds reproduce the real race of OLMo #894,
and then that ckptguard does not fail where this does. The steps and mitigations follow
``allenai/OLMo olmo/checkpoint.py:551-600`` (``_temporary_wd``), ``olmo/train.py:495-506``
(the ``latest`` symlink) and ``olmo/util.py`` (``wait_for``, ``dir_is_empty``), as
described in the seed (OLMo #894) and ``shared/research/checkpoint-systems.md`` 1.1:

1. every rank: ``dir_is_empty(stepN)``; if not empty and ``save_overwrite``, each
   *leader* ``rmtree(stepN)``; barrier
2. each leader: ``rmtree(stepN-tmp)`` + ``mkdir(stepN-tmp, exist_ok=True)``
3. every rank: ``wait_for(stepN-tmp.exists, 10 s)``; barrier
4. every rank writes its file into ``stepN-tmp``; barrier
5. each leader: ``stepN-tmp.replace(stepN)``; a ``FileNotFoundError`` is swallowed
   only ``if stepN.exists()`` (OLMo #255)
6. every rank: ``wait_for(stepN.exists, 10 s)`` (OLMo #235); barrier
7. each leader: ``latest.unlink(missing_ok=True)``, ``latest.symlink_to(stepN)``, a
   ``FileExistsError`` swallowed if ``latest`` already points at ``stepN``

Who the leaders are is the only difference between the two baselines: OLMo's default
``get_fs_local_rank()`` (every node's LOCAL_RANK 0: several leaders on shared storage)
and the patch proposed in #894 (global rank 0 only).

``--mitigations none`` drops OLMo's mitigations (no waits, no swallowing): the raw
pattern, which fails even on a local disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def wait_for(condition: Callable[[], bool], description: str, timeout: float = 10.0) -> None:
    """``olmo.util.wait_for``: poll every 0.5 s, TimeoutError after ``timeout``."""
    start = time.monotonic()
    while not condition():
        time.sleep(0.5)
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{description} timed out")


def dir_is_empty(d: Path) -> bool:
    """``olmo.util.dir_is_empty``."""
    if not d.is_dir():
        return True
    try:
        next(d.glob("*"))
        return False
    except StopIteration:
        return True


def save_once(root: Path, step: int, leader: bool, mitigations: bool, save_overwrite: bool) -> None:
    """One save of a toy checkpoint following ``_temporary_wd`` + the ``latest`` link."""
    rank = dist.get_rank()
    checkpoint_dir = root / f"step{step}"
    if not dir_is_empty(checkpoint_dir):
        if not save_overwrite:
            raise FileExistsError(checkpoint_dir)
        if leader:
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
    dist.barrier()

    tmp = checkpoint_dir.with_name(checkpoint_dir.name + "-tmp")
    if leader:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(exist_ok=True, parents=True)
    if mitigations:
        wait_for(tmp.exists, "Waiting for checkpoint directory", timeout=10.0)
    dist.barrier()

    # The "checkpoint": a few small tensors per rank.
    state = {"rank": rank, "step": step, "w": torch.full((64,), float(rank))}
    torch.save(state, tmp / f"rank{rank}.pt")
    dist.barrier()

    if leader:
        try:
            tmp.replace(checkpoint_dir)
        except FileNotFoundError:
            # OLMo: "another (file-system) local rank 0 has already replaced the tmp directory".
            if not mitigations or not checkpoint_dir.exists():
                raise
    if mitigations:
        wait_for(checkpoint_dir.exists, "Waiting for checkpoint directory", timeout=10.0)
    dist.barrier()

    if leader:
        latest = root / "latest"
        latest.unlink(missing_ok=True)
        try:
            latest.symlink_to(checkpoint_dir.name, target_is_directory=True)
        except FileExistsError:
            if not mitigations or latest.resolve().name != checkpoint_dir.name:
                raise
    dist.barrier()


def main(leader_fn: Callable[[], bool], name: str) -> None:
    """Run ``--saves`` saves; print the first failure and exit 1."""
    p = argparse.ArgumentParser(prog=name)
    p.add_argument("--root", default=os.environ.get("CKPT_ROOT"), help="default: $CKPT_ROOT")
    p.add_argument("--saves", type=int, default=10)
    p.add_argument(
        "--same-step",
        action="store_true",
        help="save step 0 every time (a restarted run re-saving with save_overwrite)",
    )
    p.add_argument("--mitigations", choices=("olmo", "none"), default="olmo")
    a = p.parse_args()
    if not a.root:
        p.error("--root or CKPT_ROOT is required")
    root = Path(a.root)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    leader = leader_fn()
    for i in range(a.saves):
        step = 0 if a.same_step else i
        try:
            save_once(root, step, leader, a.mitigations == "olmo", save_overwrite=True)
        except Exception as e:
            traceback.print_exc()
            print(
                f"BASELINE FAILED {name} save={i} step={step} rank={rank}: {type(e).__name__}: {e}",
                flush=True,
            )
            sys.stdout.flush()
            os._exit(1)  # like an uncaught exception, without hanging in gloo teardown
    if rank == 0:
        print(f"BASELINE OK {name} saves={a.saves}", flush=True)
    dist.destroy_process_group()
