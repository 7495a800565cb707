"""Record a scenario's real save through the FUSE recorder, then build and check its crash states.

    python tests/support/beds/powerloss/explorer.py --states 400 --json out.json     # every scenario, both models
    python tests/support/beds/powerloss/explorer.py --scenarios files --models B --states 50

For each scenario: run it (N ranks, real library, on the recording mount), take the
recording, and for each crash model walk the candidate crash states (model.py: extremes
at every crash point, then single losses, then seeded random combinations), skip those
already seen (same content hash and same number of saves returned before the crash point:
one content can be fine before a save returned and a violation after), write each new one
to a tmpfs directory and check it:

* ``load`` by a ``read_only`` Checkpointer (all ranks) gives, bit for bit, the newest
  checkpoint committed before the crash point or the new one (only the new one once a
  rank's save()/wait() returned before the crash point); no fallback from a corrupt one;
* nothing committed before the save began is lost (what the new one replaces, by retention
  or overwrite, only once the new one is there), every committed step loads bit for bit;
* ``latest``, if present, parses and names a committed checkpoint;
* every ``verify_every``-th state: ``ckptguard verify --json`` as a subprocess agrees with
  the loads (same steps, intact exactly where load succeeded).

Exploration stops at the budget of distinct states or when ``patience`` candidates in a
row were all duplicates (the space is exhausted).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `tests.support` importable (the repository root)
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
    __package__ = "tests.support.beds.powerloss"

from tests.support.beds.powerloss.bed import Mount, Recording, recording_mount
from tests.support.beds.powerloss.checker import Checker
from tests.support.beds.powerloss.model import MODELS, Choice, CrashModel, State
from tests.support.beds.powerloss.scenarios import FRESH_SUBDIRS, SCENARIOS, Scenario, kept

REPO_DIR = Path(__file__).resolve().parents[4]  # tests.support is imported from here
ROOT_NAME = "ckpt"  # the checkpoint root inside the mount


@dataclass
class Violation:
    scenario: str
    choice: Choice
    problems: list[str]

    def describe(self) -> str:
        return f"{self.scenario}: {self.choice.describe()}: " + "; ".join(self.problems)


@dataclass
class Result:
    scenario: str
    model: str
    ops: int
    op_counts: dict[str, int]
    states: int = 0
    candidates: int = 0
    verified: int = 0
    violations: list[Violation] = field(default_factory=list)
    seconds: float = 0.0

    def row(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "model": self.model,
            "ops": self.ops,
            "states": self.states,
            "candidates": self.candidates,
            "verify_runs": self.verified,
            "violations": len(self.violations),
            "seconds": round(self.seconds, 1),
        }


# -- running a scenario --------------------------------------------------------------------------


def _src_dir() -> str:
    import ckptguard

    return str(Path(ckptguard.__file__).resolve().parents[1])


def run_scenario(
    sc: Scenario, mount: Mount, world: int = 2, broken: str | None = None, timeout: float = 180.0
) -> Recording:
    """Run the scenario's ranks (setup, then the recorded part) and return the recording."""
    root = str(mount.mountpoint / ROOT_NAME)
    work = tempfile.mkdtemp(prefix="ckptguard-plwork-")
    try:
        for phase in sc.phases:
            env = {
                k: v
                for k, v in os.environ.items()
                if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
            }
            env.update(
                PYTHONPATH=os.pathsep.join([_src_dir(), str(REPO_DIR)]),
                WORLD_SIZE=str(world),
                POWERLOSS_INIT=os.path.join(work, f"store-{phase}"),
                POWERLOSS_MOUNT=str(mount.mountpoint),
                GLOO_SOCKET_IFNAME="lo",
                OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1",
            )
            env.pop("POWERLOSS_BREAK", None)
            if broken:
                env["POWERLOSS_BREAK"] = broken
            procs, logs = [], []
            for r in range(world):
                log = open(os.path.join(work, f"{phase}-rank{r}.log"), "wb")  # noqa: SIM115
                logs.append(log)
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tests.support.beds.powerloss.worker", sc.name, phase, root, work],
                        env={**env, "RANK": str(r)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=str(REPO_DIR),
                        start_new_session=True,
                    )
                )
            try:
                deadline = time.monotonic() + timeout
                for p in procs:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            finally:
                for p in procs:
                    if p.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
                for log in logs:
                    log.close()
            if any(p.returncode != 0 for p in procs):
                out = "\n".join(
                    Path(work, f"{phase}-rank{r}.log").read_text(errors="replace")[-3000:] for r in range(world)
                )
                raise RuntimeError(
                    f"scenario {sc.name} phase {phase} failed (exit codes {[p.returncode for p in procs]}):\n{out}"
                )
        return mount.recording()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def record(sc: Scenario, world: int = 2, broken: str | None = None) -> Recording:
    with recording_mount() as mount:
        return run_scenario(sc, mount, world, broken)


# -- judging ---------------------------------------------------------------------------------------


def tmpfs_base() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def commits_before(sc: Scenario, cm: CrashModel, point: int) -> int:
    """How many of the scenario's saves had returned (on some rank) before the crash point."""
    done = 0
    for i in range(len(sc.saves)):
        marks = cm.marks(f"committed{i}-")
        if not marks or point <= min(marks):
            break
        done += 1
    return done


def judge_checkpoint(
    sc: Scenario, done: int, facts: list[dict[str, Any]], state: State, verify: dict[str, Any] | None
) -> list[str]:
    """The problems of one crash state of a Checkpointer scenario (empty: it is fine).

    ``done`` saves had returned before the crash: what they promised (``kept``) must be there;
    the save in flight may be there too, and then what it replaces may be gone."""
    problems: list[str] = []
    for r, f in enumerate(facts):
        problems += [f"rank {r}: {e}" for e in f["errors"]]
        if f["fallback"]:
            problems.append(f"rank {r}: load fell back from a corrupt newest checkpoint")
        for s, ld in f["loads"].items():
            if ld["bad"]:
                problems.append(f"rank {r}: step {s} (gen {ld['gen']}) differs: {', '.join(ld['bad'])}")
    f0 = facts[0]
    present = {int(s): ld["gen"] for s, ld in f0["loads"].items()}
    history = list(sc.pre) + [(s, g) for s, g, _ in sc.saves[:done]]
    promised = kept(history, sc.keep_last)
    inflight = (sc.saves[done][0], sc.saves[done][1]) if done < len(sc.saves) else None
    newest = f0["newest"]
    loaded = (newest, present.get(newest)) if newest is not None else None
    allowed = {(max(promised), promised[max(promised)]) if promised else None}
    if inflight is not None:
        allowed.add(inflight)
    if loaded not in allowed:
        problems.append(f"load gave {loaded} (step, gen); allowed: {sorted(allowed, key=str)}")
    inflight_there = inflight is not None and present.get(inflight[0]) == inflight[1]
    after_inflight = kept([*history, inflight], sc.keep_last) if inflight is not None else promised
    for s, g in promised.items():
        if present.get(s) == g or (inflight_there and after_inflight.get(s) != g):
            continue
        problems.append(f"step {s} (gen {g}) is lost, though committed and kept when the crash came")
    for s, g in present.items():
        if (s, g) not in sc.known:
            problems.append(f"step {s} holds gen {g}, which no save wrote at that step")
    latest = state.files.get(f"{ROOT_NAME}/latest")
    if latest is not None:
        try:
            target = json.loads(latest)["dir"]
        except (ValueError, KeyError, TypeError):
            problems.append(f"latest is unreadable: {latest[:60]!r}")
        else:
            if f"{ROOT_NAME}/{target}/MANIFEST.json" not in state.files:
                problems.append(f"latest points to {target}, which is not a committed checkpoint")
    if verify is not None:
        checked = {c["step"]: c["intact"] for c in verify.get("checked", [])}
        steps = set(f0["steps"] or [])
        if set(checked) != steps:
            problems.append(f"verify checked steps {sorted(checked)}, load sees {sorted(steps)}")
        for s, intact in checked.items():
            loaded_ok = s in present and not any(f["loads"].get(s, {}).get("bad") for f in facts)
            if intact != loaded_ok:
                problems.append(f"verify says step {s} intact={intact}, load says {loaded_ok}")
    return problems


def judge_file(sc: Scenario, done: int, root: str) -> list[str]:
    from ckptguard import load_file

    from tests.support.beds.powerloss.content import file_object_differences

    path = os.path.join(root, *FRESH_SUBDIRS, "model.pt") if sc.fresh_dir else os.path.join(root, "model.pt")
    if not done and not sc.pre and not os.path.lexists(path):
        return []  # before save_file returned, no file at all is fine when there was none
    try:
        obj = load_file(path)
    except Exception as e:
        why = "save_file returned" if done else "the old file must survive until the new one is in"
        return [f"load_file raised {type(e).__name__}: {e} ({why})"]
    gen = int(obj["gen"][0]) if isinstance(obj, dict) and "gen" in obj else None
    allowed = {sc.saves[0][1]} if done or not sc.pre else {sc.saves[0][1], sc.pre[0][1]}
    if gen not in allowed:
        return [f"load_file gave gen {gen}, allowed {sorted(allowed)}"]
    bad = file_object_differences(obj, gen)
    return [f"load_file returned gen {gen} with wrong bytes: {bad}"] if bad else []


def run_verify(root: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": _src_dir()}
    p = subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", "verify", root, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if p.returncode not in (0, 1):
        return {"checked": [], "error": p.stderr[-2000:]}
    return json.loads(p.stdout)


def check_state(
    sc: Scenario, cm: CrashModel, choice: Choice, checker: Checker | None, base: str, do_verify: bool
) -> tuple[State, list[str]]:
    state = cm.build(choice)
    return state, check_built(sc, cm, state, checker, base, do_verify)


def check_built(
    sc: Scenario, cm: CrashModel, state: State, checker: Checker | None, base: str, do_verify: bool
) -> list[str]:
    done = commits_before(sc, cm, state.choice.point)
    dest = tempfile.mkdtemp(prefix="state-", dir=base)
    try:
        state.write(dest)
        root = os.path.join(dest, ROOT_NAME)
        if not os.path.isdir(root):
            if done or sc.pre:
                return [f"the checkpoint root {ROOT_NAME}/ itself is gone"]
            return []  # nothing was promised yet, and nothing is there
        if sc.kind == "file":
            return judge_file(sc, done, root)
        assert checker is not None
        facts = checker.check(root, files=sc.files)
        verify = run_verify(root) if do_verify else None
        if verify is not None and verify.get("error"):
            return [f"ckptguard verify failed: {verify['error']}"]
        return judge_checkpoint(sc, done, facts, state, verify)
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def explore(
    sc: Scenario,
    rec: Recording,
    model: str,
    budget: int,
    checker: Checker | None,
    *,
    seed: int = 1,
    verify_every: int = 20,
    patience: int = 3000,
    stop_at_first: bool = False,
) -> Result:
    cm = CrashModel(rec)
    res = Result(sc.name, model, len(rec.ops), rec.counts())
    started = time.monotonic()
    seen: set[str] = set()  # content hash : saves returned before the crash point
    dupes = 0
    base = tempfile.mkdtemp(prefix="ckptguard-plstates-", dir=tmpfs_base())
    try:
        for choice in cm.candidates(model, seed):
            if res.states >= budget or dupes >= patience:
                break
            res.candidates += 1
            state = cm.build(choice)
            # The same disk content is fine before a save returned and a violation after it:
            # distinct means distinct content *and* a different number of saves returned.
            key = f"{state.digest}:{commits_before(sc, cm, choice.point)}"
            if key in seen:
                dupes += 1
                continue
            dupes = 0
            seen.add(key)
            res.states += 1
            do_verify = sc.kind == "checkpoint" and verify_every > 0 and res.states % verify_every == 1
            res.verified += do_verify
            problems = check_built(sc, cm, state, checker, base, do_verify)
            if problems:
                res.violations.append(Violation(sc.name, choice, problems))
                if stop_at_first:
                    break
    finally:
        shutil.rmtree(base, ignore_errors=True)
    res.seconds = time.monotonic() - started
    return res


# -- command line ----------------------------------------------------------------------------------


def run(
    scenarios: list[str],
    models: list[str],
    budget: int,
    world: int,
    seed: int,
    verify_every: int,
    broken: str | None = None,
    log: Any = print,
) -> list[Result]:
    results: list[Result] = []
    checkers: dict[int, Checker] = {}
    try:
        for name in scenarios:
            sc = SCENARIOS[name]
            t = time.monotonic()
            rec = record(sc, world, broken)
            log(f"{name}: recorded {len(rec.ops)} operations {rec.counts()} in {time.monotonic() - t:.1f} s")
            checker = None
            if sc.kind == "checkpoint":
                checker = checkers.get(world) or checkers.setdefault(world, Checker(world))
            for model in models:
                r = explore(sc, rec, model, budget, checker, seed=seed, verify_every=verify_every)
                results.append(r)
                log(
                    f"  model {model}: {r.states} states ({r.candidates} candidates), {r.verified} verify runs, "
                    f"{len(r.violations)} violations, {r.seconds:.1f} s"
                )
                for v in r.violations[:5]:
                    log(f"    VIOLATION {v.describe()}")
    finally:
        for c in checkers.values():
            c.close()
    return results


def table(results: list[Result]) -> str:
    lines = [
        "| scenario | model | operations recorded | crash states explored | verify runs | violations | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.scenario} | {r.model} | {r.ops} | {r.states} | {r.verified} | {len(r.violations)} | "
            f"{r.seconds:.0f} |"
        )
    total = sum(r.states for r in results)
    lines.append(
        f"| total | | | {total} | {sum(r.verified for r in results)} | "
        f"{sum(len(r.violations) for r in results)} | {sum(r.seconds for r in results):.0f} |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated (default: all)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--states", type=int, default=100, help="distinct crash states per scenario and model")
    ap.add_argument("--world", type=int, default=2, help="ranks (2-4)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--verify-every", type=int, default=20)
    ap.add_argument("--broken", choices=["no_dir_fsync", "no_file_fsync"], default=None)
    ap.add_argument("--json", dest="json_out", default=None)
    a = ap.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so that mounts are unmounted and checker ranks stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t = time.monotonic()
    results = run(a.scenarios.split(","), a.models.split(","), a.states, a.world, a.seed, a.verify_every, a.broken)
    print(table(results))
    print(f"wall time {time.monotonic() - t:.0f} s")
    if a.json_out:
        Path(a.json_out).write_text(
            json.dumps(
                {
                    "args": vars(a),
                    "results": [r.row() for r in results],
                    "violations": [
                        {
                            **asdict(v.choice),
                            "persisted": sorted(v.choice.persisted),
                            "scenario": v.scenario,
                            "problems": v.problems,
                        }
                        for r in results
                        for v in r.violations
                    ],
                },
                indent=1,
            )
        )
    return 1 if any(r.violations for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
