"""The campaign's fault kinds beyond kills at save phases (the engine's other half; ``campaign.py`` dispatches here).

    kill_overwrite  SIGKILL during ``save(..., overwrite=True)`` on node-local roots (two storage
                    domains): at a named phase (the leader phases aimed at either domain's leader)
                    or at a random moment
    kill_rollback   SIGKILL during the saves that follow a rollback (``load(step=r)`` of an older
                    step, then r+1, r+2, ...), same layout and fault points
    stop            SIGSTOP of a job (one process, every thread) in a phase of a save, inside the
                    move of ``latest``, in retention, in a lease renewal or in the lease release;
                    another job takes the root over and is stopped inside a save of its own; the
                    first is resumed (SIGCONT) and must change nothing of the second's

Chains work as in ``campaign.py`` (each job is the restart of the previous trial), but judge in
commit order: ``latest`` carries a sequence number, ``steps()`` lists in commit order, and a
rollback makes a lower step the newest.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptguard._faults import FaultPhase

from .campaign import (
    KEEP_LAST,
    LEADER_PHASES,
    SAVE_PHASES,
    LatestWatch,
    Topo,
    Trial,
    check_saved_clean,
    classify_kill,
    events_of,
    tail,
)
from .jobs import REPO, process_state
from .results import parse_results
from .workers import CAMPAIGN_JOB

if TYPE_CHECKING:
    from .campaign import Campaign

#: SIGSTOP points of a ``stop`` trial: the library's own fault points, then those the worker adds.
STOP_POINTS = (
    *(p.value for p in SAVE_PHASES),
    "latest",
    "latest-cas",
    "retention",
    "renewal",
    "renewal-cas",
    "release",
)


# -- commit-order chains (kill_overwrite, kill_rollback) --------------------------------------------


@dataclass
class OrderedHistory:
    """What the driver knows about a chain's roots, in commit order."""

    committed: list[int]  # the last agreed listing rank 0 reported, in commit order
    allowed: dict[int, set[int]]  # step -> the gens its committed content may hold
    inflight: tuple[int, int, bool] | None = None  # (step, gen, overwrite) of the save a fault cut short
    order_log: list[str] = field(default_factory=list)


def retained(order: list[int], new: int, keep_last: int) -> set[int]:
    """The documented retention rule (README guarantee 9), modelled independently of the library:
    ``order`` in commit order with ``new`` committed last; a checkpoint is abandoned when one of a
    lower step was committed after it; abandoned ones rank below the current line; keep the last
    ``keep_last`` of that ranking and the new one."""
    seq = [s for s in order if s != new] + [new]
    abandoned = [s for i, s in enumerate(seq) if any(t < s for t in seq[i + 1 :])]
    current = [s for s in seq if s not in abandoned]
    ranking = abandoned + current
    return set(ranking[-keep_last:]) | {new}


def check_restart_ordered(trial: Trial, evs: dict[int, list[dict[str, Any]]], hist: OrderedHistory | None) -> None:
    """Restart checks in commit order: nothing invented, nothing lost beyond what retention of the cut
    save may retire, commit order preserved, newest = committed last, every load bitwise and of an
    allowed gen, a clean save, no garbage after it."""
    start = events_of(evs, "start", 0)
    if not start:
        trial.fail("the restarted job did not get as far as listing its checkpoints")
        return
    steps: list[int] = start[0]["steps"]
    if hist is not None:
        invented = sorted(set(steps) - set(hist.allowed))
        if invented:
            trial.fail(f"steps {invented} are committed but no job ever saved them", torn=True)
        prev = hist.committed
        cut = hist.inflight[0] if hist.inflight else None
        gone = [s for s in prev if s not in steps]
        if gone:
            if cut is None or cut not in steps:
                trial.fail(
                    f"committed steps {gone} lost without a newer commit (before: {prev}, after: {steps})", lost=True
                )
            else:
                may_go = set(prev) - retained(prev, cut, KEEP_LAST)
                if not set(gone) <= may_go:
                    trial.fail(
                        f"committed steps {sorted(set(gone) - may_go)} lost: retention after committing "
                        f"{cut} keeps them (before: {prev}, after: {steps})",
                        lost=True,
                    )
        if prev:
            ok_newest = {prev[-1]} | ({cut} if cut is not None else set())
            if steps and steps[-1] not in ok_newest:
                trial.fail(
                    f"the newest checkpoint in commit order went from {prev[-1]} to {steps[-1]} "
                    f"(before: {prev}, after: {steps}, cut save: {cut})",
                    lost=steps[-1] in prev,
                )
        both = [s for s in steps if s in prev and s != cut]
        if both != [s for s in prev if s in both]:
            trial.fail(f"commit order changed: before {prev}, after {steps}")
        if cut is not None and cut in steps and cut not in prev and steps[-1] != cut:
            trial.fail(f"the cut save's step {cut} is committed but not last in commit order: {steps}")
    for e in events_of(evs, "failed-load"):
        if not e["untouched"]:
            trial.fail(
                f"rank {e['rank']}: a failed load ({e['what']}, {e['error']}) changed the caller's state", torn=True
            )
    for e in events_of(evs, "loaded"):
        if e["what"] not in ("newest", "older", "rollback"):
            continue
        if not e["ok"]:
            trial.fail(f"rank {e['rank']} loaded step {e['step']} with wrong content: {e['bad']}", torn=True)
        if e["extra_files"]:
            trial.fail(
                f"rank {e['rank']}: step {e['step']}'s files= restore holds files it does not: {e['extra_files']}",
                torn=True,
            )
        if hist is not None and e["step"] is not None and e["gen"] not in hist.allowed.get(e["step"], {e["gen"]}):
            trial.fail(
                f"rank {e['rank']} loaded step {e['step']} as saved by job {e['gen']}, but it holds one "
                f"of jobs {sorted(hist.allowed[e['step']])}",
                torn=True,
            )
        if e["what"] == "newest":
            if e["step"] != (steps[-1] if steps else None):
                trial.fail(
                    f"rank {e['rank']}: load() returned step {e['step']}, committed last is "
                    f"{steps[-1] if steps else None}"
                )
            if e["warned"]:
                trial.fail(f"rank {e['rank']}: load() warned: {e['warned']}")
    # Every rank must load the same gen of a step (one agreed version across domains).
    seen: dict[tuple[str, int], set[int]] = {}
    for e in events_of(evs, "loaded"):
        if e["what"] in ("newest", "older") and e["step"] is not None:
            seen.setdefault((e["what"], e["step"]), set()).add(e["gen"])
    for (what, s), gens in seen.items():
        if len(gens) > 1:
            trial.fail(f"ranks loaded different versions of step {s} ({what}): jobs {sorted(gens)}", torn=True)
    check_saved_clean(trial, evs)


def update_ordered(hist: OrderedHistory | None, evs: dict[int, list[dict[str, Any]]]) -> OrderedHistory:
    """After a job: resolve what its restart loaded, then apply its saves (the last one maybe cut)."""
    allowed = {k: set(v) for k, v in (hist.allowed if hist else {}).items()}
    committed = list(hist.committed) if hist else []
    start = events_of(evs, "start", 0)
    if start:
        committed = start[0]["steps"]
        resolved = {
            e["step"]: e["gen"]
            for e in events_of(evs, "loaded", 0)
            if e["what"] in ("newest", "older") and e["step"] is not None and e["ok"]
        }
        allowed = {s: ({resolved[s]} if s in resolved else allowed.get(s, set())) for s in committed}
    inflight = None
    for e in evs.get(0, []):
        if e.get("event") == "saving":
            inflight = (e["step"], e["gen"], bool(e.get("overwrite")))
            allowed.setdefault(e["step"], set()).add(e["gen"])
        elif e.get("event") == "saved":
            allowed[e["step"]] = {e["gen"]}
            committed = e["committed"]
            inflight = None
    return OrderedHistory(committed, allowed, inflight)


def ordered_fault(c: Campaign, kind: str, i: int, topo: Topo) -> tuple[str, str]:
    """(variant, --fault spec) of the i-th trial of kill_overwrite/kill_rollback."""
    n = len(SAVE_PHASES) + 1
    if i % n == n - 1:
        return "random moment", f"random:{c.rng.randrange(topo.world)}:{c.rng.uniform(0.0, 1.5):.3f}"
    phase = SAVE_PHASES[i % n]
    ranks = topo.leaders if phase in LEADER_PHASES else tuple(range(topo.world))
    return phase.value, f"phase:{phase.value}:{c.rng.choice(ranks)}"


def ordered_chains(c: Campaign, plan: dict[str, int]) -> None:
    """kill_overwrite and kill_rollback on two simulated nodes with private roots (one rank each, so
    each is its domain's leader), one chain per kind."""
    for kind in ("kill_overwrite", "kill_rollback"):
        n = plan.get(kind, 0)
        if not n:
            continue
        roots = [c.fresh_root(f"{kind}-n{k}") for k in range(2)]
        topo = Topo("local", 2, 1, roots, roots, (0, 1))
        faults = [(kind, *ordered_fault(c, kind, i, topo)) for i in range(n)]
        c.rng.shuffle(faults)
        c.log(f"{kind} chain on node-local roots: {n} trials")
        _run_ordered_chain(c, topo, kind, faults)


def _run_ordered_chain(c: Campaign, topo: Topo, name: str, faults: list[tuple[str, str, str]]) -> None:
    mode = "overwrite" if name == "kill_overwrite" else "rollback"
    hist: OrderedHistory | None = None
    pending: Trial | None = None
    pending_s = 0.0
    with LatestWatch(topo.truth) as watch:
        for kind, sub, spec in [*faults, ("check", "final", "none")]:
            t0 = time.monotonic()
            gen = c.next_gen()
            at = c.rng.randrange(3)
            job, evs, timeout = c.job(
                topo,
                [
                    "chain2",
                    "--gen",
                    str(gen),
                    "--job-id",
                    f"campaign-{name}",
                    "--fault",
                    spec,
                    "--at",
                    str(at),
                    "--mode",
                    mode,
                    "--keep-last",
                    str(KEEP_LAST),
                    "--seed",
                    str(c.rng.randrange(2**31)),
                ],
            )
            judge = pending or Trial("chain", "first job")
            if job is not None:
                judge.jobs.append(job)
            check_restart_ordered(judge, evs, hist)
            for v in watch.take():
                judge.fail(v)
            if judge.problems and not events_of(evs, "saved", 0):
                judge.fail(f"the restart did not complete: {timeout or tail(job)}")
            if pending is not None or judge.problems:
                c.record(judge, pending_s)
            if kind == "check":
                if timeout or job is None or not job.ok:
                    final = Trial("chain", "final check", jobs=[job] if job else [])
                    final.fail(f"the final check job failed: {timeout or tail(job)}")
                    c.record(final, 0.0)
                break
            pending = Trial(kind, sub, fault=spec, signal="kill", jobs=[job] if job else [])
            for e in events_of(evs, "loaded"):
                if e["what"] == "rollback" and not e["ok"]:
                    pending.fail(
                        f"rank {e['rank']}: load(step={e['step']}) for the rollback returned wrong content: {e['bad']}",
                        torn=True,
                    )
            classify_kill(pending, job, evs, spec, timeout)
            hist = update_ordered(hist, evs)
            pending_s = time.monotonic() - t0


# -- stop trials ---------------------------------------------------------------------------------------


def _single(c: Campaign, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start a one-process job of the campaign worker (no torchrun), output to ``log``."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "CKPT_SCRATCH": str(c.scratch),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
    }
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "SLURM_JOB_ID",
        "CKPTGUARD_FAULT",
    ):
        env.pop(k, None)
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, str(CAMPAIGN_JOB), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _wait_stopped(p: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            return False
        if process_state(p.pid) == "T":
            return True
        time.sleep(0.02)
    return False


def _finish(p: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _kill(p: subprocess.Popen[bytes] | None) -> None:
    if p is not None and p.poll() is None:
        with contextlib.suppress(OSError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def root_tree(root: Path) -> dict[str, str]:
    """Every name under the root but the trash (what is on its way out) and the contents of the small
    files that say who holds what (`latest`, the lease)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        dirnames[:] = sorted(d for d in dirnames if not (rel == ".ckptguard" and d in ("trash", "locks")))
        for d in dirnames:
            out[os.path.join(rel, d)] = "dir"
        for f in filenames:
            if f.startswith(".") and ".tmp-" in f:
                continue  # a compare-and-swap's temp file in flight: the stopped job's own, not B's
            p = Path(dirpath) / f
            try:
                out[os.path.join(rel, f)] = p.read_text() if f in ("latest", "lease.json") else str(p.stat().st_size)
            except OSError as e:
                out[os.path.join(rel, f)] = f"unreadable: {e}"
    return out


class _Log:
    def __init__(self, path: Path) -> None:
        self.path = path

    def output(self) -> str:
        try:
            return self.path.read_text(errors="replace")
        except OSError:
            return ""

    def rank_output(self, rank: int) -> str:
        return self.output() if rank == 0 else ""


def stops(c: Campaign, n: int, ttl: float = 1.5, points: tuple[str, ...] = STOP_POINTS) -> None:
    """SIGSTOP trials: job A (one process) commits, stops itself at a point of ``STOP_POINTS``; job B
    waits A's lease out, takes the root over, loads A's newest bitwise, commits step 100 and stops
    inside its save of 101; A is resumed and runs to its end: every save it tries fails, and the root
    (names, sizes, `latest`, the lease record) is exactly as B left it; then B is resumed, finishes
    101, and both of B's steps load bitwise."""
    chosen = [points[i % len(points)] for i in range(n)]
    c.rng.shuffle(chosen)
    base = c.fresh_root("stop")
    base.mkdir(parents=True, exist_ok=True)
    for i, at in enumerate(chosen):
        c._yield()
        t0 = time.monotonic()
        root = base / f"root-{i}"
        ga, gb = c.next_gen(), c.next_gen()
        pre = c.rng.randrange(3)  # A commits 1..3 steps before the stop
        nth = c.rng.randrange(2) if at == "retention" else 0
        taker_stop = c.rng.choice(("before_write", "after_write", "before_publish"))
        sub = at if at != "retention" else f"retention #{nth + 1}"
        trial = Trial("stop", sub, fault=f"{at}:A:stop; taker {taker_stop}:B:stop", signal="stop")
        la, lb = base / f"a-{i}.log", base / f"b-{i}.log"
        a = b = None
        with LatestWatch([root]) as watch:
            try:
                a = _single(
                    c,
                    [
                        "holder",
                        "--root",
                        str(root),
                        "--gen",
                        str(ga),
                        "--lease-ttl",
                        str(ttl),
                        "--stop-at",
                        at,
                        "--at",
                        str(pre),
                        "--nth",
                        str(nth),
                    ],
                    la,
                )
                if not _wait_stopped(a, c.job_timeout):
                    trial.jobs = [_Log(la)]  # type: ignore[list-item]
                    # A retention stop needs something to retire: with nothing to retire it may not stop.
                    trial.fail(f"job A never reached its stop point {at}: {_Log(la).output()[-2000:]}")
                    c.record(trial, time.monotonic() - t0)
                    continue
                trial.injected = True
                b = _single(
                    c,
                    [
                        "taker",
                        "--root",
                        str(root),
                        "--gen",
                        str(gb),
                        "--lease-ttl",
                        str(ttl),
                        "--taker-stop",
                        taker_stop,
                    ],
                    lb,
                )
                if not _wait_stopped(b, c.job_timeout):
                    trial.fail(f"job B never took over and stopped in its save: {_Log(lb).output()[-2000:]}")
                else:
                    before = root_tree(root)
                    os.kill(a.pid, signal.SIGCONT)
                    rc_a = _finish(a, c.job_timeout)
                    after = root_tree(root)
                    _judge_holder(trial, parse_results(_Log(la).output()), rc_a, at, before, after)
                    os.kill(b.pid, signal.SIGCONT)
                    rc_b = _finish(b, c.job_timeout)
                    _judge_taker(trial, parse_results(_Log(lb).output()), rc_b, ga, gb, pre)
            finally:
                for p in (a, b):
                    if p is not None and p.poll() is None:
                        os.kill(p.pid, signal.SIGCONT)
                        _kill(p)
            for v in watch.take():
                trial.fail(v)
        trial.jobs = [_Log(la), _Log(lb)]  # type: ignore[list-item]
        c.record(trial, time.monotonic() - t0)
        if not trial.problems:
            shutil.rmtree(root, ignore_errors=True)
            la.unlink(missing_ok=True)
            lb.unlink(missing_ok=True)


def _diff(before: dict[str, str], after: dict[str, str]) -> str:
    gone = sorted(set(before) - set(after))
    new = sorted(set(after) - set(before))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    return f"gone {gone[:5]}, new {new[:5]}, changed {[(k, before[k][:80], after[k][:80]) for k in changed[:3]]}"


def _judge_holder(
    trial: Trial, evs: list[dict[str, Any]], rc: int | None, at: str, before: dict[str, str], after: dict[str, str]
) -> None:
    if rc is None:
        trial.fail("job A did not finish after SIGCONT")
        return
    if before != after:
        trial.fail(
            f"the stalled job A changed the root job B took over: {_diff(before, after)}",
            lost=any(k.startswith("step-") or ".ckptguard/staging" in k for k in set(before) - set(after)),
        )
    for e in evs:
        if e.get("event") == "outcome" and e["error"] is None:
            trial.fail(f"job A saved step {e['step']} after job B took the root over")
        elif e.get("event") == "outcome" and e["error"] != "LeaseLostError" and "lease" not in e.get("msg", ""):
            # Fenced inside a save (the attempt was moved away): the error must still say why.
            trial.fail(f"job A's save failed without saying it lost the lease: {e['error']}: {e.get('msg')}")
    if at != "release" and not any(e.get("event") == "outcome" for e in evs):
        trial.fail(f"job A reported no save outcome after it was resumed (rc {rc})")
    if at == "release" and not any(e.get("event") == "closed" for e in evs):
        trial.fail(f"job A's close() did not return (rc {rc})")


def _judge_taker(trial: Trial, evs: list[dict[str, Any]], rc: int | None, ga: int, gb: int, pre: int) -> None:
    if rc != 0:
        trial.fail(
            f"job B failed after job A ran (rc {rc}): {[e for e in evs if e.get('event') not in ('loaded',)][-3:]}"
        )
    for e in evs:
        if e.get("event") != "loaded":
            continue
        if not e["ok"]:
            trial.fail(f"job B loaded step {e['step']} with wrong content: {e['bad']}", torn=True)
        if e["what"] == "newest" and e["gen"] != ga:
            trial.fail(f"job B's first load got job {e['gen']}'s step {e['step']}, expected job A's", torn=True)
        if e["what"] == "taker-final" and e["gen"] != gb:
            trial.fail(f"after job A ran, step {e['step']} holds job {e['gen']}'s data, not job B's", torn=True)
    final = [e for e in evs if e.get("event") == "final"]
    if final and (final[0]["steps"] != [100, 101] or final[0]["latest"] != 101):
        trial.fail(
            f"job B ended with steps {final[0]['steps']}, latest {final[0]['latest']}, expected [100, 101], 101",
            lost=not {100, 101} <= set(final[0]["steps"]),
        )
    for e in evs:
        if e.get("event") == "garbage" and (e["staging"] or e["trash"]):
            trial.fail(f"garbage after job B's save: staging={e['staging']} trash={e['trash']}")


def _tmp(c: Campaign, prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir=c.workdir))


_ = FaultPhase  # the stop points above are its values


def run_lifecycle_kinds(c: Campaign, plan: dict[str, int]) -> None:
    """Run the lifecycle kinds of ``plan`` (``Campaign.run`` calls this after the kills at save phases)."""
    if plan.get("kill_overwrite") or plan.get("kill_rollback"):
        ordered_chains(c, plan)
    if plan.get("stop"):
        stops(c, plan["stop"])
    for kind in ("reader", "load_state", "restore", "per_rank", "async_exit", "hostile"):
        if plan.get(kind):
            globals()[f"run_{kind}"](c, plan[kind])


# -- a reader during retention and overwrite ------------------------------------------------------------


def run_reader(c: Campaign, n: int, per_pair: int = 20) -> None:
    """Reader trials: a writer process and a ``read_only`` reader process on one root (see
    ``scenario_rwriter``/``scenario_rreader``), ``per_pair`` trials per pair of processes."""
    done = 0
    while done < n:
        k = min(per_pair, n - done)
        c._yield()
        t0 = time.monotonic()
        sync = _tmp(c, "reader-")
        root = sync / "root"
        gen = c.next_gen()
        seed = c.rng.randrange(2**31)
        common = ["--root", str(root), "--gen", str(gen), "--sync", str(sync), "--trials", str(k), "--seed", str(seed)]
        lw, lr = sync / "writer.log", sync / "reader.log"
        w = _single(c, ["rwriter", *common], lw)
        r = _single(c, ["rreader", *common], lr)
        rc_w, rc_r = _finish(w, c.job_timeout + 30 * k), _finish(r, 60)
        _kill(w)
        _kill(r)
        wevs, revs = parse_results(_Log(lw).output()), parse_results(_Log(lr).output())
        seconds = (time.monotonic() - t0) / k
        committed: dict[int, set[int]] = {}
        for e in wevs:
            if e.get("event") == "saved":
                committed.setdefault(e["step"], set()).add(e["gen"])
        actions = {e["trial"]: e["action"] for e in wevs if e.get("event") == "rtrial"}
        reads = {e["trial"]: e for e in revs if e.get("event") == "read"}
        for i in range(k):
            action = actions.get(i, "?")
            e = reads.get(i)
            mode = "load(step=N)" if e and e["explicit"] else "load()"
            trial = Trial("reader", f"{action} under {mode}", jobs=[_Log(lw), _Log(lr)])  # type: ignore[list-item]
            if e is None:
                trial.fail(
                    f"trial {i}: the reader reported nothing (writer rc {rc_w}, reader rc {rc_r}): "
                    f"{_Log(lr).output()[-1500:]}"
                )
                c.record(trial, seconds)
                continue
            trial.injected = e["fired"] and action in ("retire", "overwrite")
            if e["outcome"] == "loaded":
                if e["bad"]:
                    trial.fail(
                        f"trial {i}: the reader loaded step {e['step']} with wrong content: {e['bad']}", torn=True
                    )
                if e["gen"] not in committed.get(e["step"], set()):
                    trial.fail(
                        f"trial {i}: the reader loaded step {e['step']} of job {e['gen']}, never committed", torn=True
                    )
                if e["extra_files"]:
                    trial.fail(f"trial {i}: the restored files= directory holds {e['extra_files']} as well", torn=True)
                if e["warned"]:
                    trial.fail(f"trial {i}: the load warned: {e['warned']}")
            elif e["outcome"] == "StepRetiredError" and e["explicit"] and action in ("retire", "overwrite"):
                if not e["untouched"]:
                    trial.fail(f"trial {i}: a load that raised StepRetiredError changed the caller's state", torn=True)
            else:
                trial.fail(
                    f"trial {i}: {mode} of step {e['target']} while the writer did '{action}': "
                    f"{e['outcome']}: {e.get('msg')}"
                    + ("" if e.get("untouched", True) else "; and it changed the caller's state"),
                    torn=not e.get("untouched", True),
                )
            c.record(trial, seconds)
        if rc_w != 0 or rc_r != 0:
            t = Trial("reader", "processes", jobs=[_Log(lw), _Log(lr)])  # type: ignore[list-item]
            t.fail(f"writer rc {rc_w}, reader rc {rc_r}: {_Log(lw).output()[-800:]} {_Log(lr).output()[-800:]}")
            c.record(t, 0.0)
        else:
            shutil.rmtree(sync, ignore_errors=True)
        done += k


# -- the caller's state after failed loads; restores into non-empty and shared directories ----------


def _many(
    c: Campaign, scenario: str, kind: str, n: int, per_job: int, nproc: int = 2
) -> list[tuple[Any, Any, Any, float, int]]:
    """Run ``n`` trials of a many-trials-per-job scenario on 1 x ``nproc`` ranks (one root per job)."""
    out = []
    done = 0
    while done < n:
        k = min(per_job, n - done)
        root = _tmp(c, f"{kind}-") / "root"
        topo = Topo("single", 1, nproc, [root], [root], (0,))
        t0 = time.monotonic()
        gen = c.next_gen()
        res = c.job(topo, [scenario, "--gen", str(gen), "--trials", str(k), "--seed", str(c.rng.randrange(2**31))])
        out.append((*res, (time.monotonic() - t0) / k, k))
        done += k
    return out


def run_load_state(c: Campaign, n: int) -> None:
    for job, evs, timeout, seconds, k in _many(c, "loadstate", "load_state", n, 24):
        setup = Trial("load_state", "setup", jobs=[job] if job else [])
        if timeout or job is None or not job.ok:
            setup.fail(f"the load_state job did not finish: {timeout or tail(job)}")
            c.record(setup, 0.0)
        damages = {e["trial"]: e for e in events_of(evs, "damage", 0)}
        world = len(evs)
        for i in range(k):
            d = damages.get(i)
            trial = Trial("load_state", d["kind"] if d else "?", jobs=[job] if job else [])
            if d is None:
                trial.fail(f"trial {i}: no damage applied (the job died earlier)")
                c.record(trial, seconds)
                continue
            trial.injected = True
            trial.fault = d["what"]
            got = [e for e in events_of(evs, "loadstate") if e["trial"] == i]
            if len(got) != 3 * world:
                trial.fail(f"trial {i}: {len(got)} of {3 * world} load outcomes reported")
            # Without its manifest (deleted, or cut so that its head is unreadable) a step is not a
            # committed checkpoint at all: load(step=N) finds no such step, load() no newer one to warn about.
            unlisted = "MANIFEST" in d["what"]
            allowed = (
                "CorruptCheckpointError",
                "CheckpointError",
                "TornLoadError",
                *(("StepNotFoundError",) if unlisted else ()),
            )
            for e in got:
                where = f"trial {i} ({d['what']}), rank {e['rank']}, {e['label']}"
                if e["outcome"] == "raised":
                    if e["label"] == "fallback-nonstrict":
                        trial.fail(f"{where}: load() raised instead of falling back: {e['error']}: {e['msg']}")
                    if not e["untouched"]:
                        trial.fail(f"{where}: a failed load changed the caller's state ({e['error']})", torn=True)
                    if e["error"] not in allowed:
                        trial.fail(f"{where}: unexpected error {e['error']}: {e['msg']}")
                    if e["siblings"]:
                        trial.fail(f"{where}: a failed load left {e['siblings']} next to the files= destination")
                    continue
                if e["bad"]:
                    trial.fail(f"{where}: loaded step {e['step']} with wrong content: {e['bad']}", torn=True)
                if not e["only_new_ok"]:
                    trial.fail(
                        f"{where}: `only_new` after loading step {e['step']} holds bytes it should not "
                        "(the rejected checkpoint's?)",
                        torn=True,
                    )
                if e["extra_files"]:
                    trial.fail(f"{where}: the files= destination also holds {e['extra_files']}", torn=True)
                if e["siblings"]:
                    trial.fail(f"{where}: {e['siblings']} left next to the files= destination")
                if (
                    e["label"] == "fallback-nonstrict"
                    and e["step"] == e["target"] - 1
                    and not e["warned"]
                    and e["rank"] == 0
                    and not unlisted
                ):  # the library warns on rank 0
                    trial.fail(f"{where}: fell back to step {e['step']} without a warning")
                if e["step"] not in (e["target"], e["target"] - 1):
                    trial.fail(f"{where}: loaded step {e['step']}")
            steps_loaded = {e["step"] for e in got if e["outcome"] == "loaded" and e["label"] == "fallback-nonstrict"}
            if len(steps_loaded) > 1:
                trial.fail(f"trial {i}: ranks fell back to different steps {steps_loaded}", torn=True)
            c.record(trial, seconds)


def run_restore(c: Campaign, n: int) -> None:
    for job, evs, timeout, seconds, k in _many(c, "restore", "restore", n, 24):
        if timeout or job is None or not job.ok:
            setup = Trial("restore", "setup", jobs=[job] if job else [])
            setup.fail(f"the restore job did not finish: {timeout or tail(job)}")
            c.record(setup, 0.0)
        world = len(evs)
        for i in range(k):
            got = [e for e in events_of(evs, "restore") if e["trial"] == i]
            variant = got[0]["variant"] if got else "?"
            trial = Trial("restore", variant, jobs=[job] if job else [])
            if len(got) != world:
                trial.fail(f"trial {i}: {len(got)} of {world} ranks reported")
                c.record(trial, seconds)
                continue
            trial.injected = True
            for e in got:
                where = f"trial {i} ({variant}), rank {e['rank']}"
                if e["siblings"]:
                    trial.fail(f"{where}: {e['siblings']} left next to the destination")
                if variant == "non-empty":
                    if e["outcome"] != "loaded":
                        trial.fail(f"{where}: the load failed: {e.get('error')}: {e.get('msg')}")
                    elif e["bad"] or e["extra_files"]:
                        trial.fail(
                            f"{where}: the destination is not the saved directory: {e['bad']} extra {e['extra_files']}",
                            torn=True,
                        )
                    continue
                want = "PathCollisionError" if variant in ("shared", "nested") else "CorruptCheckpointError"
                if e["outcome"] != "raised":
                    trial.fail(f"{where}: the load succeeded; expected {want}", torn=variant == "failed")
                    continue
                if e["error"] != want:
                    trial.fail(f"{where}: {e['error']} ({e['msg']}), expected {want}")
                if not e["untouched"] or not e["state_untouched"]:
                    trial.fail(f"{where}: a refused load changed the user's files or state", torn=True)
            c.record(trial, seconds)


# -- per-rank values of every size ------------------------------------------------------------------------


def run_per_rank(c: Campaign, n: int) -> None:
    for job, evs, timeout, seconds, k in _many(c, "perrank", "per_rank", n, 30):
        if timeout or job is None or not job.ok:
            setup = Trial("per_rank", "setup", jobs=[job] if job else [])
            setup.fail(f"the per_rank job did not finish: {timeout or tail(job)}")
            c.record(setup, 0.0)
        world = len(evs)
        for i in range(k):
            got = [e for e in events_of(evs, "perrank") if e["trial"] == i]
            sub = f"{got[0]['kind']}, differs {got[0]['differ']}" if got else "?"
            trial = Trial("per_rank", sub, jobs=[job] if job else [])
            if len(got) != world:
                trial.fail(f"trial {i}: {len(got)} of {world} ranks reported")
                c.record(trial, seconds)
                continue
            trial.injected = True
            trial.fault = f"{got[0]['size']} bytes"
            for e in got:
                where = f"trial {i} ({sub}, {e['size']} bytes), rank {e['rank']}"
                if e["outcome"] != "ReplicatedValueError":
                    trial.fail(
                        f"{where}: the save was not refused: {e['outcome']} {e['msg'][:200]}",
                        torn=e["outcome"] == "saved",
                    )
                elif "'v" not in e["msg"] or "PerRank" not in e["msg"]:
                    trial.fail(f"{where}: the refusal does not name the value and PerRank: {e['msg'][:200]}")
                if e["outcome"] != "saved" and e["after"] != e["before"]:
                    trial.fail(f"{where}: a refused save changed the committed steps {e['before']} -> {e['after']}")
                if not e["perrank_ok"]:
                    trial.fail(
                        f"{where}: the same value in PerRank did not load back as saved: {e['msg'][-300:]}", torn=True
                    )
            c.record(trial, seconds)


# -- exit and destroy_process_group with a background save in flight --------------------------------------

GLOO_EXIT_ABORT = "terminate called without an active exception"
ASYNC_VARIANTS = ("destroy", "exit", "destroy, save fails", "exit, save fails", "exit, a rank killed")


_worker: Any = None


def _inspect(c: Campaign, root: Path, gen: int) -> tuple[int, str]:
    """The worker's ``inspect`` scenario (read_only, no process group), run in this process: a process of
    its own would import torch once more per trial. Returns (0, or 1 if it raised; what it printed)."""
    global _worker
    if _worker is None:
        spec = importlib.util.spec_from_file_location("_campaign_job", CAMPAIGN_JOB)
        assert spec is not None and spec.loader is not None
        _worker = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_worker)
    scratch = Path(tempfile.mkdtemp(prefix=f"inspect-{gen}-", dir=c.scratch))
    args = argparse.Namespace(root=str(root), gen=gen, big=64 * 1024, scratch=str(scratch))
    out = io.StringIO()
    rc = 0
    with contextlib.redirect_stdout(out):
        try:
            _worker.scenario_inspect(args)
        except Exception:
            rc = 1
            out.write(traceback.format_exc())
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return rc, out.getvalue()


def run_async_exit(c: Campaign, n: int) -> None:
    """One 1 x 2 job per trial: a background save, then the script ends (``exit``) or calls
    destroy_process_group() (``destroy``). A save that can succeed must be committed and load bitwise,
    with exit status 0; one that fails (an injected error, or a rank SIGKILLed in it) must make the
    job exit non-zero with the error said, and commit nothing."""
    root = _tmp(c, "async-exit-") / "root"
    topo = Topo("single", 1, 2, [root], [root], (0,))
    phases = (FaultPhase.BEFORE_WRITE, FaultPhase.MID_WRITE, FaultPhase.AFTER_WRITE, FaultPhase.BEFORE_PUBLISH)
    for i in range(n):
        variant = ASYNC_VARIANTS[i % len(ASYNC_VARIANTS)]
        t0 = time.monotonic()
        gen = c.next_gen()
        phase = c.rng.choice(phases)
        rank = 0 if phase == FaultPhase.BEFORE_PUBLISH else c.rng.randrange(2)
        fault = "none"
        if "fails" in variant:
            fault = f"{phase.value}:{rank}:raise"
        elif "killed" in variant:
            fault = f"{phase.value}:{rank}:kill"
        trial = Trial("async_exit", variant, fault=fault, signal="kill" if "killed" in variant else "")
        job, evs, timeout = c.job(
            topo, ["asyncexit", "--gen", str(gen), "--variant", variant.split(",")[0], "--fault", fault], timeout=180
        )
        trial.jobs = [job] if job else []
        step = next((e["step"] for e in events_of(evs, "returned", 0)), None)
        rc_i, inspected = _inspect(c, root, gen)
        ins = parse_results(inspected)
        steps = next((e["steps"] for e in ins if e.get("event") == "inspect"), None)
        if timeout:
            trial.fail(f"the job did not end: {timeout}")
        elif step is None:
            trial.fail(f"save() never returned: {tail(job)}")
        elif fault == "none":
            trial.injected = True
            ranks = "".join(job.rank_output(r) for r in range(2))
            if (
                not job.ok
                and variant == "exit"
                and GLOO_EXIT_ABORT in job.output() + ranks
                and "Traceback" not in ranks
            ):
                # PyTorch, not ckptguard: a process that exits without destroy_process_group() while it has
                # a second gloo group (ckptguard's own) aborts now and then at interpreter exit (3 of 16
                # runs of a bare torch script, docs/crash-consistency.md). The job then exits non-zero,
                # so the save is reported if it was cut; if it is committed it must load bitwise (below).
                trial.sub += " [torch abort at exit]"
            elif not job.ok:
                trial.fail(f"the job failed although its save could succeed: {tail(job)}")
            if (steps is None or step not in steps) and job.ok:
                trial.fail(
                    f"the save in flight at {variant} is not committed and the job exited 0: steps {steps}", lost=True
                )
        else:
            trial.injected = True
            if job.ok:
                trial.fail(f"the job exited 0 although its background save failed ({fault})")
            out = job.output() + "".join(job.rank_output(r) for r in range(2))
            if "raise" in fault and "injected fault" not in out:
                trial.fail(f"the failed save was not reported: {tail(job)}")
            if steps is not None and step in steps and "raise" in fault:
                trial.fail(f"step {step} is committed although its save failed ({fault})")
        if rc_i != 0 or steps is None:
            trial.fail(f"inspecting the root failed (rc {rc_i}): {inspected[-1000:]}")
        for e in ins:
            if e.get("event") == "loaded" and not e["ok"]:
                trial.fail(f"the newest step {e['step']} loads with wrong content: {e['bad']}", torn=True)
        c.record(trial, time.monotonic() - t0)


# -- hostile checkpoints ----------------------------------------------------------------------------------


def run_hostile(c: Campaign, n: int, per_job: int = 22) -> None:
    done = 0
    while done < n:
        k = min(per_job, n - done)
        c._yield()
        t0 = time.monotonic()
        base = _tmp(c, "hostile-")
        log = base / "hostile.log"
        p = _single(
            c,
            [
                "hostile",
                "--root",
                str(base / "roots"),
                "--gen",
                str(c.next_gen()),
                "--trials",
                str(k),
                "--seed",
                str(c.rng.randrange(2**31)),
                "--hold-s",
                "60",
                "--cli-every",
                "3",
            ],
            log,
        )
        rc = _finish(p, 90 * k)
        _kill(p)
        evs = {e["trial"]: e for e in parse_results(_Log(log).output()) if e.get("event") == "hostile"}
        loads = [e for e in parse_results(_Log(log).output()) if e.get("event") == "loaded"]
        failed = [e for e in parse_results(_Log(log).output()) if e.get("event") == "failed-load"]
        seconds = (time.monotonic() - t0) / k
        for i in range(k):
            e = evs.get(i)
            trial = Trial("hostile", e["what"] if e else "?", jobs=[_Log(log)])  # type: ignore[list-item]
            if e is None:
                trial.fail(f"trial {i}: nothing reported (rc {rc}): {_Log(log).output()[-1500:]}")
                c.record(trial, seconds)
                continue
            trial.injected = True
            what = e["what"]
            if e["outcome"] != "done":
                trial.fail(f"trial {i} ({what}): {e['outcome']} {e.get('msg', '')} after {e['seconds']} s")
                c.record(trial, seconds)
                continue
            harmless = what == "fifo-latest"
            ex = e["explicit"]
            if harmless and ex["outcome"] != "loaded":
                trial.fail(f"trial {i} ({what}): load(step=2) failed: {ex}")
            if not harmless:
                if ex["outcome"] == "loaded":
                    trial.fail(f"trial {i} ({what}): load(step=2) of a hostile checkpoint succeeded")
                elif not ex.get("corrupt"):
                    trial.fail(
                        f"trial {i} ({what}): load(step=2) raised {ex['outcome']}, not CorruptCheckpointError: "
                        f"{ex.get('msg')}"
                    )
            want = 2 if harmless else 1
            if e["newest"] != want:
                trial.fail(f"trial {i} ({what}): load() returned step {e['newest']}, expected {want}")
            for x in failed:
                if x.get("trial") == i and not x["untouched"]:
                    trial.fail(
                        f"trial {i} ({what}): load(step={x['step']}) raised {x['error']} and changed the "
                        "caller's state",
                        torn=True,
                    )
            for x in loads:
                if x.get("trial") == i and not x["ok"]:
                    trial.fail(f"trial {i} ({what}): step {x['step']} loaded with wrong content: {x['bad']}", torn=True)
            for cmd, r in (e.get("cli") or {}).items():
                if r["traceback"]:
                    trial.fail(f"trial {i} ({what}): `ckptguard {cmd}` crashed: {r['err']}")
                if cmd == "verify" and r["rc"] != (0 if harmless else 1):
                    trial.fail(f"trial {i} ({what}): `ckptguard verify` exit status {r['rc']}")
                if cmd == "ls" and r["rc"] != 0:
                    trial.fail(f"trial {i} ({what}): `ckptguard ls` exit status {r['rc']}: {r['err']}")
            c.record(trial, seconds)
        if rc == 0:
            shutil.rmtree(base, ignore_errors=True)
        done += k
