"""One rank of a scenario: a setup that is not recorded, then the recorded part, on the FUSE mount.

``python -m tests.support.beds.powerloss.worker SCENARIO PHASE ROOT WORKDIR`` with ``RANK``, ``WORLD_SIZE``
and ``POWERLOSS_INIT`` (a FileStore path) in the environment. Rank 0 starts and stops the
recording; after the i-th save every rank sets a ``committed<i>-r<rank>`` mark as soon as
the library told it the save is durable (save()/wait()/save_file() returned): a crash after
the first such mark must find that save committed. ``POWERLOSS_BREAK`` breaks the recorded part on purpose, to show
the bed catches it: ``no_dir_fsync`` (fsync of a directory does nothing) or
``no_file_fsync`` (fsync of a regular file does nothing).

Only the public API is used: Checkpointer, save_file.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from datetime import timedelta

import torch.distributed as dist

from ckptguard import Checkpointer, save_file

from .bed import control
from .content import artifact_files, file_object, make_state, write_tree
from .scenarios import FRESH_SUBDIRS, SCENARIOS


def _break(kind: str) -> None:
    real = os.fsync

    def fsync(fd: int) -> None:
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        if (kind == "no_dir_fsync" and is_dir) or (kind == "no_file_fsync" and not is_dir):
            return
        real(fd)

    os.fsync = fsync


def main(scenario: str, phase: str, root: str, workdir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.environ['POWERLOSS_INIT']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    mount = os.environ["POWERLOSS_MOUNT"]
    spec = SCENARIOS[scenario]
    files_dir = os.path.join(workdir, f"rank{rank}")

    def files_for(step: int, gen: int) -> dict[str, str] | None:
        if not spec.files:
            return None
        shutil.rmtree(files_dir, ignore_errors=True)
        write_tree(files_dir, artifact_files(step, gen, rank))
        return {"offload": files_dir}

    def start() -> None:
        dist.barrier()
        if rank == 0:
            control(mount, "start", scenario)
        dist.barrier()
        if os.environ.get("POWERLOSS_BREAK"):
            _break(os.environ["POWERLOSS_BREAK"])

    def stop() -> None:
        dist.barrier()
        if rank == 0:
            control(mount, "stop")

    def save_all(ck: Checkpointer) -> None:
        for i, (step, gen, mode) in enumerate(spec.saves):
            state = make_state(step, gen, rank)
            ck.save(step, state, files=files_for(step, gen), overwrite=mode == "overwrite", blocking=mode != "async")
            if mode == "async":
                control(mount, "mark", f"returned{i}-r{rank}")
                for v in (state["big"], state["ints"]):  # training goes on and changes the tensors
                    v.add_(1)
                ck.wait()
            # The library says the save is durable: a crash from here on must load it (or newer).
            control(mount, "mark", f"committed{i}-r{rank}")

    if rank == 0 and not (spec.fresh_dir and spec.kind == "checkpoint"):
        os.makedirs(root, exist_ok=True)
    dist.barrier()
    keep = {"keep_last": spec.keep_last} if spec.keep_last else {}
    if spec.kind == "file":
        path = os.path.join(root, *FRESH_SUBDIRS, "model.pt") if spec.fresh_dir else os.path.join(root, "model.pt")
        for _ in spec.pre:
            save_file(file_object(1), path)
        start()
        save_file(file_object(2), path)
        control(mount, "mark", f"committed0-r{rank}")
        stop()
    elif scenario == "takeover" and phase == "A":
        # Job A saves and dies without releasing its lease (os._exit skips atexit), as a crash would.
        ck = Checkpointer(root, lease_ttl_s=30, **keep)
        for s, g in spec.pre:
            ck.save(s, make_state(s, g, rank), files=files_for(s, g))
        ck.wait()
        dist.barrier()
        os._exit(0)
    else:
        if spec.pre and phase == "main" and "A" not in spec.phases:
            with Checkpointer(root, **keep) as ck:
                for s, g in spec.pre:
                    ck.save(s, make_state(s, g, rank), files=files_for(s, g))
        start()
        # In the takeover scenario job A's lease holder is dead (same host and boot): taken at once.
        ck = Checkpointer(root, lease_ttl_s=30, lease_wait_s=60, **keep)
        save_all(ck)
        ck.close()
        stop()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
