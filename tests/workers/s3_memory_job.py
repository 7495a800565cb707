"""One process saves a state to an s3:// root and loads it back, reporting the peak resident memory of
each above the resident set at its start (Linux: the high-water mark reset through
/proc/self/clear_refs). The endpoint comes from AWS_ENDPOINT_URL. Prints one ``RESULT <json>`` line.

    python tests/workers/s3_memory_job.py s3://bucket/prefix MIB PART_MIB
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ckptguard import Checkpointer

from tests.support.results import emit_result


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _peak_above(fn: object) -> int:
    Path("/proc/self/clear_refs").write_text("5")
    start = _kib("VmRSS")
    fn()  # type: ignore[operator]
    return (_kib("VmHWM") - start) * 1024


def main() -> None:
    url, mib, part_mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    elems = (mib << 20) // 4 // 4
    state = {f"t{i}": torch.randn(elems + i * 1001) for i in range(4)}  # sizes cut across parts
    target = {k: torch.zeros_like(v) for k, v in state.items()}  # zeros: their pages are resident
    options = {"part_size": part_mib << 20}
    with Checkpointer(url, storage_options=options, keep_last=2) as ck:
        small = {"w": torch.ones(10)}
        ck.save(0, small)  # warm-up: the client, its models and threads
        ck.load({"w": torch.zeros(10)}, step=0)
        save = _peak_above(lambda: ck.save(1, state))
        load = _peak_above(lambda: ck.load(target, step=1))
    equal = all(torch.equal(state[k], target[k]) for k in state)
    emit_result(save_above=save, load_above=load, state_bytes=sum(v.nbytes for v in state.values()), equal=equal)


if __name__ == "__main__":
    main()
