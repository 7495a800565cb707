"""Worker used by tests/crash/test_beds.py to check the launcher itself.

Modes: ``ranks`` prints one ``PROBE rank=.. local_rank=.. node=.. world=..`` line per rank;
``raise RANK`` makes that global rank raise after the process group is up (``raise_or_hang RANK``:
and every other rank blocks forever, so only the launcher can end them); ``hang``
blocks forever (for the timeout test); ``lines N`` prints N numbered lines per rank
(to check that no output is lost).
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist


def main() -> None:
    mode = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_RANK"])
    node = int(os.environ["GROUP_RANK"])
    print(
        f"PROBE rank={rank} local_rank={local} node={node} world={world} pid={os.getpid()} "
        f"env={os.environ.get('BED_PROBE_ENV', '')} node_env={os.environ.get('BED_PROBE_NODE', '')}",
        flush=True,
    )
    if mode in ("raise", "raise_or_hang") and rank == int(sys.argv[2]):
        raise RuntimeError(f"injected failure on rank {rank}")
    if mode in ("hang", "raise_or_hang"):
        while True:
            time.sleep(1)
    if mode == "lines":
        for i in range(int(sys.argv[2])):
            print(f"LINE rank={rank} i={i}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
