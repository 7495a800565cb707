"""The crash-consistency campaign's engine: real multi-process torchrun jobs, injected faults, checks after restart.

tests/crash/test_campaign.py runs it bounded for CI; ``tools/campaign.py`` is its command line.

Fault kinds (docs/crash-consistency.md says how each is injected and what is checked):

    kill_phase   SIGKILL of one rank at a named phase of the save protocol (library fault hook)
    kill_random  SIGKILL of a random rank at a random moment of a save (a timer thread)
    kill_load    SIGKILL of one rank in the middle of a load
    stale_cache  kills as above, on a 2-node job whose nodes use two stale-caching sshfs
                 mounts of one directory
    corruption   after commit: bit flip, truncation, zero-filled block, deleted file, extra file
    disk_full    the root on a small tmpfs, filled to a random few bytes short of a save
    two_jobs     two jobs started on one root at the same moment
    takeover     a job stalls past its lease, another takes the root over; the first wakes up

Kill trials are *chained* per checkpoint root: job g+1 is the restart of job g and checks
what g left behind, then injects its own fault. A trial's result is therefore the
restart checks of the next job, attributed to the fault of the previous one. Every chain
ends with one job that only checks.

What counts:
    torn    a load returned bytes that differ from what was saved at that step (by the job
            that last attempted it), or a step nobody tried to save appeared
    lost    a step the previous job reported committed is gone, and retention (keep_last
            of the old and new steps) does not explain it
    failure anything else that is wrong (a save after the restart failed, staging garbage
            survived a successful save, verify missed a damage, `latest` moved backwards,
            a fault that should have killed did not, ...). Torn and lost trials are failures too.

Run it: ``Campaign(workdir, seed).run({kind: trials})`` returns a :class:`Report` (a table, JSON).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckptguard._faults import FaultPhase

from .beds.diskfull import small_filesystem
from .beds.sshfs import BedUnavailable, stale_shared_storage
from .jobs import JobResult, JobTimeout, run_job
from .results import results_by_rank
from .workers import CAMPAIGN_JOB

#: The library's fault points a kill_phase trial hits, in the order it cycles through them:
#: every point of ckptguard._faults.FaultPhase but the load's (kill_load trials hit that one).
LOAD_PHASES = frozenset({FaultPhase.MID_LOAD, FaultPhase.AFTER_PLACE})
SAVE_PHASES = tuple(p for p in FaultPhase if p not in LOAD_PHASES)
#: Only storage-domain leaders pass these (publish, `latest`): the kill goes to a leader.
LEADER_PHASES = frozenset({FaultPhase.BEFORE_PUBLISH, FaultPhase.AFTER_PUBLISH, FaultPhase.AFTER_COMMIT})
DAMAGES = ("bitflip", "truncate", "zeros", "delete", "extra")
KINDS = (
    "kill_phase",
    "kill_random",
    "kill_load",
    "stale_cache",
    "corruption",
    "disk_full",
    "two_jobs",
    "takeover",
    # the lifecycle kinds (tests/support/campaign_kinds.py)
    "kill_overwrite",
    "kill_rollback",
    "stop",
    "reader",
    "load_state",
    "restore",
    "per_rank",
    "async_exit",
    "hostile",
)
#: Kinds that fault a checkpoint's life beyond one save (overwrite, rollback, stalls, readers, loads, restores,
#: exits, hostile input); kills and SIGSTOPs among them are counted apart (tools/campaign.py --report).
LIFECYCLE_KINDS = KINDS[8:]
#: The layouts kill trials cycle through: 4 entries, 7 save phases: coprime, so every (phase, layout) pair
#: occurs in a long run. A 2 x 2 job costs about twice a 1 x 2 one (6 processes import torch, not 3).
KILL_LAYOUTS = ("single", "shared", "single", "local")
KEEP_LAST = 3


def tree_digest(root: str) -> str:
    """Every committed byte and the `latest` pointer under ``root`` (not .ckptguard/, which a live job touches)."""
    h = hashlib.sha256()
    for dirpath, dirnames, names in os.walk(root):
        dirnames.sort()
        if os.path.relpath(dirpath, root).split(os.sep)[0] == ".ckptguard":
            continue
        for n in sorted(names):
            full = os.path.join(dirpath, n)
            with open(full, "rb") as f:
                h.update(f"{os.path.relpath(full, root)}\0".encode() + hashlib.sha256(f.read()).digest())
    return h.hexdigest()


# -- bookkeeping -----------------------------------------------------------------------------------


@dataclass
class Tally:
    """One row of the table: a fault kind and variant."""

    kind: str
    sub: str
    trials: int = 0
    faults: int = 0  # trials in which the fault was really injected
    failures: int = 0
    torn: int = 0
    lost: int = 0
    seconds: float = 0.0


@dataclass
class Report:
    tallies: dict[tuple[str, str], Tally] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    started: str = ""

    def row(self, kind: str, sub: str) -> Tally:
        return self.tallies.setdefault((kind, sub), Tally(kind, sub))

    def total(self, attr: str, kind: str | None = None) -> int:
        return sum(getattr(t, attr) for t in self.tallies.values() if kind is None or t.kind == kind)

    def table(self) -> str:
        head = ("kind", "variant", "trials", "faults", "failures", "torn loads", "lost ckpts", "seconds")
        rows = [
            (t.kind, t.sub, t.trials, t.faults, t.failures, t.torn, t.lost, f"{t.seconds:.0f}")
            for t in sorted(self.tallies.values(), key=_order)
        ]
        rows.append(
            (
                "TOTAL",
                "",
                self.total("trials"),
                self.total("faults"),
                self.total("failures"),
                self.total("torn"),
                self.total("lost"),
                f"{self.seconds:.0f}",
            )
        )
        widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
        line = "| " + " | ".join(f"{{:<{w}}}" for w in widths) + " |"
        out = [line.format(*head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        out += [line.format(*map(str, r)) for r in rows]
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        return {
            "started": self.started,
            "seconds": round(self.seconds, 1),
            "faults": self.total("faults"),
            "trials": self.total("trials"),
            "failures": self.total("failures"),
            "torn": self.total("torn"),
            "lost": self.total("lost"),
            "rows": [asdict(t) for t in self.tallies.values()],
            "problems": self.problems,
        }


def _order(t: Tally) -> tuple[int, str]:
    return (KINDS.index(t.kind) if t.kind in KINDS else len(KINDS), t.sub)


@dataclass
class Trial:
    """The outcome of one trial, filled in by whoever checks it."""

    kind: str
    sub: str
    injected: bool = False
    fault: str = ""  # what was injected (a fault spec), for the results file
    signal: str = ""  # "kill" or "stop" when the fault is a SIGKILL or a SIGSTOP
    problems: list[str] = field(default_factory=list)
    torn: bool = False
    lost: bool = False
    jobs: list[JobResult] = field(default_factory=list)  # kept for the log of a failed trial

    def fail(self, msg: str, *, torn: bool = False, lost: bool = False) -> None:
        self.problems.append(msg)
        self.torn |= torn
        self.lost |= lost


def _git_commit() -> str:
    import subprocess

    if os.environ.get("CKPTGUARD_CAMPAIGN_COMMIT"):  # a run from an exported copy of a commit
        return os.environ["CKPTGUARD_CAMPAIGN_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _running(script: str) -> bool:
    """Is a process running ``script`` (an argument whose file name starts with it) other than us?"""
    me = {os.getpid(), os.getppid()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in me:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if any(os.path.basename(a.decode(errors="replace")).startswith(script) for a in args[:4]):
            return True
    return False


def parse_events(job: JobResult, world: int) -> dict[int, list[dict[str, Any]]]:
    """Every RESULT line of every rank, from the ranks' complete logs (a line cut by SIGKILL is skipped)."""
    return results_by_rank(job, world)


def events_of(evs: dict[int, list[dict[str, Any]]], name: str, rank: int | None = None) -> list[dict[str, Any]]:
    ranks = [rank] if rank is not None else sorted(evs)
    return [e for r in ranks for e in evs.get(r, []) if e.get("event") == name]


def tail(job: JobResult | None, n: int = 3000) -> str:
    if job is None:
        return ""
    text = job.output()
    for r in range(8):
        out = job.rank_output(r)
        if "Traceback" in out:
            text += f"\n--- rank {r} ---\n" + out[out.index("Traceback") :][:2000]
            break
    return text[-n:]


class LatestWatch:
    """Polls the `latest` pointer of some roots in the background: it must never move backwards."""

    def __init__(self, roots: list[Path]) -> None:
        self.roots = roots
        self.seen: dict[Path, int] = {}
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="latest-watch")

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            for root in self.roots:
                try:
                    body = json.loads((root / "latest").read_text())
                    # Commit order: the sequence number (a rollback makes a lower step the newest).
                    pos = int(body["seq"]) if "seq" in body else int(body["step"])
                except (OSError, ValueError, KeyError, TypeError):
                    continue
                prev = self.seen.get(root)
                if prev is not None and pos < prev:
                    self.violations.append(
                        f"{root}/latest moved backwards in commit order: seq {prev} -> {pos} ({body.get('dir')})"
                    )
                self.seen[root] = max(pos, prev if prev is not None else pos)

    def __enter__(self) -> LatestWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def take(self) -> list[str]:
        out, self.violations = self.violations, []
        return out


# -- the campaign ---------------------------------------------------------------------------------


@dataclass
class Topo:
    """Where a chain's checkpoints live and how its job is laid out."""

    name: str
    nnodes: int
    nproc: int
    node_roots: list[Path]  # what each node's ranks use as the root
    truth: list[Path]  # the same roots as the driver sees them (the sshfs server side)
    leaders: tuple[int, ...]

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc

    def node_env(self) -> list[dict[str, str]]:
        return [{"CKPT_ROOT": str(r)} for r in self.node_roots]


class Campaign:
    def __init__(
        self,
        workdir: Path,
        seed: int = 0,
        log: Callable[[str], None] = print,
        job_timeout: float = 240,
        yield_to: str | None = None,
        results: Path | None = None,
        run_id: str = "",
        kill_layouts: tuple[str, ...] = KILL_LAYOUTS,
    ) -> None:
        self.kill_layouts = kill_layouts  # the layout of the i-th trial of a kill kind: kill_layouts[i % len]
        self.results = results  # a JSONL file: one record per trial is appended (resumable campaigns)
        self.run_id = run_id or f"{time.strftime('%Y%m%dT%H%M%S')}-{seed}"
        self.commit = _git_commit()
        self.yield_to = yield_to  # pause before each job while a process running this script exists
        self.paused_s = 0.0
        self.workdir = workdir
        self.rng = random.Random(seed)
        self.seed = seed
        self.log = log
        self.report = Report(started=time.strftime("%Y-%m-%d %H:%M:%S"))
        self.job_timeout = job_timeout
        self._gen = 0
        self._failed = 0
        self.scratch = workdir / "scratch"
        self.scratch.mkdir(parents=True, exist_ok=True)

    # -- plumbing ----------------------------------------------------------------------------
    def fresh_root(self, name: str) -> Path:
        """A root of this run only: named by the run's seed, so a resumed campaign that reuses its
        --workdir never starts a chain on the roots (and the committed or damaged steps) of an earlier
        run; removed first if a run with this very seed left it."""
        path = self.workdir / f"{name}-{self.seed}"
        shutil.rmtree(path, ignore_errors=True)
        return path

    def next_gen(self) -> int:
        self._gen += 1
        return self._gen

    def job(
        self,
        topo: Topo,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        pause: bool = True,
    ) -> tuple[JobResult | None, dict[int, list[dict[str, Any]]], str | None]:
        """Run one worker job; returns (result, events by rank, error text if it timed out).

        ``pause=False`` for jobs that must start now (the second job of a two-job trial, the job
        that takes over a stalled one): the trial pauses once, before its first job."""
        if pause:
            self._yield()
        full_env = {"CKPT_SCRATCH": str(self.scratch), **(env or {})}
        try:
            job = run_job(
                CAMPAIGN_JOB,
                args,
                nnodes=topo.nnodes,
                nproc_per_node=topo.nproc,
                env=full_env,
                node_env=topo.node_env(),
                timeout=timeout or self.job_timeout,
                straggler_grace=15,
            )
        except JobTimeout as e:
            return e.result, parse_events(e.result, topo.world), f"job timed out: {tail(e.result)}"
        return job, parse_events(job, topo.world), None

    def _yield(self) -> None:
        """Wait while someone else's benchmark runs (a long campaign must not skew their figures)."""
        if not self.yield_to:
            return
        t0 = time.monotonic()
        announced = False
        while _running(self.yield_to):
            if not announced:
                self.log(f"paused: {self.yield_to} is running")
                announced = True
            time.sleep(10)
        if announced:
            self.paused_s += time.monotonic() - t0
            self.log(f"resumed after {time.monotonic() - t0:.0f} s")

    def record(self, trial: Trial, seconds: float) -> None:
        t = self.report.row(trial.kind, trial.sub)
        t.trials += 1
        t.faults += int(trial.injected)
        t.failures += int(bool(trial.problems))
        t.torn += int(trial.torn)
        t.lost += int(trial.lost)
        t.seconds += seconds
        for p in trial.problems:
            self.report.problems.append(f"[{trial.kind}/{trial.sub}] {p}")
        if trial.problems:
            self._failed += 1
            logs = self.workdir / f"failed-{self.seed}"
            logs.mkdir(exist_ok=True)
            path = logs / f"{self._failed:03d}-{trial.kind}-{trial.sub.replace(' ', '_')}.log"
            parts = ["\n".join(trial.problems)]
            for job in trial.jobs:
                parts.append(job.output())
                parts += [f"===== rank {r} =====\n{job.rank_output(r)}" for r in range(8) if job.rank_output(r)]
            path.write_text("\n\n".join(parts))
            self.report.problems.append(f"  (logs: {path})")
        if self.results is not None:
            rec = {
                "run": self.run_id,
                "seed": self.seed,
                "commit": self.commit,
                "time": round(time.time(), 1),
                "kind": trial.kind,
                "variant": trial.sub,
                "fault": trial.fault,
                "signal": trial.signal if trial.injected else "",
                "injected": int(trial.injected),
                "outcome": "fail" if trial.problems else "ok",
                "torn": int(trial.torn),
                "lost": int(trial.lost),
                "seconds": round(seconds, 2),
                "problems": [p[:500] for p in trial.problems[:3]],
            }
            self.results.parent.mkdir(parents=True, exist_ok=True)
            with open(self.results, "a") as f:
                f.write(json.dumps(rec) + "\n")
        status = "FAIL " + "; ".join(trial.problems)[:400] if trial.problems else "ok"
        self.log(f"  {trial.kind:<12} {trial.sub:<16} injected={int(trial.injected)} {status}")

    # -- kinds ---------------------------------------------------------------------------------
    def run(self, plan: dict[str, int]) -> Report:
        """Run ``plan`` ({kind: trials}); returns the report (also kept in self.report)."""
        t0 = time.monotonic()
        unknown = set(plan) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
        kill_plan = {k: plan.get(k, 0) for k in ("kill_phase", "kill_random", "kill_load")}
        if sum(kill_plan.values()):
            self.kill_chains(kill_plan)
        if plan.get("stale_cache"):
            self.stale_cache(plan["stale_cache"])
        if plan.get("corruption"):
            self.corruption(plan["corruption"])
        if plan.get("disk_full"):
            self.disk_full(plan["disk_full"])
        if plan.get("two_jobs"):
            self.two_jobs(plan["two_jobs"])
        if plan.get("takeover"):
            self.takeover(plan["takeover"])
        from . import campaign_kinds as more  # the lifecycle kinds (they import this module)

        more.run_lifecycle_kinds(self, plan)
        self.report.seconds = time.monotonic() - t0 - self.paused_s
        return self.report

    def _fault(self, kind: str, i: int, topo: Topo) -> tuple[str, str]:
        """(variant, --fault spec) of the i-th trial of a kill kind on ``topo``."""
        if kind == "kill_phase":
            phase = SAVE_PHASES[i % len(SAVE_PHASES)]
            ranks = topo.leaders if phase in LEADER_PHASES else tuple(range(topo.world))
            return phase.value, f"phase:{phase.value}:{self.rng.choice(ranks)}"
        if kind == "kill_random":
            return "random moment", f"random:{self.rng.randrange(topo.world)}:{self.rng.uniform(0.0, 1.5):.3f}"
        if kind == "kill_load":
            return FaultPhase.MID_LOAD.value, f"load:{self.rng.randrange(topo.world)}"
        raise ValueError(kind)

    def kill_chains(self, plan: dict[str, int]) -> None:
        """Kill trials on three layouts, in the order of ``kill_layouts``: 1 node x 2 ranks (cheap; half
        of the trials by default), 2 nodes x 2 ranks sharing one root, and 2 nodes x 2 ranks with
        node-local roots (two storage domains, so a commit can be published on one domain and not the
        other)."""
        single = self.fresh_root("kill-single")
        shared = self.fresh_root("kill-shared")
        local = [self.fresh_root("kill-local-n0"), self.fresh_root("kill-local-n1")]
        topos = {
            "single": Topo("single", 1, 2, [single], [single], (0,)),
            "shared": Topo("shared", 2, 2, [shared, shared], [shared], (0,)),
            "local": Topo("local", 2, 2, local, local, (0, 2)),
        }
        cycle = self.kill_layouts
        unknown = set(cycle) - set(topos)
        if unknown or not cycle:
            raise ValueError(f"unknown kill layouts {sorted(unknown)}; known: {', '.join(topos)}")
        per_topo: dict[str, list[tuple[str, str, str]]] = {k: [] for k in topos}
        for kind, n in plan.items():
            for i in range(n):
                name = cycle[i % len(cycle)]
                sub, spec = self._fault(kind, i, topos[name])
                per_topo[name].append((kind, sub, spec))
        for name, faults in per_topo.items():
            if faults:
                self.rng.shuffle(faults)
                self.log(f"kill chain on {name} roots: {len(faults)} trials")
                Chain(self, topos[name], f"kill-{name}").run(faults)

    def stale_cache(self, n: int) -> None:
        """Kill trials on the 2-node sshfs bed: node 0 on mount A, node 1 on mount B of one directory."""
        try:
            cm = stale_shared_storage(2)
            bed = cm.__enter__()
        except BedUnavailable as e:
            self.report.problems.append(f"[stale_cache] bed unavailable, not run: {e}")
            self.log(f"stale_cache: sshfs bed unavailable ({e})")
            return
        try:
            topo = Topo("sshfs", 2, 2, [m / "ckpt" for m in bed.mounts], [bed.server_dir / "ckpt"], (0,))
            per = {"kill_phase": n - n // 4 - n // 8, "kill_random": n // 4, "kill_load": n // 8}
            faults = [("stale_cache", *self._fault(kind, i, topo)) for kind, k in per.items() for i in range(k)]
            self.rng.shuffle(faults)
            self.log(f"kill chain on the sshfs stale-cache bed: {len(faults)} trials")
            Chain(self, topo, "stale", expect_domains=[[0, 1, 2, 3]]).run(faults)
        finally:
            cm.__exit__(None, None, None)

    def corruption(self, n: int, per_job: int = 60) -> None:
        """Damage after commit; one job runs many trials (alternating shared and node-local roots)."""
        done = 0
        index = 0
        while done < n:
            k = min(per_job, n - done)
            if index % 2 == 0:
                root = self.fresh_root(f"corrupt-{index}")
                topo = Topo("shared", 2, 2, [root, root], [root], (0,))
            else:
                roots = [self.fresh_root(f"corrupt-{index}-n{i}") for i in range(2)]
                topo = Topo("local", 2, 2, roots, roots, (0, 2))
            self._corruption_job(topo, k, offset=done)
            done += k
            index += 1

    def _corruption_job(self, topo: Topo, n: int, offset: int) -> None:
        t0 = time.monotonic()
        gen = self.next_gen()
        job, evs, timeout = self.job(
            topo,
            [
                "corrupt",
                "--gen",
                str(gen),
                "--trials",
                str(n),
                "--seed",
                str(self.rng.randrange(2**31)),
                "--cli-every",
                "7",
            ],
        )
        seconds = (time.monotonic() - t0) / max(1, n)
        damages = {e["trial"]: e for e in events_of(evs, "damage", 0)}
        setup = Trial("corruption", "setup", jobs=[job] if job else [])
        check_restart(setup, evs, topo, history=None)
        if timeout or job is None or not job.ok:
            setup.fail(f"corruption job on {topo.name} roots did not finish: {timeout or tail(job)}")
        if setup.problems:
            self.record(setup, 0.0)
        for i in range(n):
            kind = DAMAGES[i % len(DAMAGES)]
            trial = Trial("corruption", kind, jobs=[job] if job else [])
            d = damages.get(i)
            if d is None:
                trial.fail(f"trial {offset + i}: no damage was applied (job died earlier)")
                self.record(trial, seconds)
                continue
            trial.injected = True
            check_damage(trial, d, evs, topo, gen)
            self.record(trial, seconds)

    def disk_full(self, n: int, per_job: int = 40) -> None:
        """The root on a small tmpfs shared by both nodes, filled to a random few bytes short of a save."""
        done = 0
        while done < n:
            k = min(per_job, n - done)
            try:
                with small_filesystem("24m", base=self.workdir) as mp:
                    root = mp / "ckpt"
                    topo = Topo("tmpfs", 2, 2, [root, root], [root], (0,))
                    self._disk_full_job(topo, k)
            except BedUnavailable as e:
                self.report.problems.append(f"[disk_full] bed unavailable, not run: {e}")
                self.log(f"disk_full: tmpfs bed unavailable ({e})")
                return
            done += k

    def _disk_full_job(self, topo: Topo, n: int) -> None:
        t0 = time.monotonic()
        gen = self.next_gen()
        job, evs, timeout = self.job(
            topo,
            [
                "diskfull",
                "--gen",
                str(gen),
                "--trials",
                str(n),
                "--keep-last",
                "2",
                "--seed",
                str(self.rng.randrange(2**31)),
                "--lease-ttl",
                "2",
                "--hold-every",
                "8",
                "--hold-s",
                "1.2",
            ],
        )
        seconds = (time.monotonic() - t0) / max(1, n)
        setup = Trial("disk_full", "setup", jobs=[job] if job else [])
        check_restart(setup, evs, topo, history=None)
        if timeout or job is None or not job.ok:
            setup.fail(f"disk-full job did not finish: {timeout or tail(job)}")
        if setup.problems:
            self.record(setup, 0.0)
        held = {e["trial"] for e in events_of(evs, "filled", 0) if e["hold"]}
        for i in range(n):
            trial = Trial("disk_full", "full for 1.2 s" if i in held else "full mid-save", jobs=[job] if job else [])
            check_disk_full(trial, i, evs, topo, gen)
            self.record(trial, seconds)

    def two_jobs(self, n: int) -> None:
        """Two 1-node jobs started on one root at the same moment: one wins, the other is refused."""
        root = self.fresh_root("two-jobs")
        topo = Topo("shared", 1, 2, [root], [root], (0,))
        with LatestWatch([root]) as watch:
            for i in range(n):
                self._yield()
                t0 = time.monotonic()
                trial = Trial("two_jobs", "simultaneous start")
                sync = Path(tempfile.mkdtemp(prefix=f"two-{i}-", dir=self.workdir))
                gens = [self.next_gen(), self.next_gen()]
                results: list[Any] = [None, None]

                def launch(j: int, sync: Path = sync, gens: list[int] = gens, results: list[Any] = results) -> None:
                    results[j] = self.job(
                        topo,
                        [
                            "contend",
                            "--gen",
                            str(gens[j]),
                            "--other",
                            str(gens[1 - j]),
                            "--sync",
                            str(sync),
                            "--lease-wait",
                            "2",
                        ],
                        pause=False,
                    )

                threads = [threading.Thread(target=launch, args=(j,)) for j in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                trial.jobs = [r[0] for r in results if r is not None and r[0] is not None]
                check_two_jobs(trial, results, topo, gens)
                for v in watch.take():
                    trial.fail(v)
                shutil.rmtree(sync, ignore_errors=True)
                self.record(trial, time.monotonic() - t0)

    def takeover(self, n: int, ttl: float = 4.0) -> None:
        """A job stalls (SIGSTOP of its leader) past its lease TTL; a second job takes the root over;
        the first one wakes up and must be fenced off. Alternately the stall hits between two saves
        ("idle") and inside a save, right before the publishing rename ("publish")."""
        root = self.fresh_root("takeover")
        topo = Topo("shared", 1, 2, [root], [root], (0,))
        with LatestWatch([root]) as watch:
            for i in range(n):
                self._yield()
                t0 = time.monotonic()
                at = ("idle", "publish")[i % 2]
                trial = Trial(
                    "takeover",
                    f"stalled {'between saves' if at == 'idle' else 'before publish'}",
                    fault=f"{at}:leader:stop",
                    signal="stop",
                )
                sync = Path(tempfile.mkdtemp(prefix=f"takeover-{i}-", dir=self.workdir))
                gv, gt = self.next_gen(), self.next_gen()
                victim: list[Any] = [None]

                def run_victim(sync: Path = sync, gv: int = gv, victim: list[Any] = victim, at: str = at) -> None:
                    victim[0] = self.job(
                        topo,
                        ["victim", "--gen", str(gv), "--sync", str(sync), "--lease-ttl", str(ttl), "--stall-at", at],
                        pause=False,
                    )

                th = threading.Thread(target=run_victim)
                th.start()
                deadline = time.monotonic() + self.job_timeout
                while not (sync / "stalled").exists() and th.is_alive() and time.monotonic() < deadline:
                    time.sleep(0.05)
                thief = None
                if (sync / "stalled").exists():
                    thief = self.job(
                        topo,
                        ["thief", "--gen", str(gt), "--sync", str(sync), "--lease-ttl", str(ttl), "--stall-at", at],
                        pause=False,
                    )
                else:
                    (sync / "thief-ready").touch()  # let a victim that never stalled finish
                th.join()
                trial.jobs = [r[0] for r in (victim[0], thief) if r is not None and r[0] is not None]
                check_takeover(trial, victim[0], thief, topo, gv, gt)
                for v in watch.take():
                    trial.fail(v)
                shutil.rmtree(sync, ignore_errors=True)
                self.record(trial, time.monotonic() - t0)


# -- kill chains -------------------------------------------------------------------------------------


@dataclass
class History:
    """What the chain knows about its root after a job: the driver's side of the restart checks."""

    committed: list[int]  # the last committed list rank 0 reported (after a save, or at the restart)
    attempted: dict[int, int]  # step -> gen of the last job that announced a save of it


class Chain:
    """A sequence of jobs on one root: job g+1 checks what job g's fault left behind."""

    def __init__(
        self, campaign: Campaign, topo: Topo, name: str, expect_domains: list[list[int]] | None = None
    ) -> None:
        self.c = campaign
        self.topo = topo
        self.name = name
        self.expect_domains = expect_domains

    def run(self, faults: list[tuple[str, str, str]]) -> None:
        history: History | None = None
        pending: Trial | None = None  # the previous job's fault, to be judged by this job's restart
        pending_s = 0.0
        with LatestWatch(self.topo.truth) as watch:
            for kind, sub, spec in [*faults, ("check", "final", "none")]:
                t0 = time.monotonic()
                gen = self.c.next_gen()
                at = self.c.rng.randrange(3)
                # Half of the saving faults hit background saves (blocking=False).
                async_saves = not spec.startswith(("load", "none")) and self.c.rng.random() < 0.5
                if async_saves:
                    sub += " +async"
                job, evs, timeout = self.c.job(
                    self.topo,
                    [
                        "chain",
                        "--gen",
                        str(gen),
                        "--job-id",
                        f"campaign-{self.name}",
                        "--fault",
                        spec,
                        "--at",
                        str(at),
                        "--keep-last",
                        str(KEEP_LAST),
                        *(["--async-saves"] if async_saves else []),
                    ],
                )
                judge = pending or Trial("chain", "first job")
                if job is not None:
                    judge.jobs.append(job)
                check_restart(judge, evs, self.topo, history, expect_domains=self.expect_domains)
                for v in watch.take():
                    judge.fail(v)
                if judge.problems and not events_of(evs, "saved", 0):
                    judge.fail(f"the restart did not complete: {timeout or tail(job)}")
                if pending is not None or judge.problems:
                    self.c.record(judge, pending_s)
                if kind == "check":
                    if timeout or job is None or not job.ok:
                        final = Trial("chain", "final check", jobs=[job] if job else [])
                        final.fail(f"the final check job failed: {timeout or tail(job)}")
                        self.c.record(final, 0.0)
                    break
                pending = Trial(kind, sub, fault=spec, signal="kill", jobs=[job] if job else [])
                classify_kill(pending, job, evs, spec, timeout)
                history = update_history(history, evs, gen)
                pending_s = time.monotonic() - t0


def classify_kill(
    trial: Trial, job: JobResult | None, evs: dict[int, list[dict[str, Any]]], spec: str, timeout: str | None
) -> None:
    """Did this job die by its injected SIGKILL (and only that)? Also checks a killed load changed nothing."""
    if timeout:
        trial.fail(f"fault {spec}: {timeout}")
        return
    assert job is not None
    armed = events_of(evs, "armed")
    survived = events_of(evs, "survived", 0)
    if not armed:
        trial.fail(f"fault {spec}: the job died before the fault was armed: {tail(job)}")
        return
    if survived or job.ok:
        trial.fail(f"fault {spec}: the fault never fired (the job survived)")
        return
    if not job.sigkilled():
        trial.fail(f"fault {spec}: the job failed, but not by SIGKILL: {tail(job)}")
        return
    trial.injected = True
    for d in events_of(evs, "digest"):
        now = tree_digest(d["root"])
        if now != d["digest"]:
            trial.fail(f"a load killed by {spec} modified committed data in {d['root']}", torn=True)


def update_history(history: History | None, evs: dict[int, list[dict[str, Any]]], gen: int) -> History:
    """The last committed list rank 0 printed, and every step any rank announced it was saving."""
    committed = history.committed if history else []
    attempted = dict(history.attempted) if history else {}
    for e in evs.get(0, []):
        if e.get("event") == "start":
            committed = e["steps"]
        elif e.get("event") == "saved":
            committed = e["committed"]
    for r in sorted(evs):
        for e in evs[r]:
            if e.get("event") == "saving":
                attempted[e["step"]] = gen
    return History(committed, attempted)


def check_restart(
    trial: Trial,
    evs: dict[int, list[dict[str, Any]]],
    topo: Topo,
    history: History | None,
    expect_domains: list[list[int]] | None = None,
) -> None:
    """The restart checks: committed steps (none lost, none invented), every load bitwise, clean save, no garbage."""
    start = events_of(evs, "start", 0)
    if not start:
        trial.fail("the restarted job did not get as far as listing its checkpoints")
        return
    steps = start[0]["steps"]
    if expect_domains is not None and start[0]["domains"] != expect_domains:
        trial.fail(f"storage domains {start[0]['domains']}, expected {expect_domains}")
    if history is not None:
        prev = history.committed
        if prev and prev[-1] not in steps:
            trial.fail(
                f"newest committed step {prev[-1]} lost (committed before: {prev}, after restart: {steps})", lost=True
            )
        keep = set(sorted(set(prev) | set(steps))[-KEEP_LAST:])
        gone = [s for s in prev if s in keep and s not in steps]
        if gone:
            trial.fail(f"committed steps {gone} lost (before: {prev}, after: {steps})", lost=True)
        # A step may be committed only if some job tried to save it (a save killed after the
        # rename, or retention killed before it deleted an old step, leave such steps).
        invented = sorted(set(steps) - set(history.attempted))
        if invented:
            trial.fail(f"steps {invented} are committed but no job ever saved them", torn=True)
    for e in events_of(evs, "failed-load"):
        if not e["untouched"]:
            trial.fail(
                f"rank {e['rank']}: a failed load ({e['what']}, {e['error']}) changed the caller's state", torn=True
            )
    for e in events_of(evs, "loaded"):
        if e["what"] not in ("newest", "older"):
            continue
        if not e["ok"]:
            trial.fail(f"rank {e['rank']} loaded step {e['step']} with wrong content: {e['bad']}", torn=True)
        if e["extra_files"]:
            trial.fail(
                f"rank {e['rank']}: restoring step {e['step']}'s files= into an empty directory left "
                f"files the checkpoint does not hold: {e['extra_files']}",
                torn=True,
            )
        if history is not None and e["step"] is not None and history.attempted.get(e["step"], e["gen"]) != e["gen"]:
            trial.fail(
                f"rank {e['rank']} loaded step {e['step']} as saved by job {e['gen']}, but job "
                f"{history.attempted[e['step']]} saved it last",
                torn=True,
            )
        if e["what"] == "newest":
            if e["step"] != (steps[-1] if steps else None):  # steps() lists in commit order
                trial.fail(
                    f"rank {e['rank']}: load() returned step {e['step']}, committed last is "
                    f"{steps[-1] if steps else None}"
                )
            if e["warned"]:
                trial.fail(f"rank {e['rank']}: load() warned: {e['warned']}")
    check_saved_clean(trial, evs)


def check_saved_clean(trial: Trial, evs: dict[int, list[dict[str, Any]]]) -> None:
    """The save after a restart completed, and it left no attempt in staging and nothing in trash."""
    if not events_of(evs, "saved", 0):
        trial.fail("the save after the restart did not complete")
    for e in events_of(evs, "garbage"):
        if e["staging"] or e["trash"]:
            trial.fail(f"garbage survived a successful save in {e['root']}: staging={e['staging']} trash={e['trash']}")
            break


def check_damage(trial: Trial, d: dict[str, Any], evs: dict[int, list[dict[str, Any]]], topo: Topo, gen: int) -> None:
    i, target = d["trial"], d["step"]
    cli = d.get("cli")
    if d.get("kind") == "extra":
        # A file the manifest does not list is never read by a load: verify warns about it, the step
        # stays intact and safe to resume from (and load(step=None) gives it, checked below).
        if not d["verify_intact"] or d.get("problems") != ["extra"]:
            trial.fail(f"trial {i}: verify_checkpoint gave {d.get('problems')} after '{d['what']}'")
        if cli is not None and (cli["rc"] != 0 or target in cli["flagged"]):
            trial.fail(
                f"trial {i}: `ckptguard verify --json` rc={cli['rc']} flagged {cli['flagged']} after '{d['what']}'"
            )
    else:
        if d["verify_intact"]:
            trial.fail(f"trial {i}: verify_checkpoint found step {target} intact after '{d['what']}'")
        if cli is not None and (cli["rc"] != 1 or (cli["target_listed"] and target not in cli["flagged"])):
            trial.fail(
                f"trial {i}: `ckptguard verify --json` rc={cli['rc']} flagged {cli['flagged']} after '{d['what']}'"
            )
    for e in events_of(evs, "failed-load"):
        if e.get("trial") == i and not e["untouched"]:
            trial.fail(
                f"trial {i}: rank {e['rank']}: load(step={e['step']}) raised {e['error']} after "
                f"'{d['what']}' and changed the caller's state",
                torn=True,
            )
    fallbacks = [e for e in events_of(evs, "fallback") if e["trial"] == i]
    if len(fallbacks) != topo.world:
        trial.fail(f"trial {i}: load(step=None) did not return on every rank after '{d['what']}'")
    loaded = {e["loaded"] for e in fallbacks}
    if len(loaded) > 1:
        trial.fail(f"trial {i}: ranks loaded different steps {loaded}", torn=True)
    for s in loaded:
        if s not in (target, target - 1):
            trial.fail(
                f"trial {i}: load(step=None) returned {s} after '{d['what']}' on step {target} "
                f"(step {target - 1} is intact)"
            )
    for e in events_of(evs, "loaded"):
        if e["what"] in ("after-damage", "damaged-explicit") and e.get("trial") == i:
            if not e["ok"]:
                trial.fail(
                    f"trial {i}: rank {e['rank']} loaded step {e['step']} with wrong content after "
                    f"'{d['what']}': {e['bad']}",
                    torn=True,
                )
            if e["gen"] != gen:
                trial.fail(f"trial {i}: rank {e['rank']} loaded gen {e['gen']}, expected {gen}", torn=True)
            if e["extra_files"]:
                trial.fail(
                    f"trial {i}: rank {e['rank']} loaded step {e['step']} after '{d['what']}'; its files= "
                    f"directory also holds {e['extra_files']}, files of another checkpoint",
                    torn=True,
                )


def check_disk_full(trial: Trial, i: int, evs: dict[int, list[dict[str, Any]]], topo: Topo, gen: int) -> None:
    outcomes = [e for e in events_of(evs, "diskfull") if e["trial"] == i]
    if len(outcomes) != topo.world:
        trial.fail(f"trial {i}: only {len(outcomes)} of {topo.world} ranks report the save's outcome")
        return
    kinds = {e["outcome"] for e in outcomes}
    if len(kinds) != 1:
        trial.fail(f"trial {i}: ranks disagree on the outcome: {sorted(kinds)}")
        return
    e0 = outcomes[0]
    root = str(topo.node_roots[0])
    if kinds == {"raised"}:
        trial.injected = True
        if not all("disk full" in e["msg"] and root in e["msg"] and "bytes" in e["msg"] for e in outcomes):
            trial.fail(f"trial {i}: the error does not say disk full, the root and the bytes: {e0['msg'][:300]}")
        # Every rank raises at the same agreement, on the same agreed failures (a rank that failed
        # itself raises its own error, in its own words, and names the first failure if it was another's).
        agreed = {json.dumps(e.get("agreed")) for e in outcomes}
        if len(agreed) != 1 or not e0.get("agreed"):
            trial.fail(f"trial {i}: ranks did not agree on the failure: {sorted(agreed)[:2]}")
        if e0["after"] != e0["before"]:
            trial.fail(
                f"trial {i}: committed steps changed by a failed save: {e0['before']} -> {e0['after']}",
                lost=not set(e0["before"]) <= set(e0["after"]),
            )
    elif e0["step"] not in e0["after"]:
        trial.fail(f"trial {i}: the save fit but step {e0['step']} is not committed: {e0['after']}")
    rank_evs = {r: evs[r] for r in evs}
    for r, lst in rank_evs.items():
        idx = next((k for k, x in enumerate(lst) if x.get("event") == "diskfull" and x["trial"] == i), None)
        if idx is None:
            continue
        after = lst[idx + 1 :]
        load = next((x for x in after if x.get("event") == "loaded"), None)
        if load is None or not load["ok"] or load["step"] != (max(e0["after"]) if e0["after"] else None):
            trial.fail(
                f"trial {i}: rank {r} did not load the newest committed step bitwise after the disk-full save: {load}",
                torn=bool(load and not load["ok"]),
            )
        nxt = next((x for x in after if x.get("event") in ("saved", "diskfull", "postfree-failed")), None)
        if nxt is not None and nxt["event"] == "postfree-failed":
            trial.fail(f"trial {i}: rank {r}: the save after freeing space failed: {nxt['msg']}")
            nxt = next((x for x in after[after.index(nxt) + 1 :] if x.get("event") in ("saved", "diskfull")), None)
        if nxt is None or nxt["event"] != "saved":
            trial.fail(f"trial {i}: rank {r}: the save after freeing space did not succeed")
        if r in topo.leaders:
            garbage = next((x for x in after if x.get("event") == "garbage"), None)
            if garbage is None or garbage["staging"] or garbage["trash"]:
                trial.fail(f"trial {i}: garbage after the next successful save: {garbage}")


def check_two_jobs(trial: Trial, results: list[Any], topo: Topo, gens: list[int]) -> None:
    won, refused = [], []
    for j, res in enumerate(results):
        job, evs, timeout = res
        if timeout:
            trial.fail(f"job {gens[j]}: {timeout}")
            continue
        if events_of(evs, "won"):
            won.append(j)
            check_restart(trial, evs, topo, history=None)
            for e in events_of(evs, "loaded"):
                if not e["ok"]:
                    trial.fail(f"winner rank {e['rank']} loaded step {e['step']} with wrong content", torn=True)
            if not job.ok:
                trial.fail(f"the winning job failed: {tail(job)}")
        r = events_of(evs, "refused")
        if r:
            refused.append(j)
            if len(r) != topo.world:
                trial.fail(f"job {gens[j]}: only {len(r)} ranks got the error")
            msg = r[0]["msg"]
            if "in use by" not in msg or "pid" not in msg:
                trial.fail(f"the refusal does not name the holder: {msg}")
            if events_of(evs, "saving"):
                trial.fail(f"job {gens[j]} was refused but saved")
    if len(won) == 1 and len(refused) == 1:
        trial.injected = True
    else:
        trial.fail(f"expected one winner and one refused job, got winners {won}, refused {refused}")


def check_takeover(trial: Trial, victim: Any, thief: Any, topo: Topo, gv: int, gt: int) -> None:
    vjob, vevs, vtimeout = victim
    if vtimeout:
        trial.fail(f"victim: {vtimeout}")
    if thief is None:
        if events_of(vevs, "missed-window") and vjob is not None and vjob.ok:
            trial.sub += " (window missed)"  # the save published before the watcher could stop it
            return
        trial.fail(f"the victim never stalled: {tail(vjob)}")
        return
    tjob, tevs, ttimeout = thief
    if ttimeout:
        trial.fail(f"thief: {ttimeout}")
    fenced = events_of(vevs, "fenced")
    inflight = {e["step"] for e in events_of(vevs, "saving", 0)}
    if events_of(vevs, "not-fenced"):
        step = events_of(vevs, "not-fenced", 0)[0]["step"] if events_of(vevs, "not-fenced", 0) else "?"
        trial.injected = True
        trial.fail(f"the stalled job published step {step} after its lease had been taken over by job {gt}")
    elif len(fenced) != topo.world:
        trial.fail(f"the victim was not fenced on every rank ({len(fenced)}): {tail(vjob)}")
    else:
        trial.injected = True
        # Stalled inside a save, the attempt is fenced off by the takeover itself (its staging
        # directory is moved away); that message is pinned by test_campaign.py instead.
        if "between saves" in trial.sub and "lease" not in fenced[0]["msg"]:
            trial.fail(f"the fencing error does not say why: {fenced[0]['msg']}")
    if not events_of(tevs, "took-over"):
        trial.fail(f"the second job did not take over: {tail(tjob)}")
        return
    check_restart(trial, tevs, topo, history=None)
    for e in events_of(tevs, "loaded"):
        if e["what"] == "newest" and e["gen"] != gv:
            trial.fail(
                f"the second job's first load got job {e['gen']}'s step {e['step']}, expected the stalled job's ({gv})",
                torn=True,
            )
        if not e["ok"]:
            trial.fail(f"rank {e['rank']} loaded step {e['step']} with wrong content: {e['bad']}", torn=True)
        if (
            e["what"] == "thief-final"
            and e["gen"] == gv
            and e["step"] in inflight
            and not any(x["step"] == e["step"] for x in events_of(vevs, "saved", 0))
        ):
            trial.fail(f"step {e['step']} of the stalled job {gv} is committed in the root job {gt} took over")
    for e in events_of(tevs, "thief-save-failed", 0):
        trial.fail(f"the job that took over could not save step {e['step']}: {e['msg'][:300]}")
    thief_saved = {e["step"] for e in events_of(tevs, "saved", 0)}
    for e in events_of(tevs, "loaded"):
        if e["what"] == "thief-final" and e["step"] in thief_saved and e["gen"] != gt:
            trial.fail(f"step {e['step']} holds job {e['gen']}'s data after the takeover by {gt}", torn=True)
    if tjob is not None and not tjob.ok and not events_of(tevs, "thief-save-failed"):
        trial.fail(f"the second job failed: {tail(tjob)}")
