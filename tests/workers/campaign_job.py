"""The torchrun worker of the crash-consistency campaign (driven by tests/support/campaign.py).

Why it looks like this: a job launch costs seconds, so trials are *chained*. Every
``chain`` job first acts as the restart of the previous trial (load and check every
committed step bitwise, save once cleanly and check that no staging garbage survived),
then runs the fault it was given and, for a kill, dies by it. Faults that do not kill
(corruption after commit, disk full) run many trials inside one job.

What a checkpoint holds at step ``s`` is a pure function of ``s``, of the ``gen``
(which job saved it: the driver passes a fresh one to each job) and, for ``PerRank``
values and ``files=`` artifacts, of the rank. ``gen`` is itself stored in the
checkpoint, so any job can recompute what a loaded checkpoint must contain and compare
bitwise, and a checkpoint mixing two attempts of one step (same ``s``, different
``gen``) cannot pass the comparison.

Every observation is printed as a RESULT line (tests/support/results.py): the driver
reads each rank's complete log after the job and decides. Checks that need the
loaded tensors are made here; checks that need the history of the chain (what was
committed before the crash) are made by the driver.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckptguard import Checkpointer, CheckpointError, CorruptCheckpointError, PerRank, _faults
from ckptguard._faults import FaultPhase
from ckptguard.comm import agreed_failures
from ckptguard.protocol.layout import CheckpointName
from ckptguard.verify import verify_checkpoint

# The repo root is on PYTHONPATH (run_job): the driver's own digest, and the RESULT line format.
from tests.support.campaign import tree_digest
from tests.support.results import emit_result

RANK = 0


def result(**kw: Any) -> None:
    """One observation for the driver (with the time it was made); flushed, so a SIGKILL right after keeps it."""
    emit_result(rank=RANK, t=round(time.time(), 3), **kw)


# -- deterministic content ---------------------------------------------------------------------


def _gen(*key: int) -> torch.Generator:
    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:7], "little")
    return torch.Generator().manual_seed(seed)


def expected(step: int, gen: int, rank: int, big: int) -> dict[str, Any]:
    """Everything checkpoint ``step`` saved by job ``gen`` holds, as seen from ``rank``."""
    g = _gen(step, gen)
    shared = {
        "big": torch.randn(big, generator=g),
        "bf16": torch.randn(1000, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-(2**40), 2**40, (3000,), generator=g, dtype=torch.int64),
        "mask": torch.rand(777, generator=g) > 0.5,
        "half": torch.randn(33, 17, generator=g).half(),
    }
    weight = torch.randn(32, 64, generator=g)
    bias = torch.randn(32, generator=g)
    meta = {"step": step, "gen": gen, "note": f"step {step} saved by job {gen}",
            "hist": [round(float(x), 6) for x in torch.rand(3, generator=g)]}
    gr = _gen(step, gen, rank)
    per_rank = {"rng": torch.randint(0, 256, (1000 + 37 * rank,), generator=gr, dtype=torch.uint8),
                "pos": step * 1000 + rank}
    aux = {
        # The step-dependent name sorts first: a restore that fails on a.bin after writing it
        # would leave a file of the rejected checkpoint behind, which the comparison catches.
        f"0-p{step % 2}.bin": f"{step} {gen} {rank}".encode(),
        "a.bin": bytes(torch.randint(0, 256, (3000 + rank,), generator=gr, dtype=torch.uint8).tolist()),
        "sub/b.txt": f"rank {rank} step {step}\n".encode(),
    }
    return {"tensors": shared, "weight": weight, "bias": bias, "meta": meta, "per_rank": per_rank, "aux": aux}


def write_aux(dest: str, files: dict[str, bytes]) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    for rel, data in files.items():
        path = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def read_aux(dest: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(dest):
        for n in names:
            full = os.path.join(dirpath, n)
            with open(full, "rb") as f:
                out[os.path.relpath(full, dest)] = f.read()
    return out


class State:
    """What one rank saves and loads: a module, tensors of several dtypes, a plain object,
    a PerRank value and a files= artifact directory."""

    def __init__(self, rank: int, big: int, scratch: str) -> None:
        self.rank, self.big, self.scratch = rank, big, scratch
        self.counter = 0
        self.extra: list[str] = []

    def for_save(self, step: int, gen: int) -> tuple[dict[str, Any], dict[str, str]]:
        e = expected(step, gen, self.rank, self.big)
        model = nn.Linear(64, 32)
        with torch.no_grad():
            model.weight.copy_(e["weight"])
            model.bias.copy_(e["bias"])
        src = os.path.join(self.scratch, f"save-{self.rank}")
        write_aux(src, e["aux"])
        state = {"model": model, "tensors": e["tensors"], "meta": e["meta"], "per_rank": PerRank(e["per_rank"])}
        return state, {"aux": src}

    def template(self) -> tuple[dict[str, Any], dict[str, str]]:
        """A state to load into: right shapes and dtypes, wrong values everywhere."""
        e = expected(0, 0, self.rank, self.big)
        model = nn.Linear(64, 32)
        with torch.no_grad():
            model.weight.fill_(-7.0)
            model.bias.fill_(-7.0)
        tensors = {k: torch.zeros_like(v) for k, v in e["tensors"].items()}
        meta = {"step": -1, "gen": -1, "note": "", "hist": [0.0, 0.0, 0.0]}
        per_rank = PerRank({"rng": torch.zeros_like(e["per_rank"]["rng"]), "pos": -1})
        self.counter += 1
        dest = os.path.join(self.scratch, f"restore-{self.rank}-{self.counter}")
        return {"model": model, "tensors": tensors, "meta": meta, "per_rank": per_rank}, {"aux": dest}

    def compare(self, state: dict[str, Any], files: dict[str, str], step: int) -> tuple[int, list[str]]:
        """(gen found in the loaded state, differences from what that gen saved at ``step``)."""
        meta = state["meta"]
        gen = int(meta["gen"])
        e = expected(step, gen, self.rank, self.big)
        bad = []
        if meta != e["meta"]:
            bad.append(f"meta {meta} != {e['meta']}")
        for k, v in e["tensors"].items():
            if not bitwise_equal(state["tensors"][k], v):
                bad.append(f"tensors.{k}")
        model = state["model"]
        if not bitwise_equal(model.weight.detach(), e["weight"]) or not bitwise_equal(model.bias.detach(), e["bias"]):
            bad.append("model")
        pr = state["per_rank"].value
        if pr["pos"] != e["per_rank"]["pos"] or not bitwise_equal(pr["rng"], e["per_rank"]["rng"]):
            bad.append("per_rank")
        got_aux = read_aux(files["aux"]) if os.path.isdir(files["aux"]) else {}
        extra = sorted(set(got_aux) - set(e["aux"]))
        if {k: got_aux.get(k) for k in e["aux"]} != e["aux"]:
            bad.append(f"files= artifact: got {sorted(got_aux)}, expected {sorted(e['aux'])}"
                       + (" (contents differ)" if sorted(got_aux) == sorted(e["aux"]) else ""))
        self.extra = extra  # files= files the loaded checkpoint does not hold: a restore mixing checkpoints
        return gen, bad


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


# -- helpers -------------------------------------------------------------------------------------


def make_ck(args: argparse.Namespace, **kw: Any) -> Checkpointer:
    opts: dict[str, Any] = {"keep_last": args.keep_last}
    if args.job_id:
        opts["job_id"] = args.job_id
    opts.update(kw)
    return Checkpointer(args.root, **opts)


def load_and_check(ck: Checkpointer, st: State, step: int | None, what: str, **tags: Any) -> int | None:
    """Load (newest or ``step``), compare bitwise, report; returns the step loaded."""
    state, files = st.template()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ck.load(state, step=step, files=files)
    warned = [str(w.message)[:300] for w in caught if "ckptguard" in str(w.message)]
    if got is None:
        result(event="loaded", what=what, step=None, gen=None, ok=True, bad=[], warned=warned, extra_files=[],
               **tags)
        return None
    gen, bad = st.compare(state, files, got)
    result(event="loaded", what=what, step=got, gen=gen, ok=not bad, bad=bad[:5], warned=warned,
           extra_files=st.extra, **tags)
    shutil.rmtree(files["aux"], ignore_errors=True)
    return got


def save(ck: Checkpointer, st: State, step: int, gen: int, *, blocking: bool = True, **kw: Any) -> float:
    """One save; with ``blocking=False`` it returns after the snapshot, and this then scribbles over
    every tensor and files= source it saved: the checkpoint must still hold the values of the call."""
    state, files = st.for_save(step, gen)
    result(event="saving", step=step, gen=gen, blocking=blocking, overwrite=bool(kw.get("overwrite")))
    t0 = time.monotonic()
    ck.save(step, state, files=files, metadata={"gen": gen}, blocking=blocking, **kw)
    dur = time.monotonic() - t0
    if not blocking:
        scribble(state, files)
    result(event="saved", step=step, gen=gen, committed=ck.steps(), dur=round(dur, 4), blocking=blocking)
    return dur


def scribble(state: dict[str, Any], files: dict[str, str]) -> None:
    """What training does right after an async save returns: change the saved tensors and files in place."""
    with torch.no_grad():
        for t in state["tensors"].values():
            t.copy_(torch.ones_like(t) if t.dtype == torch.bool else torch.full_like(t, 3))
        state["model"].weight.fill_(-3.0)
        state["model"].bias.fill_(-3.0)
        state["per_rank"].value["rng"].fill_(7)
    state["meta"]["note"] = "scribbled"
    for dirpath, _, names in os.walk(files["aux"]):
        for n in names:
            with open(os.path.join(dirpath, n), "wb") as f:
                f.write(b"scribbled after an async save")


def leftovers(ck: Checkpointer, wait_s: float = 15.0) -> None:
    """Leaders: staging and trash after a successful save must become empty (the library may remove
    leftovers in the background after save() returns, so give it ``wait_s``; report how long it took)."""
    if not ck.topology.is_leader:
        return
    t0 = time.monotonic()
    while True:
        names = {}
        for sub in ("staging", "trash"):
            p = os.path.join(ck.root, ".ckptguard", sub)
            names[sub] = sorted(os.listdir(p)) if os.path.isdir(p) else []
        if not any(names.values()) or time.monotonic() - t0 > wait_s:
            break
        time.sleep(0.02)
    result(event="garbage", root=ck.root, waited_s=round(time.monotonic() - t0, 3), **names)


def restart(ck: Checkpointer, st: State, gen: int) -> tuple[int, float]:
    """The restart half of a trial: every committed step loads bitwise; one clean save; no garbage."""
    steps = ck.steps()
    result(event="start", steps=steps, domains=[list(d) for d in ck.topology.domains])
    newest = load_and_check(ck, st, None, "newest")
    for s in steps:
        if s != newest:
            load_and_check(ck, st, s, "older")
    nxt = (newest if newest is not None else -1) + 1
    if steps and max(steps) >= nxt:
        nxt = max(steps) + 1
    dur = save(ck, st, nxt, gen)
    leftovers(ck)
    return nxt + 1, dur


def barrier_file(path: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.05)


def touch(path: str) -> None:
    with open(path, "w") as f:
        f.write(str(time.time()))


# -- scenarios -----------------------------------------------------------------------------------


def scenario_chain(args: argparse.Namespace) -> None:
    """Restart of the previous trial, then one injected fault (it normally kills the job).

    ``--fault``: ``phase:<phase>:<rank>`` (SIGKILL through the library's fault hook at save
    number ``--at`` of this job), ``random:<rank>:<fraction>`` (a thread SIGKILLs the rank
    ``fraction`` x the duration of a clean save after save number ``--at`` starts: the
    kill lands anywhere, inside DCP, the commit or retention), ``load:<rank>`` (SIGKILL
    in the middle of a load), or ``none``. With ``--async-saves`` the faulted saves are
    ``blocking=False`` and the saved tensors and files are overwritten as soon as save() returns.
    """
    st = State(RANK, args.big, args.scratch)
    ck = make_ck(args)
    step, dur = restart(ck, st, args.gen)
    kind, *rest = args.fault.split(":")
    if kind == "load":
        if ck.topology.is_leader:
            result(event="digest", root=ck.root, digest=tree_digest(ck.root))
        dist.barrier()
        _faults.arm(f"{FaultPhase.MID_LOAD}:{rest[0]}")
        result(event="armed", fault=args.fault)
        load_and_check(ck, st, None, "faulted")
        _faults.arm("")
        result(event="survived")
        ck.close()
        return
    for i in range(args.at + 3):
        if i == args.at:
            if kind == "phase":
                _faults.arm(f"{rest[0]}:{rest[1]}")
                result(event="armed", fault=args.fault)
            elif kind == "random":
                result(event="armed", fault=args.fault)
                if int(rest[0]) == RANK:
                    delay = float(rest[1]) * dur

                    def die(delay: float = delay) -> None:
                        result(event="killing", after_s=round(delay, 4))
                        os.kill(os.getpid(), signal.SIGKILL)

                    threading.Timer(delay, die).start()
        save(ck, st, step, args.gen, blocking=not args.async_saves)
        step += 1
    ck.wait()
    _faults.arm("")
    result(event="survived")
    ck.close()


def _damage(step_dir: str, kind: str, rng: random.Random) -> str:
    """Damage one committed checkpoint the way storage does; returns what was done."""
    files = sorted(os.path.relpath(os.path.join(d, n), step_dir) for d, _, ns in os.walk(step_dir) for n in ns)
    nonempty = [f for f in files if os.path.getsize(os.path.join(step_dir, f)) > 0]
    if kind == "extra":
        where = rng.choice(["NOTES.txt", "data/rank00099_0.bin", "files/rank00000/aux/extra.bin", "data/.hidden"])
        path = os.path.join(step_dir, where)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(os.urandom(rng.randint(1, 5000)))
        return f"extra {where}"
    rel = rng.choice(files if kind == "delete" else nonempty)
    path = os.path.join(step_dir, rel)
    if kind == "delete":
        os.unlink(path)
        return f"delete {rel}"
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if kind == "bitflip":
        pos, bit = rng.randrange(len(data)), rng.randrange(8)
        data[pos] ^= 1 << bit
        what = f"bitflip {rel} byte {pos} bit {bit}"
    elif kind == "truncate":
        n = rng.randrange(len(data))
        data = data[:n]
        what = f"truncate {rel} to {n} of {len(data)} bytes"
    elif kind == "zeros":
        for _ in range(100):  # a block that is not already zero, or the damage would be no damage
            length = rng.randint(1, min(4096, len(data)))
            pos = rng.randrange(len(data) - length + 1)
            if any(data[pos:pos + length]):
                break
        data[pos:pos + length] = bytes(length)
        what = f"zeros {rel} bytes {pos}..{pos + length}"
    else:
        raise ValueError(kind)
    # Rewrite in place (same inode), like bit rot or a torn sector; the manifest is not touched.
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate(len(data))
        f.flush()
        os.fsync(f.fileno())
    return what


def scenario_corrupt(args: argparse.Namespace) -> None:
    """Corruption after commit: per trial, save a good step and a newer one, damage the newer one,
    then load(step=None) must give a committed step bitwise (the newer only if the damage is
    harmless), load(step=newer) must refuse or be bitwise right, and verify must flag the damage."""
    st = State(RANK, args.big, args.scratch)
    ck = make_ck(args)
    step, _ = restart(ck, st, args.gen)
    kinds = args.damage.split(",")
    rng = random.Random(args.seed)
    for i in range(args.trials):
        kind = kinds[i % len(kinds)]
        save(ck, st, step, args.gen)
        save(ck, st, step + 1, args.gen)
        target = step + 1
        dist.barrier()
        if RANK == 0:
            # Node-local roots: damage one domain's copy (the other stays intact).
            step_dir = os.path.join(ck.root, CheckpointName(target).dirname)
            what = _damage(step_dir, kind, rng)
            vr = verify_checkpoint(ck.root, CheckpointName(target))
            problems = sorted({p.kind for p in vr.problems})
            cli = None
            if i % args.cli_every == 0:
                proc = subprocess.run([sys.executable, "-m", "ckptguard.cli", "verify", ck.root, "--json"],
                                      capture_output=True, text=True, timeout=120)
                doc = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
                flagged = [c["step"] for c in doc.get("checked", []) if not c["intact"]]
                gone = target not in [c["step"] for c in doc.get("checked", [])]
                cli = {"rc": proc.returncode, "flagged": flagged, "target_listed": not gone}
            result(event="damage", trial=i, kind=kind, step=target, what=what, verify_intact=vr.intact,
                   problems=problems, cli=cli)
        dist.barrier()
        got = load_and_check(ck, st, None, "after-damage", trial=i)
        result(event="fallback", trial=i, kind=kind, target=target, loaded=got)
        try:
            load_and_check(ck, st, target, "damaged-explicit", trial=i)
            result(event="explicit", trial=i, outcome="loaded")
        except CorruptCheckpointError as e:
            result(event="explicit", trial=i, outcome="corrupt", msg=str(e)[:300])
        except CheckpointError as e:
            result(event="explicit", trial=i, outcome="error", msg=str(e)[:300])
        step += 2
    ck.close()


def scenario_diskfull(args: argparse.Namespace) -> None:
    """Disk full mid-save: rank 0 fills the filesystem up to a random few bytes short of what
    the next save needs; the save must fail with one CheckpointError on every rank (or fit),
    the previous checkpoint must load bitwise, and once space is back the next save works and
    leaves no garbage. Every ``--hold-every``-th trial keeps the disk full for ``--hold-s``
    seconds (longer than a lease renewal interval) before freeing it."""
    st = State(RANK, args.big, args.scratch)
    ck = make_ck(args)
    step, _ = restart(ck, st, args.gen)
    rng = random.Random(args.seed)
    fill_dir = os.path.dirname(os.path.abspath(args.root))
    for i in range(args.trials):
        hold = args.hold_every > 0 and i % args.hold_every == args.hold_every - 1
        filler = os.path.join(fill_dir, f"filler-{args.gen}-{i}")
        if hold:
            # A short lease TTL, so that the renewal thread runs while the disk is full.
            ck = reopen(ck, args, lease_ttl_s=args.lease_ttl)
        if RANK == 0:
            size = sum(os.path.getsize(os.path.join(d, n))
                       for d, _, ns in os.walk(os.path.join(ck.root, CheckpointName(ck.latest()).dirname))
                       for n in ns)
            vfs = os.statvfs(fill_dir)
            free = vfs.f_bavail * vfs.f_frsize
            leave = rng.randrange(0, int(size * 1.15))
            with open(filler, "wb", buffering=0) as f:
                chunk = b"\xa5" * (1 << 20)
                remaining = max(0, free - leave)
                with contextlib.suppress(OSError):
                    while remaining > 0:
                        remaining -= f.write(chunk[: min(len(chunk), remaining)])
            vfs = os.statvfs(fill_dir)
            result(event="filled", trial=i, checkpoint_bytes=size, free=vfs.f_bavail * vfs.f_frsize, leave=leave,
                   hold=hold)
        dist.barrier()
        before = ck.steps()
        agreed: list[object] = []
        try:
            save(ck, st, step, args.gen)
            outcome, msg = "fit", ""
        except CheckpointError as e:
            outcome, msg = "raised", str(e)
            # What every rank agreed on (a rank that failed itself raises its own error, with its own words).
            agreed = [[f.rank, f.kind] for f in agreed_failures(e)]
        result(event="diskfull", trial=i, step=step, outcome=outcome, msg=msg[:600], agreed=agreed, before=before,
               after=ck.steps(refresh=True), hold=hold)
        load_and_check(ck, st, None, "after-diskfull", trial=i)
        if hold and RANK == 0:
            # Completely full, for longer than a lease renewal interval (as when nobody cleans up for a while).
            with open(filler + "-rest", "wb", buffering=0) as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\x5a" * 4096)
            time.sleep(args.hold_s)
            os.unlink(filler + "-rest")
        dist.barrier()
        if RANK == 0:
            os.unlink(filler)
        dist.barrier()
        if outcome == "fit":
            step += 1
        try:
            save(ck, st, step, args.gen)
        except CheckpointError as e:
            # Report, then carry on with a fresh Checkpointer so the remaining trials still run.
            result(event="postfree-failed", trial=i, step=step, msg=str(e)[:600])
            ck = reopen(ck, args)
            save(ck, st, step, args.gen)
        leftovers(ck)
        step += 1
        if hold:
            ck = reopen(ck, args)
    ck.close()


def scenario_contend(args: argparse.Namespace) -> None:
    """Two jobs started on one root at once: exactly one gets the lease; the other must get a
    CheckpointError naming the holder. The winner keeps saving until the loser has reported."""
    st = State(RANK, args.big, args.scratch)
    mine, other = os.path.join(args.sync, f"done-{args.gen}"), os.path.join(args.sync, f"done-{args.other}")
    try:
        ck = make_ck(args, lease_wait_s=args.lease_wait)
    except CheckpointError as e:
        result(event="refused", msg=str(e)[:600])
        dist.barrier()
        if RANK == 0:
            touch(mine)
        return
    result(event="won")
    step, _ = restart(ck, st, args.gen)
    deadline = time.monotonic() + 120
    n = 0
    while True:
        save(ck, st, step, args.gen)
        step += 1
        n += 1
        flag = torch.tensor([int(os.path.exists(other) or time.monotonic() > deadline)])
        dist.all_reduce(flag)  # every rank leaves the loop at the same save
        if flag.item() and n >= 2:
            break
    for s in ck.steps():
        load_and_check(ck, st, s, "winner-final")
    ck.close()
    dist.barrier()
    if RANK == 0:
        touch(mine)


def _staging_has_manifest(root: str) -> bool:
    """Is an attempt in staging about to be published (its manifest, or the manifest's temp file, exists)?"""
    staging = os.path.join(root, ".ckptguard", "staging")
    try:
        entries = os.listdir(staging)
    except FileNotFoundError:
        return False
    for e in entries:
        with contextlib.suppress(OSError):
            if any("MANIFEST" in n for n in os.listdir(os.path.join(staging, e))):
                return True
    return False


def scenario_victim(args: argparse.Namespace) -> None:
    """A job whose leader stalls (SIGSTOP: its lease renewal thread stops too, as on a frozen node)
    past the lease TTL while another job takes the root over; when it wakes up it must not publish.

    ``--stall-at idle``: stopped between saves; its next save must fail with the fencing error.
    ``--stall-at publish``: stopped inside a save, once the attempt's manifest is being written
    (after the lease check, before the rename that publishes); the save must fail, not publish.
    """
    st = State(RANK, args.big, args.scratch)
    ck = make_ck(args, lease_ttl_s=args.lease_ttl)
    step, _ = restart(ck, st, args.gen)
    save(ck, st, step, args.gen)
    step += 1
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    dist.barrier()
    ready = os.path.join(args.sync, "thief-ready")
    wait_s = args.lease_ttl * 10 + 100

    def stall(at: str) -> None:
        os.kill(pids[0], signal.SIGSTOP)
        touch(os.path.join(args.sync, "stalled"))
        result(event="stalled", at=at, pid=pids[0])
        barrier_file(ready, timeout=wait_s)
        os.kill(pids[0], signal.SIGCONT)
        result(event="resumed")

    done = threading.Event()
    watcher = None
    if RANK == 1 and args.stall_at == "idle":
        stall("idle")
    elif RANK == 1 and args.stall_at == "publish":
        def watch() -> None:
            while not done.is_set():
                if _staging_has_manifest(ck.root):
                    stall("publish")
                    return
                time.sleep(0.0002)
            result(event="missed-window")

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
    if args.stall_at == "idle":
        dist.barrier()
    try:
        save(ck, st, step, args.gen)
        result(event="not-fenced", step=step)
    except CheckpointError as e:
        result(event="fenced", step=step, msg=str(e)[:600], steps=ck.steps())
    done.set()
    if watcher is not None:
        watcher.join()
    with contextlib.suppress(CheckpointError):
        ck.close()
    dist.barrier()
    if RANK == 0:
        touch(os.path.join(args.sync, "victim-done"))


def scenario_thief(args: argparse.Namespace) -> None:
    """Starts while the victim is stalled, waits its lease out and takes over. With ``--stall-at idle``
    it saves before letting the victim wake up; with ``publish`` only after (the victim's in-flight
    step is then free for the victim to publish, if fencing fails)."""
    st = State(RANK, args.big, args.scratch)
    t0 = time.monotonic()
    ck = make_ck(args, lease_ttl_s=args.lease_ttl, lease_wait_s=args.lease_ttl * 3)
    result(event="took-over", waited_s=round(time.monotonic() - t0, 2))
    if args.stall_at == "idle":
        step, _ = restart(ck, st, args.gen)
    else:
        steps = ck.steps()
        result(event="start", steps=steps, domains=[list(d) for d in ck.topology.domains])
        newest = load_and_check(ck, st, None, "newest")
        step = (newest if newest is not None else -1) + 1
    dist.barrier()
    if RANK == 0:
        touch(os.path.join(args.sync, "thief-ready"))
    barrier_file(os.path.join(args.sync, "victim-done"), timeout=args.lease_ttl * 10 + 120)
    steps = ck.steps(refresh=True)
    result(event="after-victim", steps=steps)
    for s in steps:
        load_and_check(ck, st, s, "thief-final")
    try:
        save(ck, st, step, args.gen)
    except CheckpointError as e:
        result(event="thief-save-failed", step=step, msg=str(e)[:600])
        raise
    leftovers(ck)
    ck.close()


def scenario_consecutive(args: argparse.Namespace) -> None:
    """``--trials`` saves in a row (every ``--overwrite-every``-th one re-saves the previous step
    with overwrite=True, as a restarted run does); each must succeed. Every ``--load-every``-th
    save is followed by a load of the newest step (on a 2-node job, node 1 reads what node 0
    just published). At the end every retained step loads bitwise."""
    st = State(RANK, args.big, args.scratch)
    ck = make_ck(args)
    result(event="start", steps=ck.steps(), domains=[list(d) for d in ck.topology.domains])
    step = 0
    for i in range(args.trials):
        again = args.overwrite_every > 0 and i > 0 and i % args.overwrite_every == 0
        s = step - 1 if again else step
        try:
            save(ck, st, s, args.gen + i, overwrite=again)
        except CheckpointError as e:
            result(event="save-failed", i=i, step=s, msg=str(e)[:800])
            raise
        if args.load_every and i % args.load_every == 0:
            load_and_check(ck, st, None, "after-save", i=i)
        if not again:
            step += 1
    for s in ck.steps():
        load_and_check(ck, st, s, "final")
    leftovers(ck)
    ck.close()


def scenario_recreate(args: argparse.Namespace) -> None:
    """``--trials`` saves, each by a new Checkpointer on the same root (the previous one closed and
    dropped): a job may open a Checkpointer per phase, or re-open one after an error."""
    st = State(RANK, args.big, args.scratch)
    ck = make_ck(args)
    for i in range(args.trials):
        save(ck, st, i, args.gen)
        ck.close()
        ck = make_ck(args)
    ck.close()


# -- issue 10's fault kinds ------------------------------------------------------------------------


def restart_ordered(ck: Checkpointer, st: State, gen: int) -> int:
    """The restart of an overwrite/rollback chain: every committed step loads bitwise, the newest in
    commit order first; one clean save at the next multiple of 10 above every step (rollback saves
    land in between); no garbage. Returns the step saved."""
    steps = ck.steps()
    result(event="start", steps=steps, domains=[list(d) for d in ck.topology.domains])
    newest = load_and_check(ck, st, None, "newest")
    for s in steps:
        if s != newest:
            load_and_check(ck, st, s, "older")
    nxt = (max(steps) // 10 + 1) * 10 if steps else 10
    save(ck, st, nxt, gen)
    leftovers(ck)
    return nxt


def scenario_chain2(args: argparse.Namespace) -> None:
    """Restart of the previous trial, then saves that overwrite or roll back, one of them faulted.

    ``--mode overwrite``: each save re-saves a committed step (the newest in commit order, or an
    older one) with ``overwrite=True``. ``--mode rollback``: ``load(step=r)`` of an older committed
    step, then saves r+1, r+2, ... (``overwrite=True`` where such a step is committed, on the
    abandoned branch). The fault (``phase:<phase>:<rank>`` or ``random:<rank>:<fraction>``, as in
    ``chain``) is armed at save number ``--at``; run on node-local roots (two storage domains).
    """
    st = State(RANK, args.big, args.scratch)
    ck = make_ck(args)
    t0 = time.monotonic()
    restart_ordered(ck, st, args.gen)
    dur = time.monotonic() - t0
    rng = random.Random(args.seed)
    kind, *rest = args.fault.split(":")
    plan: list[tuple[int, bool]] = []
    if args.mode == "rollback":
        steps = ck.steps()
        older = steps[:-1] or steps
        r = rng.choice(older)
        load_and_check(ck, st, r, "rollback")
        for k in range(1, args.at + 4):
            plan.append((r + k, (r + k) in steps))
    for i in range(args.at + 3):
        if args.mode == "overwrite":
            steps = ck.steps()
            target = steps[-1] if rng.random() < 0.6 else rng.choice(steps)
            step, again = target, True
        else:
            step, again = plan[i]
            again = again or step in ck.steps()
        if i == args.at:
            if kind == "phase":
                _faults.arm(f"{rest[0]}:{rest[1]}")
                result(event="armed", fault=args.fault)
            elif kind == "random":
                result(event="armed", fault=args.fault)
                if int(rest[0]) == RANK:
                    delay = float(rest[1]) * dur / 2

                    def die(delay: float = delay) -> None:
                        result(event="killing", after_s=round(delay, 4))
                        os.kill(os.getpid(), signal.SIGKILL)

                    threading.Timer(delay, die).start()
        save(ck, st, step, args.gen, overwrite=again)
    ck.wait()
    _faults.arm("")
    result(event="survived")
    ck.close()


# Stop points the library has no fault hook for; the worker wraps library calls (test-side only).
_STOP_AT: dict[str, int] = {}


def _stop_self(where: str) -> None:
    result(event="stopping", where=where)
    os.kill(os.getpid(), signal.SIGSTOP)
    result(event="continued", where=where)


def _install_stop_points() -> None:
    """``latest`` (inside the compare-and-swap of the pointer, after reading it), ``retention`` (at
    the n-th lease check of the retention phase, before it), ``renewal`` (in the lease renewal
    thread, after reading the record, before replacing it), ``release`` (in close(), after reading
    the lease record, before the compare-and-delete)."""
    from ckptguard.protocol.lease import Lease
    from ckptguard.storage.posix import PosixStorage

    read_versioned = PosixStorage.read_versioned
    check = Lease.check

    def read_versioned_hook(self: Any, path: str) -> Any:
        out = read_versioned(self, path)
        name = os.path.basename(path)
        thread = threading.current_thread().name
        if name == "latest" and _STOP_AT.get("latest") == 0:
            _STOP_AT.pop("latest")
            _stop_self("latest")
        elif name == "lease.json" and thread == "ckptguard-lease" and _STOP_AT.get("renewal") == 0:
            _STOP_AT.pop("renewal")
            _stop_self("renewal")
        elif name == "lease.json" and _STOP_AT.get("release") == 0 and _IN_RELEASE:
            _STOP_AT.pop("release")
            _stop_self("release")
        return out

    def check_hook(self: Any, acting: str = "publish", renew: bool = True) -> None:
        if "retention" in _STOP_AT and (acting.startswith("retire") or acting == "apply retention"):
            if _STOP_AT["retention"] == 0:
                _STOP_AT.pop("retention")
                _stop_self(f"retention ({acting[:60]})")
            else:
                _STOP_AT["retention"] -= 1
        check(self, acting, renew)

    release = Lease.release

    def release_hook(self: Any) -> None:
        global _IN_RELEASE
        _IN_RELEASE = True
        try:
            release(self)
        finally:
            _IN_RELEASE = False

    PosixStorage.read_versioned = read_versioned_hook  # type: ignore[method-assign]
    Lease.check = check_hook  # type: ignore[method-assign]
    Lease.release = release_hook  # type: ignore[method-assign]


_IN_RELEASE = False


def _try_save(ck: Checkpointer, st: State, step: int, gen: int, label: str) -> bool:
    try:
        save(ck, st, step, gen)
        result(event="outcome", save=label, step=step, error=None)
        return True
    except CheckpointError as e:
        result(event="outcome", save=label, step=step, error=type(e).__name__, msg=str(e)[:400])
        return False


def scenario_holder(args: argparse.Namespace) -> None:
    """Job A of a stop trial (one process): commits steps, then stops itself (SIGSTOP, every thread
    with it) at ``--stop-at`` and is resumed (SIGCONT) after job B took the root over. Everything it
    tries afterwards must fail, and it must change nothing of B's (the driver compares the tree)."""
    st = State(0, args.big, args.scratch)
    _install_stop_points()
    # A fenced attempt (B moved staging away) makes a writer wait for its attempt directory up to
    # visibility_timeout_s before it fails: shortened from 60 s so that a trial takes seconds.
    ck = make_ck(args, lease_ttl_s=args.lease_ttl, keep_last=1, visibility_timeout_s=10)
    result(event="pid", pid=os.getpid())
    for s in range(1, args.at + 2):
        save(ck, st, s, args.gen)
    at = args.stop_at
    nxt = args.at + 2
    if at in {p.value for p in FaultPhase}:
        _faults.arm(f"{at}:0:stop")
    elif at == "retention":
        _STOP_AT["retention"] = args.nth
    elif at in ("latest", "renewal", "release"):
        _STOP_AT[at] = 0
    result(event="armed", at=at)
    if at == "renewal":
        time.sleep(args.lease_ttl * 4)  # idle: the renewal thread stops the process
        result(event="woke")
    elif at == "release":
        ck.close()
        result(event="closed")
        return
    _try_save(ck, st, nxt, args.gen, "stopped")
    _faults.arm("")
    _try_save(ck, st, nxt + 1, args.gen, "after")
    with contextlib.suppress(CheckpointError):
        ck.close()
    result(event="closed")


def scenario_taker(args: argparse.Namespace) -> None:
    """Job B of a stop trial: takes the root over from the stopped job A, checks what it loads,
    commits a step of its own, then stops inside its next save (``--taker-stop``: an attempt of its
    own in staging) while A runs; resumed, it finishes that save and loads both its steps bitwise."""
    st = State(0, args.big, args.scratch)
    t0 = time.monotonic()
    ck = make_ck(args, lease_ttl_s=args.lease_ttl, lease_wait_s=args.lease_ttl * 20, keep_last=2)
    result(event="took-over", waited_s=round(time.monotonic() - t0, 2), steps=ck.steps())
    load_and_check(ck, st, None, "newest")
    save(ck, st, 100, args.gen)
    _faults.arm(f"{args.taker_stop}:0:stop")
    result(event="armed", at=args.taker_stop)
    save(ck, st, 101, args.gen)
    _faults.arm("")
    result(event="final", steps=ck.steps(refresh=True), latest=ck.latest(refresh=True))
    for s in ck.steps():
        load_and_check(ck, st, s, "taker-final")
    leftovers(ck)
    ck.close()


def reopen(ck: Checkpointer, args: argparse.Namespace, **kw: Any) -> Checkpointer:
    """Close and drop ``ck``, open a new one (test_a_new_checkpointer_per_save_keeps_saving: this once broke)."""
    with contextlib.suppress(CheckpointError):
        ck.close()
    return make_ck(args, **kw)


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        yield
        # Leave together: if the node hosting the store exits first, the other's teardown aborts.
        dist.barrier()
    finally:
        dist.destroy_process_group()


SCENARIOS: dict[str, Callable[[argparse.Namespace], None]] = {
    "chain": scenario_chain, "corrupt": scenario_corrupt, "diskfull": scenario_diskfull,
    "contend": scenario_contend, "victim": scenario_victim, "thief": scenario_thief,
    "consecutive": scenario_consecutive, "recreate": scenario_recreate, "chain2": scenario_chain2,
    "holder": scenario_holder, "taker": scenario_taker,
}
#: Plain single-process scenarios (no torchrun, no process group): a "job" is one process.
SINGLE = frozenset({"holder", "taker"})


def main() -> None:
    global RANK
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("--root", default=os.environ.get("CKPT_ROOT"))
    p.add_argument("--scratch", default=os.environ.get("CKPT_SCRATCH"))
    p.add_argument("--sync", default=os.environ.get("CKPT_SYNC"))
    p.add_argument("--gen", type=int, required=True)
    p.add_argument("--other", type=int, default=-1)
    p.add_argument("--job-id", default=None)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--big", type=int, default=64 * 1024)
    p.add_argument("--fault", default="none")
    p.add_argument("--at", type=int, default=0)
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--damage", default="bitflip,truncate,zeros,delete,extra")
    p.add_argument("--cli-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lease-wait", type=float, default=2.0)
    p.add_argument("--lease-ttl", type=float, default=2.0)
    p.add_argument("--overwrite-every", type=int, default=0)
    p.add_argument("--hold-every", type=int, default=0)
    p.add_argument("--load-every", type=int, default=0)
    p.add_argument("--async-saves", action="store_true")
    p.add_argument("--stall-at", choices=("idle", "publish"), default="idle")
    p.add_argument("--hold-s", type=float, default=1.5)
    p.add_argument("--mode", choices=("overwrite", "rollback"), default="overwrite")
    p.add_argument("--stop-at", default="")
    p.add_argument("--nth", type=int, default=0)
    p.add_argument("--taker-stop", default="before_publish")
    args = p.parse_args()
    if args.scenario in SINGLE:
        args.scratch = os.path.join(args.scratch or "/tmp", f"gen{args.gen}-{uuid.uuid4().hex[:8]}")
        os.makedirs(args.scratch, exist_ok=True)
        try:
            SCENARIOS[args.scenario](args)
        finally:
            shutil.rmtree(args.scratch, ignore_errors=True)
        result(event="exit")
        return
    with _process_group():
        RANK = dist.get_rank()
        args.scratch = os.path.join(args.scratch or "/tmp", f"gen{args.gen}-{uuid.uuid4().hex[:8]}")
        os.makedirs(args.scratch, exist_ok=True)
        try:
            SCENARIOS[args.scenario](args)
        finally:
            shutil.rmtree(args.scratch, ignore_errors=True)
    result(event="exit")


if __name__ == "__main__":
    sys.exit(main())
