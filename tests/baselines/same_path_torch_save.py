"""DDP's classic mistake: every rank ``torch.save``s its own state to ONE shared path.

Why: it shows that the resulting file is torn (fails to load) or, worse, loads silently
with tensors written by several ranks: the zip's CRCs are not checked by ``torch.load``.
Each rank saves ``--tensors`` tensors of ``--mib`` MiB filled with its rank + 1 (0 would be
indistinguishable from a hole), plus its rank as a plain field; after a barrier rank 0 loads the file and classifies it:

* ``clean``: loads, and every tensor and the field come from one rank
* ``mixed``: loads, but the values come from several ranks (silent corruption)
* ``torn``: ``torch.load`` raises

Prints ``SAMEPATH round=i result=...`` per round and a ``SAMEPATH SUMMARY`` line.
Exits 1 at the first non-clean round (or, with ``--all-rounds``, after all rounds if
any was not clean), 0 if every round was clean.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def classify(path: Path) -> tuple[str, str]:
    """('clean'|'mixed'|'torn', detail) for the file at ``path``."""
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:
        return "torn", f"{type(e).__name__}: {e}"
    writers = {int(state["rank"])}
    holes = False
    for t in state["tensors"]:
        for v in torch.unique(t).tolist():
            if v == 0:  # never written by anyone: a hole left by another rank's O_TRUNC
                holes = True
            else:
                writers.add(int(v) - 1)
    if len(writers) > 1 or holes:
        extra = " and zero-filled holes" if holes else ""
        return "mixed", f"values from ranks {sorted(writers)}{extra}"
    return "clean", f"all from rank {writers.pop()}"


def main() -> None:
    """Run the rounds; rank 0 judges each file."""
    p = argparse.ArgumentParser()
    p.add_argument("--root", default=os.environ.get("CKPT_ROOT"), help="default: $CKPT_ROOT")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--mib", type=float, default=1.0)
    p.add_argument(
        "--ragged",
        action="store_true",
        help="rank r's tensors get r*4096 extra elements, so the zip records do not line up",
    )
    p.add_argument("--all-rounds", action="store_true")
    a = p.parse_args()
    if not a.root:
        p.error("--root or CKPT_ROOT is required")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    numel = int(a.mib * 2**20) // 4 + (rank * 4096 if a.ragged else 0)
    # Same keys and (unless --ragged) same sizes on every rank: the zip records line up.
    state = {
        "rank": rank,
        "tensors": [torch.full((numel,), float(rank + 1)) for _ in range(a.tensors)],
    }
    path = Path(a.root) / "model.pt"
    counts = {"clean": 0, "mixed": 0, "torn": 0}
    verdict = torch.zeros(1, dtype=torch.int64)
    for i in range(a.rounds):
        dist.barrier()
        torch.save(state, path)
        dist.barrier()
        if rank == 0:
            result, detail = classify(path)
            counts[result] += 1
            print(f"SAMEPATH round={i} result={result} {detail}", flush=True)
            verdict[0] = int(result != "clean")
        dist.broadcast(verdict, src=0)
        if verdict.item() and not a.all_rounds:
            break
    if rank == 0:
        summary = " ".join(f"{k}={v}" for k, v in counts.items())
        print(f"SAMEPATH SUMMARY rounds={sum(counts.values())} {summary}", flush=True)
    bad = counts["mixed"] + counts["torn"]
    dist.destroy_process_group()
    if rank == 0 and bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
