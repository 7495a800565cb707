"""The state machine: two writing jobs (A, B) and a read-only reader (R) on one root, audited after every step.

Rules start an operation on a worker (it runs in that worker's process while other rules run),
finish one (its reply is checked against the model), kill a worker with SIGKILL after a drawn
delay (mid-operation when one is in flight), stall one with SIGSTOP and resume it, open a job
(a writer taking the lease: at once from a dead holder or its own earlier incarnation, after
the TTL from a stalled one, refused while the holder runs), close one, and on S3 switch a proxy
fault on or off. After every step, unless the lease holder has a write in flight, an auditor
(a read-only Checkpointer in this process, past the fault proxy) lists the root and reads every
listed step: see :meth:`Model.audit`.

What each reply must be:
* a load either returns a state that was committed for the step it names, whole, or raises
  leaving the caller's template untouched; with nothing in flight and no fault, it succeeds, and
  ``load()`` by the holder returns the step committed last;
* a write by the holder succeeds, or fails with a reason that leaves no doubt (step exists, not
  found, tagged) and changes nothing, or fails under an injected fault or stall (then the audit
  decides); a write by a fenced job fails and changes nothing;
* every error is a ``CheckpointError``; nothing hangs (a reply within ``REPLY_TIMEOUT_S``).

``PosixModelMachine`` and ``S3ModelMachine`` are the same rules on the two backends; a test or
tools/model_run.py gives them a :class:`Harness` (``use_harness``) before hypothesis runs them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.support.model.drivers import S3_FAULTS, Backend, Worker, WorkerDied, WorkerPool
from tests.support.model.model import Absent, Model
from tests.support.model.worker import expected_digest

WRITERS = ("A", "B")
READER = "R"
SLOTS = (*WRITERS, READER)
STEPS = st.integers(min_value=1, max_value=5)
TAGS = st.sampled_from(["best", "good"])
IDX = st.integers(min_value=0, max_value=2)  # which of the workers a rule may act on
# The proxy fault an operation meets (S3 only; None half the time): drawn with each operation, so
# that faults come with the operations they hit.
FAULT = st.sampled_from([*[None] * len(S3_FAULTS), *sorted(S3_FAULTS)]).flatmap(
    lambda kind: (
        st.none() if kind is None else st.tuples(st.just(kind), st.sampled_from([0, 0, 10, 30, 80, 200, 400, 800]))
    )
)
# What befalls the worker right after it starts an operation (None mostly): SIGKILL or SIGSTOP
# after so many milliseconds, at a random point of the operation.
DISRUPT = st.sampled_from([None, None, None, None, "kill", "stall"]).flatmap(
    lambda kind: st.none() if kind is None else st.tuples(st.just(kind), st.integers(min_value=0, max_value=150))
)
STALL_STEPS = 3  # a stalled worker resumes by itself after this many steps (if no rule resumed it)
KEEP_LAST = 3
TTL_S = 2.0
REPLY_TIMEOUT_S = 120.0
WRITES = frozenset({"save", "delete", "tag", "untag"})
# Failures that say for certain the write did nothing (the model is put back as it was).
REFUSALS = frozenset({"StepExistsError", "StepNotFoundError"})


TRACE = bool(os.environ.get("CKPTGUARD_MODEL_TRACE"))


def _timed(rule_fn: Any) -> Any:
    """Count each rule's calls and seconds in the harness (the long run's report shows them)."""

    @functools.wraps(rule_fn)
    def run(self: ModelMachine, **kwargs: Any) -> None:
        self.resume_due()
        args = ", ".join(f"{k}={v!r}" for k, v in sorted(kwargs.items()))
        self.trace.append(f"state.{rule_fn.__name__}({args})")
        t0 = time.monotonic()
        try:
            rule_fn(self, **kwargs)
        finally:
            took = time.monotonic() - t0
            self.h.counts[f"rule:{rule_fn.__name__}"] += 1
            self.h.seconds[rule_fn.__name__] += took
            if TRACE:
                print(f"[model {self.backend.name}] {rule_fn.__name__}({kwargs}) {took:.2f}s", flush=True)

    return run


class Violation(AssertionError):
    """The root or a reply broke what the model says must hold."""


@dataclass
class Harness:
    """What outlives one hypothesis example: the backend, the worker pool, the counts."""

    backend: Backend
    pool: WorkerPool
    counts: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    violations: list[str] = field(default_factory=list)  # every one seen, shrinking's replays included
    traces: list[list[str]] = field(default_factory=list)  # the steps that led to each
    sabotage: str | None = None  # writers break the library on purpose (worker.py): the checks must fire

    def worker(self) -> Worker:
        return self.pool.take()


@dataclass
class Op:
    cmd: dict[str, Any]
    as_holder: bool  # sent by the lease holder, not fenced
    snapshot: Model | None = None  # the model before a holder's write
    digest: str | None = None
    floor: int | None = None
    troubled: bool = False  # a fault or a stall overlapped it: an error is no violation
    quiet: bool = False  # no holder write in flight and the model certain when it was sent
    live_before: dict[int, str] = field(default_factory=dict)
    writes: int = 0  # a holder's save: its step's write count once the model took it in (Model.claim)


@dataclass
class Slot:
    name: str
    job_id: str
    worker: Worker | None = None
    open: bool = False
    fenced: bool = False
    op: Op | None = None
    stall_left: int = 0
    resumed_at: float = -1e9  # time.monotonic() of the last SIGCONT

    @property
    def alive(self) -> bool:
        return self.worker is not None and self.worker.alive()

    @property
    def stopped(self) -> bool:
        return self.worker is not None and self.worker.stopped


class ModelMachine(RuleBasedStateMachine):
    harness: ClassVar[Harness | None] = None

    def __init__(self) -> None:
        super().__init__()
        h = type(self).harness
        if h is None:
            raise RuntimeError(f"{type(self).__name__}.harness is not set: use use_harness() first")
        self.h = h
        self.backend = h.backend
        self.root = self.backend.new_root()
        self.model = Model()
        self.slots = {n: Slot(n, f"model-job-{n}-{id(self):x}") for n in SLOTS}
        self.holder: str | None = None
        self.nonce = 0
        self.auditor: Any = None
        self.trace: list[str] = []  # the rules run so far, as hypothesis prints them
        self._timer: threading.Timer | None = None
        self.fault_seen_at = -1e9  # time.monotonic() when a proxy fault was last on
        self._open("A")
        self._open(READER)
        self.auditor = self.backend.auditor(self.root)

    # -- helpers -----------------------------------------------------------------------------------
    def fail(self, what: str, slot: Slot | None = None) -> None:
        self.h.counts["violations"] += 1
        log = f"\n--- log of worker {slot.name} ---\n{slot.worker.log_tail()}" if slot and slot.worker else ""
        self.h.violations.append(f"[{self.backend.name}] {what}")
        self.h.traces.append(list(self.trace))
        raise Violation(f"[{self.backend.name}] {what}{log}")

    def holder_writing(self) -> bool:
        return any(
            s.op is not None and s.op.as_holder and s.op.cmd["op"] in WRITES and not s.fenced
            for s in self.slots.values()
        )

    def pick(self, i: int, names: tuple[str, ...], ok: Any) -> str | None:
        """The ``i``-th (modulo) of ``names`` for which ``ok(name)`` holds: rules draw an index, not a
        name, so every drawn step acts (and shrinks toward the first candidate)."""
        cands = [n for n in names if ok(n)]
        return cands[i % len(cands)] if cands else None

    def ready(self, name: str) -> bool:
        s = self.slots[name]
        return s.open and s.alive and not s.stopped and s.op is None

    def _send(self, name: str, cmd: dict[str, Any], **extra: Any) -> Op:
        s = self.slots[name]
        as_holder = self.holder == name and not s.fenced and name != READER
        op = Op(
            cmd,
            as_holder,
            troubled=self.backend.fault_active or self._timer is not None,
            quiet=not self.holder_writing() and self.model.certain,
            live_before=dict(self.model.live),
            **extra,
        )
        if as_holder and cmd["op"] in WRITES:
            op.snapshot = copy.deepcopy(self.model)
        assert s.worker is not None
        s.op = op
        s.worker.send(cmd)
        self.h.counts[f"op:{cmd['op']}"] += 1
        self.h.counts["actions"] += 1
        return op

    def _open(self, name: str) -> None:
        s = self.slots[name]
        if not s.alive:
            s.worker = self.h.worker()
            s.op = None
        assert s.worker is not None
        if name == READER:
            out = s.worker.call(
                {
                    "op": "open",
                    "root": self.root,
                    "read_only": True,
                    "load_memory_bytes": 0,
                    "storage_options": self.backend.storage_options(),
                },
                timeout=REPLY_TIMEOUT_S,
            )
            if not out["ok"]:
                if self.backend.fault_active:
                    return
                self.fail(f"the reader could not open the root: {out['error']}: {out['message']}", s)
            s.open, s.fenced = True, False
            return
        h = self.holder
        hs = self.slots[h] if h is not None else None
        if hs is None or h == name or not hs.alive:
            expect, wait_s = "ok", 1.0  # no holder, this job's earlier incarnation, or a dead process
        elif hs.stopped or not hs.open:
            # taken over once the lease expires: the holder is stalled, or its last open failed (a
            # fault; its process lives on without a Checkpointer), so nothing renews a lease it may hold
            expect, wait_s = "ok", 3 * TTL_S
        elif time.monotonic() - max(hs.resumed_at, self.fault_seen_at) < 3 * TTL_S or self.backend.fault_active:
            # resumed lately, or a fault kept its renewals from the store: its lease may have expired
            expect, wait_s = "either", 0.5
        else:
            expect, wait_s = "held", 0.5
        out = s.worker.call(
            {
                "op": "open",
                "root": self.root,
                "job_id": s.job_id,
                "keep_last": KEEP_LAST,
                "lease_ttl_s": TTL_S,
                "lease_wait_s": wait_s,
                "sabotage": self.h.sabotage,
                "storage_options": self.backend.storage_options(),
            },
            timeout=REPLY_TIMEOUT_S,
        )
        self.h.counts["opens"] += 1
        if out["ok"]:
            if expect == "held":
                self.fail(f"job {name} took the lease while job {h} holds it and runs", s)
            if hs is not None and h != name:
                hs.fenced = True
                if hs.op is not None:
                    hs.op.troubled = True
                self.h.counts["takeovers"] += 1
            self.holder = name
            s.open, s.fenced = True, False
            return
        s.open = False
        if expect in ("held", "either") and out["error"] == "LeaseHeldError":
            return
        if self.backend.fault_active:
            return
        self.fail(f"job {name} could not open the root (expected {expect}): {out['error']}: {out['message']}", s)

    # -- operations --------------------------------------------------------------------------------
    @precondition(lambda self: any(self.ready(n) for n in WRITERS))
    @rule(i=IDX, step=STEPS, overwrite=st.booleans(), wait=st.booleans(), fault=FAULT, disrupt=DISRUPT)
    @_timed
    def start_save(
        self,
        i: int,
        step: int,
        overwrite: bool,
        wait: bool,
        fault: tuple[str, int] | None,
        disrupt: tuple[str, int] | None,
    ) -> None:
        w = self.pick(i, WRITERS, self.ready)
        if w is None:
            return
        self.set_fault(fault)
        self.nonce += 1
        digest = expected_digest(step, self.nonce)
        op = self._send(w, {"op": "save", "step": step, "nonce": self.nonce, "overwrite": overwrite}, digest=digest)
        if op.as_holder:
            op.floor = min(KEEP_LAST, len(set(self.model.live) | {step}))
            self.model.unsure(step, digest)
            self.model.retire_candidates(step, KEEP_LAST)
            self.model.retention_floor = None
            op.writes = self.model.writes(step)
        self._then(w, wait, disrupt)

    @precondition(lambda self: any(self.ready(n) for n in SLOTS))
    @rule(
        i=IDX,
        step=st.none() | STEPS,
        tag=st.none() | TAGS,
        read=st.booleans(),
        wait=st.booleans(),
        fault=FAULT,
        disrupt=DISRUPT,
    )
    @_timed
    def start_load(
        self,
        i: int,
        step: int | None,
        tag: str | None,
        read: bool,
        wait: bool,
        fault: tuple[str, int] | None,
        disrupt: tuple[str, int] | None,
    ) -> None:
        w = self.pick(i, SLOTS, self.ready)
        if w is None:
            return
        self.set_fault(fault)
        self._send(w, {"op": "read" if read else "load", "step": None if tag else step, "tag": tag})
        self._then(w, wait, disrupt)

    @precondition(lambda self: any(self.ready(n) for n in WRITERS))
    @rule(i=IDX, step=STEPS, wait=st.booleans(), fault=FAULT, disrupt=DISRUPT)
    @_timed
    def start_delete(
        self, i: int, step: int, wait: bool, fault: tuple[str, int] | None, disrupt: tuple[str, int] | None
    ) -> None:
        w = self.pick(i, WRITERS, self.ready)
        if w is None:
            return
        self.set_fault(fault)
        op = self._send(w, {"op": "delete", "step": step})
        if op.as_holder:
            self.model.unsure(step, Absent)
        self._then(w, wait, disrupt)

    @precondition(lambda self: any(self.ready(n) for n in WRITERS))
    @rule(i=IDX, name=TAGS, step=st.none() | STEPS, wait=st.booleans(), fault=FAULT, disrupt=DISRUPT)
    @_timed
    def start_tag(
        self,
        i: int,
        name: str,
        step: int | None,
        wait: bool,
        fault: tuple[str, int] | None,
        disrupt: tuple[str, int] | None,
    ) -> None:
        w = self.pick(i, WRITERS, self.ready)
        if w is None:
            return
        self.set_fault(fault)
        cmd = {"op": "untag", "name": name} if step is None else {"op": "tag", "name": name, "step": step}
        op = self._send(w, cmd)
        if op.as_holder:
            self.model.tags_unknown.add(name)
        self._then(w, wait, disrupt)

    @precondition(lambda self: any(s.op is not None and s.alive and not s.stopped for s in self.slots.values()))
    @rule(i=IDX)
    @_timed
    def finish(self, i: int) -> None:
        w = self.pick(
            i, SLOTS, lambda n: self.slots[n].op is not None and self.slots[n].alive and not self.slots[n].stopped
        )
        if w is None:
            return
        s = self.slots[w]
        self._finish(s)

    def _finish(self, s: Slot) -> None:
        op = s.op
        assert op is not None and s.worker is not None
        try:
            out = s.worker.poll(REPLY_TIMEOUT_S)
        except WorkerDied as e:
            s.op = None
            self.fail(f"worker {s.name} died during {op.cmd}: {e}", s)
            return
        if out is None:
            self.fail(f"{op.cmd} on job {s.name} did not return within {REPLY_TIMEOUT_S:.0f} s (a hang)", s)
            return
        s.op = None
        if self.backend.fault_active or self._timer is not None:
            op.troubled = True
        kind = op.cmd["op"]
        if not out["ok"] and not out.get("checkpoint_error"):
            self.fail(f"{op.cmd} on job {s.name} raised {out['error']}, not a CheckpointError: {out['message']}", s)
        if kind in ("load", "read"):
            self._check_load(s, op, out)
        else:
            self._check_write(s, op, out)

    def _check_load(self, s: Slot, op: Op, out: dict[str, Any]) -> None:
        cmd = op.cmd
        quiet = op.quiet and not self.holder_writing() and self.model.live == op.live_before and not op.troubled
        if not out["ok"]:
            if cmd["op"] == "load" and not out.get("untouched", True):
                self.fail(f"{cmd} on job {s.name} failed ({out['error']}) and changed the caller's state", s)
            asked = cmd["step"]
            committed = (asked in op.live_before) if asked is not None else bool(op.live_before)
            if quiet and cmd["tag"] is None and committed and out["error"] not in REFUSALS:
                self.fail(
                    f"{cmd} on job {s.name} failed with nothing in flight and no fault: "
                    f"{out['error']}: {out['message']}",
                    s,
                )
            return
        step, digest = out["step"], out["digest"]
        if step is None:
            if quiet and op.live_before and cmd["tag"] is None:
                self.fail(f"{cmd} on job {s.name} found no checkpoint; committed: {sorted(op.live_before)}", s)
            return
        if cmd["step"] is not None and step != cmd["step"]:
            self.fail(f"{cmd} on job {s.name} returned step {step}", s)
        if digest not in self.model.history.get(step, set()):
            self.fail(
                f"{cmd} on job {s.name} returned step {step} as {str(digest)[:12]}, a state never saved "
                f"for it (saved: {sorted(d[:12] for d in self.model.history.get(step, set()))})",
                s,
            )
        if quiet and op.live_before.get(step) != digest:
            self.fail(
                f"{cmd} on job {s.name} returned step {step} as {str(digest)[:12]}, committed is "
                f"{str(op.live_before.get(step))[:12]}",
                s,
            )
        if (
            quiet
            and cmd["op"] == "load"
            and cmd["step"] is None
            and cmd["tag"] is None
            and op.as_holder
            and self.model.order
            and step != self.model.order[-1]
        ):
            self.fail(
                f"load() on job {s.name} returned step {step}; committed last is {self.model.order[-1]} "
                f"(commit order {self.model.order})",
                s,
            )

    def _check_write(self, s: Slot, op: Op, out: dict[str, Any]) -> None:
        cmd = op.cmd
        fenced_now = s.fenced
        if not op.as_holder:
            if out["ok"]:
                self.fail(f"{cmd} by job {s.name}, which does not hold the lease, returned success", s)
            return
        if fenced_now:  # fenced while in flight: it may have acted before the takeover; the audit decides
            if out["ok"] and cmd["op"] == "save":
                assert op.digest is not None
                self.model.claim(cmd["step"], op.digest, f"{cmd} by job {s.name} (fenced meanwhile)", op.writes)
            return
        if out["ok"]:
            self._apply(s, op, out)
            return
        if out["error"] in REFUSALS or "is tagged" in out.get("message", ""):
            assert op.snapshot is not None
            self._expect_refusal(s, op, out)
            self.model = op.snapshot
            return
        if op.troubled:
            return
        self.fail(
            f"{cmd} by the lease holder {s.name} failed with no fault injected: {out['error']}: {out['message']}", s
        )

    def _expect_refusal(self, s: Slot, op: Op, out: dict[str, Any]) -> None:
        cmd, before = op.cmd, op.snapshot
        assert before is not None
        step = cmd.get("step")
        if not before.certain:
            return
        if out["error"] == "StepExistsError" and not (cmd["op"] == "save" and step in before.live):
            self.fail(f"{cmd} by {s.name} refused with StepExistsError; committed: {sorted(before.live)}", s)
        if out["error"] == "StepNotFoundError" and step in before.live:
            self.fail(f"{cmd} by {s.name} refused with StepNotFoundError, but step {step} is committed", s)

    def _apply(self, s: Slot, op: Op, out: dict[str, Any]) -> None:
        cmd, before = op.cmd, op.snapshot
        assert before is not None
        step: Any = cmd.get("step")
        if cmd["op"] == "save":
            assert op.digest is not None
            if before.certain and step in before.live and not cmd["overwrite"]:
                self.fail(f"{cmd} by {s.name} overwrote committed step {step} without overwrite=True", s)
            if out["digest"] != op.digest:
                self.fail(f"the worker saved {out['digest'][:12]}, the driver expected {op.digest[:12]}", s)
            self.model.commit(step, op.digest)
            self.model.retention_floor = op.floor
        elif cmd["op"] == "delete":
            if before.certain and (step not in before.live or step in before.tagged()):
                self.fail(f"{cmd} by {s.name} succeeded; committed {sorted(before.live)}, tags {before.tags}", s)
            self.model.delete(step)
        elif cmd["op"] == "tag":
            if before.certain and step not in before.live:
                self.fail(f"{cmd} by {s.name} succeeded; step {step} is not committed", s)
            if before.certain and out["before"] != before.tags.get(cmd["name"]):
                self.fail(
                    f"{cmd} by {s.name} says the tag named {out['before']}, it named {before.tags.get(cmd['name'])}", s
                )
            self.model.tags[cmd["name"]] = step
            if not before.tags_unknown - {cmd["name"]} and cmd["name"] in self.model.tags_unknown:
                self.model.tags_unknown.discard(cmd["name"])
        elif cmd["op"] == "untag":
            self.model.tags.pop(cmd["name"], None)
            self.model.tags_unknown.discard(cmd["name"])

    # -- jobs, crashes, stalls, faults -------------------------------------------------------------
    def open_job(self, i: int) -> None:
        w = self.pick(
            i,
            SLOTS,
            lambda n: (
                (not self.slots[n].open or self.slots[n].fenced)
                and not self.slots[n].stopped
                and self.slots[n].op is None
            ),
        )
        if w is None:
            return
        self._open(w)

    def close_job(self, i: int) -> None:
        w = self.pick(i, SLOTS, self.ready)
        if w is None:
            return
        s = self.slots[w]
        assert s.worker is not None
        out = s.worker.call({"op": "close"}, timeout=REPLY_TIMEOUT_S)
        self.h.counts["closes"] += 1
        s.open = False
        if self.holder == w and not s.fenced:
            self.holder = None
        if not out["ok"] and not self.backend.fault_active:
            self.fail(f"close() of job {w} failed: {out['error']}: {out['message']}", s)

    def kill(self, w: str, delay_ms: int) -> None:
        """SIGKILL after ``delay_ms`` of the operation in flight, if any (its outcome is left to the audit);
        then the job restarts, as under torchrun: a new process opens the root with the same job id."""
        s = self.slots[w]
        if not s.alive:
            return
        assert s.worker is not None
        if s.op is not None:
            time.sleep(delay_ms / 1000)
        s.worker.kill()
        s.worker, s.open, s.op = None, False, None
        self.h.counts["kills"] += 1
        self._open(w)

    def resume_due(self) -> None:
        for s in self.slots.values():
            if s.stopped and s.worker is not None:
                s.stall_left -= 1
                if s.stall_left <= 0:
                    s.worker.cont()
                    s.resumed_at = time.monotonic()

    def stallable(self, n: str) -> bool:
        s = self.slots[n]
        return s.alive and not s.stopped and s.open and (s.op is not None or n == self.holder)

    def stall(self, w: str, delay_ms: int) -> None:
        """SIGSTOP after ``delay_ms`` of the operation in flight, if any: the lease stops being renewed;
        another job may take it over. It resumes after STALL_STEPS steps unless a rule resumes it first."""
        s = self.slots[w]
        if not (s.alive and not s.stopped and s.open):
            return
        assert s.worker is not None
        if s.op is not None:
            time.sleep(delay_ms / 1000)
            s.op.troubled = True
        s.worker.stop()
        s.stall_left = STALL_STEPS
        self.h.counts["stalls"] += 1

    def resume(self, i: int) -> None:
        w = self.pick(i, SLOTS, lambda n: self.slots[n].stopped)
        if w is not None:
            worker = self.slots[w].worker
            assert worker is not None
            worker.cont()
            self.slots[w].resumed_at = time.monotonic()

    def fault_off(self) -> None:
        if self.backend.fault_active or self._timer is not None:
            self.fault_seen_at = time.monotonic()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.backend.fault_off()

    def set_fault(self, fault: tuple[str, int] | None) -> None:
        """The proxy fault the next operations meet (S3; ignored on POSIX), from ``delay_ms`` after the
        operation starts (a fault that begins mid-save: at its commit, say); None: none."""
        if not self.backend.faults:
            return
        self.fault_off()
        if fault is None:
            return
        kind, delay_ms = fault
        for s in self.slots.values():
            if s.op is not None:
                s.op.troubled = True
        self.h.counts[f"fault:{kind}"] += 1
        if delay_ms == 0:
            self.backend.fault_on(kind)
        else:
            self._timer = threading.Timer(delay_ms / 1000, self.backend.fault_on, args=(kind,))
            self._timer.start()

    def _then(self, w: str, wait: bool, disrupt: tuple[str, int] | None) -> None:
        """Kill or stall the worker mid-operation (``disrupt``); with ``wait``, take and check the reply
        now (the operation's fault ends with it)."""
        if disrupt is not None:
            kind, delay_ms = disrupt
            (self.kill if kind == "kill" else self.stall)(w, delay_ms)
            return
        if wait:
            self._finish(self.slots[w])
            self.fault_off()

    @rule(
        event=st.sampled_from(["resume", "open", "kill", "stall", "close"]),
        i=IDX,
        delay_ms=st.integers(min_value=0, max_value=120),
    )
    @_timed
    def job_event(self, event: str, i: int, delay_ms: int) -> None:
        """A job opens (takes the lease or a reader's place), closes, is killed or stalled mid-operation
        after ``delay_ms``, or resumes (one rule, so that operations are drawn more often than events)."""
        if event == "open":
            self.open_job(i)
        elif event == "close":
            self.close_job(i)
        elif event == "kill":
            w = self.pick(i, SLOTS, lambda n: self.slots[n].alive)
            if w is not None:
                self.kill(w, delay_ms)
        elif event == "stall":
            w = self.pick(i, SLOTS, self.stallable)
            if w is not None:
                self.stall(w, delay_ms)
        else:
            self.resume(i)

    # -- the audit -----------------------------------------------------------------------------------
    @invariant()
    def audit(self) -> None:
        if self.auditor is None:
            return
        if self.holder_writing() or self.backend.settling:
            # A holder's write or a frozen request (it may land when thawed) can still change the root:
            # what it shows now cannot settle what the model leaves open.
            self.h.counts["audits_deferred"] += 1
            return
        from ckptguard import CheckpointError

        try:
            listed = self.auditor.steps(refresh=True)
            tags = self.auditor.tags(refresh=True)
        except CheckpointError as e:
            self.fail(f"the auditor cannot list the root: {type(e).__name__}: {e}")
            return

        def read(step: int) -> str | None:
            from tests.support.model.worker import digest

            try:
                got = self.auditor.read(step=step)
            except CheckpointError:
                return None
            return None if got is None else digest(got)

        bad = self.model.audit(listed, tags, read)
        self.h.counts["audits"] += 1
        if bad:
            self.fail("; ".join(bad))

    def teardown(self) -> None:
        self.fault_off()
        for s in self.slots.values():
            w = s.worker
            if w is None or not w.alive():
                continue
            if w.stopped:
                w.cont()
            if s.op is not None and w.poll(REPLY_TIMEOUT_S) is None:
                w.kill()
                continue
            w.in_flight = None
            try:
                out = w.call({"op": "close"}, timeout=REPLY_TIMEOUT_S)
            except WorkerDied:
                continue
            if out["ok"]:
                self.h.pool.give_back(w)
            else:
                w.kill()
        if self.auditor is not None:
            with contextlib.suppress(Exception):
                self.auditor.close()
        self.backend.remove_root(self.root)


class PosixModelMachine(ModelMachine):
    harness: ClassVar[Harness | None] = None


class S3ModelMachine(ModelMachine):
    harness: ClassVar[Harness | None] = None


MACHINES: dict[str, type[ModelMachine]] = {"posix": PosixModelMachine, "s3": S3ModelMachine}


@contextlib.contextmanager
def use_harness(backend: Backend, pool: WorkerPool) -> Iterator[Harness]:
    """Give ``backend``'s machine a harness (the pool's workers) for the duration."""
    machine = MACHINES[backend.name]
    h = Harness(backend, pool)
    machine.harness = h
    try:
        yield h
    finally:
        machine.harness = None
        backend.fault_off()
