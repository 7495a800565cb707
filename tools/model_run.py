#!/usr/bin/env python
"""The long run of the model-based test (tests/support/model/): fresh seeds, resumable rounds.

    python tools/model_run.py --backend posix --actions 20000            # rounds until 20,000 steps
    python tools/model_run.py --backend s3 --actions 20000 --seed 7100   # from seed 7100 on
    python tools/model_run.py --report                                   # cumulative figures

Each round is one hypothesis run of the state machine (``--examples`` examples of up to
``--steps`` steps) with its own seed; it appends one JSON record to ``--results`` (default
docs/campaign/model-results.jsonl): backend, seed, commit, steps, operations, kills, stalls,
takeovers, faults, seconds, outcome. A run stops at any moment and the next continues the count:
without ``--seed`` the seed is the base seed plus the number of rounds already recorded for the
backend, so a resumed run never repeats one. A violation is recorded with hypothesis's shrunk
counterexample, printed as a ready-to-paste regression test for tests/crash/test_model_based.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BASE_SEED = {"posix": 20_000_000, "s3": 30_000_000}
RESULTS = REPO / "docs" / "campaign" / "model-results.jsonl"


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def regression_test(backend: str, seed: int, steps: list[str], violation: str) -> str:
    """A pytest function replaying the shrunk steps, with an audit after each (as the machine does)."""
    machine = {"posix": "PosixModelMachine", "s3": "S3ModelMachine"}[backend]
    fixture = "s3: S3Bed, " if backend == "s3" else ""
    make = "S3Backend(tmp_path, s3)" if backend == "s3" else "Backend(tmp_path)"
    body = []
    for line in steps:
        line = line.strip()
        if not line.startswith("state."):
            continue
        body.append(f"        {line}")
        if line != "state.teardown()" and not line.startswith("state.audit"):
            body.append("        state.audit()")
    if not body or body[-1].strip() != "state.teardown()":
        body.append("        state.teardown()")
    reason = violation.splitlines()[0][:200].replace('"', "'")
    return (
        "\n".join(
            [
                f"# found by tools/model_run.py --backend {backend} --seed {seed}",
                f'# violation: "{reason}"',
                f"def test_model_{backend}_seed_{seed}({fixture}pool: WorkerPool, tmp_path: Path) -> None:",
                f"    with replay({make}, pool):",
                f"        state = {machine}()",
                *[b for b in body if b.strip() != f"state = {machine}()"],
            ]
        )
        + "\n"
    )


@contextlib.contextmanager
def _backend(name: str, workdir: Path, seed: int) -> Iterator[Any]:
    from tests.support.model.drivers import Backend, S3Backend

    if name == "posix":
        yield Backend(workdir)
        return
    from tests.support.beds.s3 import CREDENTIALS, s3_bed

    os.environ.update(CREDENTIALS)
    with s3_bed(seed=seed) as bed:
        yield S3Backend(workdir, bed)


def run_round(backend: Any, pool: Any, seed: int, examples: int, steps: int) -> dict[str, Any]:
    from hypothesis import HealthCheck, settings
    from hypothesis import seed as use_seed
    from hypothesis.reporting import with_reporter
    from hypothesis.stateful import get_state_machine_test

    from tests.support.model.machine import MACHINES, use_harness

    lines: list[object] = []
    t0 = time.monotonic()
    outcome, violation = "ok", ""
    with use_harness(backend, pool) as h:
        test = use_seed(seed)(
            get_state_machine_test(
                MACHINES[backend.name],
                settings=settings(
                    max_examples=examples,
                    stateful_step_count=steps,
                    deadline=None,
                    database=None,
                    print_blob=False,
                    suppress_health_check=list(HealthCheck),
                ),
            )
        )
        try:
            with with_reporter(lines.append):
                test()
        except AssertionError as e:
            outcome, violation = "violation", str(e)
            lines.extend(getattr(e, "__notes__", []))
        except Exception as e:
            outcome, violation = "error", "".join(traceback.format_exception(e))[-4000:]
            lines.extend(getattr(e, "__notes__", []))
    if h.violations and outcome == "error":  # a flaky replay: the violation itself is what counts
        outcome, violation = "violation", "\n".join(h.violations) + "\n\n" + violation
    counts: Counter[str] = h.counts
    rec: dict[str, Any] = {
        "backend": backend.name,
        "seed": seed,
        "commit": _commit(),
        "time": round(time.time(), 1),
        "examples": examples,
        "max_steps": steps,
        "steps": sum(v for k, v in counts.items() if k.startswith("rule:")),
        "operations": counts["actions"],
        "kills": counts["kills"],
        "stalls": counts["stalls"],
        "takeovers": counts["takeovers"],
        "faults": sum(v for k, v in counts.items() if k.startswith("fault:")),
        "audits": counts["audits"],
        "seconds": round(time.monotonic() - t0, 1),
        "outcome": outcome,
        "counts": dict(sorted(counts.items())),
    }
    if outcome != "ok":
        rec["violation"] = violation[:4000]
        steps_text = [ln for chunk in lines for ln in str(chunk).splitlines()]
        if sum(ln.strip().startswith("state.") for ln in steps_text) < 3 and h.traces:
            # hypothesis's replay did not fail again (timing): the steps of the example that did
            steps_text = [f"state = {MACHINES[backend.name].__name__}()", *h.traces[0]]
        rec["counterexample"] = steps_text[-200:]
        rec["regression_test"] = regression_test(backend.name, seed, steps_text, violation)
    return rec


def report(path: Path) -> str:
    recs = _records(path)
    out = [
        f"{'backend':8} {'rounds':>6} {'steps':>7} {'ops':>7} {'kills':>6} {'stalls':>6} {'takeovers':>9} "
        f"{'faults':>6} {'audits':>7} {'violations':>10} {'hours':>6}"
    ]
    for b in ("posix", "s3"):
        rs = [r for r in recs if r["backend"] == b]
        if not rs:
            continue
        out.append(
            f"{b:8} {len(rs):>6} {sum(r['steps'] for r in rs):>7} {sum(r['operations'] for r in rs):>7} "
            f"{sum(r['kills'] for r in rs):>6} {sum(r['stalls'] for r in rs):>6} "
            f"{sum(r['takeovers'] for r in rs):>9} {sum(r['faults'] for r in rs):>6} "
            f"{sum(r['audits'] for r in rs):>7} {sum(r['outcome'] != 'ok' for r in rs):>10} "
            f"{sum(r['seconds'] for r in rs) / 3600:>6.2f}"
        )
    for r in recs:
        if r["outcome"] != "ok":
            out.append(
                f"\n{r['backend']} seed {r['seed']} ({r['outcome']}, commit {r['commit']}): "
                f"{r['violation'].splitlines()[0][:300]}"
            )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["posix", "s3"])
    ap.add_argument("--actions", type=int, default=20_000, help="stop once this many steps are recorded")
    ap.add_argument("--seed", type=int, help="first seed (default: base seed + rounds already recorded)")
    ap.add_argument("--examples", type=int, default=10, help="hypothesis examples per round")
    ap.add_argument("--steps", type=int, default=40, help="steps per example at most")
    ap.add_argument("--rounds", type=int, help="stop after this many rounds")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--report", action="store_true")
    args = ap.parse_args()
    if args.report:
        print(report(args.results))
        return
    if args.backend is None:
        ap.error("--backend is required (or --report)")
    # SIGTERM unwinds like Ctrl-C: the machine's teardown resumes and closes its workers, the bed stops.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    from tests.support.model.drivers import WorkerPool

    done = [r for r in _records(args.results) if r["backend"] == args.backend]
    total = sum(r["steps"] for r in done)
    seed = args.seed if args.seed is not None else BASE_SEED[args.backend] + len(done)
    rounds = 0
    with tempfile.TemporaryDirectory(prefix="model-run-") as tmp:
        workdir = Path(tmp)
        pool = WorkerPool(workdir)
        try:
            with _backend(args.backend, workdir, seed) as backend:
                while total < args.actions and (args.rounds is None or rounds < args.rounds):
                    rec = run_round(backend, pool, seed, args.examples, args.steps)
                    args.results.parent.mkdir(parents=True, exist_ok=True)
                    with open(args.results, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    total += rec["steps"]
                    rounds += 1
                    print(
                        f"[{args.backend}] seed {seed}: {rec['outcome']}, {rec['steps']} steps "
                        f"({rec['operations']} operations, {rec['kills']} kills, {rec['stalls']} stalls, "
                        f"{rec['takeovers']} takeovers, {rec['faults']} faults) in {rec['seconds']} s; "
                        f"total {total}",
                        flush=True,
                    )
                    if rec["outcome"] != "ok":
                        print(rec["violation"][:3000], "\n\nregression test:\n\n" + rec["regression_test"], flush=True)
                    seed += 1
        finally:
            pool.close()


if __name__ == "__main__":
    main()
