"""Which rank stopped a hung job, decided over every node's ``hang.json`` (``stopped_rank``).

The rank not inside the collective the others wait in; when all wait in collectives, the odd one
out; with no collective at all, the lowest rank. Ranks nobody knows are named by pid.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptguard.runner.rankstate import main_thread


@dataclass
class Verdict:
    """Which rank stopped, and how the job's hang is explained."""

    rank: int | None
    state: str
    detail: str
    waiting: list[int]
    others: list[int]  # other ranks that are not in the collective either
    collective: str | None
    text: str
    #: The process named when no rank is known (processes named by pid), else None.
    pid: int | None = None


def stopped_rank(records: list[Mapping[str, Any]]) -> Verdict:
    """Name the rank that stopped from every node's ``hang.json`` processes: the one not inside the
    collective the others wait in; when all wait in collectives, the odd one out (another
    collective); with no collective at all, the lowest rank (or the only process).

    When no process's rank is known (ranks started without a launcher and without
    ``init_process_group``, a Python wrapper running the job as a child), the processes whose
    stacks were captured are named by pid, leaving out those that only wait for a child process
    of the job (a launcher, a wrapper); one such process left is the job, as rank 0."""
    ranks: dict[int, Mapping[str, Any]] = {}
    unranked: list[Mapping[str, Any]] = []
    for rec in records:
        procs = [p for p in rec.get("processes") or [] if isinstance(p, Mapping)]
        parents = {p.get("ppid") for p in procs if p.get("threads")}
        for p in procs:
            r = p.get("rank")
            if isinstance(r, int) and not isinstance(r, bool):
                if r not in ranks or (p.get("threads") and not ranks[r].get("threads")):
                    ranks[r] = p
            elif p.get("threads") and not _forked(p) and not (p.get("pid") in parents and _waits_for_child(p)):
                unranked.append(p)
    by_pid = False
    if not ranks and len(unranked) == 1:  # a plain `python script.py`: the one process is the job
        ranks[0] = unranked[0]
        one = _verdict(ranks)
        one.pid = int(unranked[0].get("pid") or 0) or None
        if one.pid is not None:
            one.text += f" (process {one.pid}, the one process of the job not waiting for a child)"
        return one
    elif not ranks and unranked:
        by_pid = True
        ranks = {int(p.get("pid") or 0): p for p in unranked}
    if not ranks:
        return Verdict(
            None, "unknown", "no rank's stack was captured", [], [], None, "no rank's stack could be captured"
        )
    if not any(p.get("threads") for p in ranks.values()):  # the kernel's view only: no rank to name
        where = "; ".join(f"rank {r}: {_kernel_state(p)}" for r, p in sorted(ranks.items()))
        return Verdict(
            None,
            "unknown",
            "no Python stack was captured",
            [],
            sorted(ranks),
            None,
            f"no rank's Python stack was captured, so no rank can be named ({where})",
        )
    v = _verdict(ranks)
    if not by_pid:
        return v
    return Verdict(
        None,
        v.state,
        v.detail,
        v.waiting,
        v.others,
        v.collective,
        "no process's rank is known, so processes are named by pid: "
        + re.sub(r"\branks? (?=\d)", lambda m: "processes " if m.group(0).startswith("ranks") else "process ", v.text),
        pid=v.rank,
    )


_CHILD_WAITS = ("/subprocess.py", "multiprocessing/popen_", "multiprocessing/process.py", "torch/multiprocessing/")


def _forked(p: Mapping[str, Any]) -> bool:
    """A process forked (not exec'd) by another of the job and not a rank: a data-loader worker, a helper."""
    return str(p.get("stack_file") or "").endswith(".fork.txt")


def _waits_for_child(p: Mapping[str, Any]) -> bool:
    """The process's main thread waits for a child process (a wrapper, a launcher)."""
    raw = p.get("threads")
    frames = main_thread([t for t in raw if isinstance(t, list) and t] if isinstance(raw, list) else [])
    return any(any(w in str(f.get("file")) for w in _CHILD_WAITS) or f.get("func") == "waitpid" for f in frames)


def _kernel_state(p: Mapping[str, Any]) -> str:
    if p.get("syscall"):
        return f"blocked in {p.get('syscall')}()" + (f" on {p.get('path')}" if p.get("path") else "")
    return f"sleeping in {p.get('wchan')}" if p.get("wchan") else "state unknown"


def _verdict(ranks: Mapping[int, Mapping[str, Any]]) -> Verdict:
    in_coll = {r: str(p.get("detail")) for r, p in ranks.items() if p.get("state") == "collective"}
    outside = sorted(r for r in ranks if r not in in_coll)
    ops = Counter(in_coll.values())
    if in_coll and outside:
        main_op = ops.most_common(1)[0][0]
        stopped = outside[0]
        waiting = sorted(r for r, op in in_coll.items() if op == main_op)
        p = ranks[stopped]
        return Verdict(
            stopped,
            str(p.get("state")),
            str(p.get("detail")),
            waiting,
            outside[1:],
            main_op,
            f"rank {stopped} is not in the collective {main_op} that {_ranks(waiting)} {_wait(waiting)} in: "
            f"it is {p.get('detail')}",
        )
    if len(ops) > 1:
        main_op, _ = ops.most_common(1)[0]
        odd = sorted(r for r, op in in_coll.items() if op != main_op)
        tie = ops.most_common()[0][1] == ops.most_common()[1][1]
        if tie:  # no majority: a point-to-point call is the odd one out, else the lowest rank's call
            p2p = [op for op in ops if op in _P2P]
            odd_op = p2p[0] if len(p2p) == 1 else in_coll[min(in_coll)]
            main_op = next(op for op, _ in ops.most_common() if op != odd_op)
            odd = sorted(r for r, op in in_coll.items() if op == odd_op)
        stopped = odd[0]
        waiting = sorted(r for r, op in in_coll.items() if op == main_op)
        return Verdict(
            stopped,
            "other_collective",
            in_coll[stopped],
            waiting,
            odd[1:],
            main_op,
            f"rank {stopped} waits in {in_coll[stopped]} while {_ranks(waiting)} {_wait(waiting)} in "
            f"{main_op}: the ranks called different collectives"
            + (" (as many ranks in each: the odd one out is a guess)" if tie else ""),
        )
    if in_coll:
        op = next(iter(ops))
        return Verdict(
            None,
            "collective",
            op,
            sorted(in_coll),
            [],
            op,
            f"every rank captured ({_ranks(sorted(in_coll))}) waits in {op}: the rank they wait for "
            "is not among them (another node whose stacks are missing, or a rank that exited)",
        )
    stopped = outside[0]
    p = ranks[stopped]
    return Verdict(
        stopped,
        str(p.get("state")),
        str(p.get("detail")),
        [],
        outside[1:],
        None,
        f"rank {stopped} is {p.get('detail')}"
        + (f" (as {'is' if len(outside) == 2 else 'are'} {_ranks(outside[1:])})" if outside[1:] else ""),
    )


_P2P = {"send", "recv", "isend", "irecv", "batch_isend_irecv"}


def _wait(rs: list[int]) -> str:
    return "waits" if len(rs) == 1 else "wait"


def _ranks(rs: list[int]) -> str:
    if not rs:
        return "no rank"
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))
