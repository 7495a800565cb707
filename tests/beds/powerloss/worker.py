"""One rank of a scenario: a setup that is not recorded, then the recorded part, on the FUSE mount.

``python -m beds.powerloss.worker SCENARIO PHASE ROOT WORKDIR`` with ``RANK``, ``WORLD_SIZE``
and ``POWERLOSS_INIT`` (a FileStore path) in the environment. Rank 0 starts and stops the
recording; every rank sets a ``committed-r<rank>`` mark as soon as the library told it the
new state is durable (save()/wait()/save_file() returned): a crash after the first such mark
must load the new state. ``POWERLOSS_BREAK`` breaks the recorded part on purpose, to show
the bed catches it: ``no_dir_fsync`` (fsync of a directory does nothing) or
``no_file_fsync`` (fsync of a regular file does nothing).

Only the public API is used: Checkpointer, save_file, load_file.
"""

from __future__ import annotations

import os
import stat
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ckptguard import Checkpointer, save_file

from .bed import control
from .content import artifact_files, file_object, make_state, write_tree
from .scenarios import SCENARIOS


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
    dist.init_process_group("gloo", init_method=f"file://{os.environ['POWERLOSS_INIT']}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    mount = os.environ["POWERLOSS_MOUNT"]
    spec = SCENARIOS[scenario]
    files_dir = os.path.join(workdir, f"rank{rank}")

    def files_for(step: int, gen: int) -> dict[str, str] | None:
        if not spec.files:
            return None
        if os.path.isdir(files_dir):
            import shutil

            shutil.rmtree(files_dir)
        write_tree(files_dir, artifact_files(step, gen, rank))
        return {"offload": files_dir}

    def save(ck: Checkpointer, step: int, gen: int, **kw: Any) -> None:
        ck.save(step, make_state(step, gen, rank), files=files_for(step, gen), **kw)

    def committed() -> None:
        control(mount, "mark", f"committed-r{rank}")

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

    if rank == 0:
        os.makedirs(root, exist_ok=True)
    dist.barrier()
    (step, gen), pre = spec.new, spec.pre
    if scenario == "save_file":
        path = os.path.join(root, "model.pt")
        save_file(file_object(1), path)
        start()
        save_file(file_object(2), path)
        committed()
        stop()
    elif scenario == "takeover" and phase == "A":
        # Job A saves and dies without releasing its lease (os._exit skips atexit), as a crash would.
        ck = Checkpointer(root, lease_ttl_s=30)
        for s, g in pre:
            save(ck, s, g)
        ck.wait()
        dist.barrier()
        os._exit(0)
    elif scenario == "takeover":
        start()
        ck = Checkpointer(root, lease_ttl_s=30, lease_wait_s=60)  # A's holder pid is dead: taken at once
        save(ck, step, gen)
        committed()
        ck.close()
        stop()
    else:
        keep = {"keep_last": spec.keep_last} if spec.keep_last else {}
        if pre:
            with Checkpointer(root, **keep) as ck:
                for s, g in pre:
                    save(ck, s, g)
        start()
        ck = Checkpointer(root, **keep)
        if scenario == "async":
            state = make_state(step, gen, rank)
            ck.save(step, state, blocking=False)
            control(mount, "mark", f"returned-r{rank}")
            for v in (state["big"], state["ints"]):  # training goes on and changes the tensors
                v.add_(1)
            ck.wait()
        else:
            save(ck, step, gen, overwrite=spec.overwrite)
        committed()
        ck.close()
        stop()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
