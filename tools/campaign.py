#!/usr/bin/env python
"""Crash-consistency campaign: real multi-process torchrun jobs, injected faults, checks after restart.

    python tools/campaign.py --trials 5                      # every kind, 5 trials each
    python tools/campaign.py --trials 20 --trials corruption=400 --json out.json
    python tools/campaign.py --kinds kill_phase,kill_random --trials 30

The command line only: the engine (fault kinds, checks, report) is tests/support/campaign.py,
shared with tests/test_campaign.py. It prints a table and can write JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# The one path this script adds: the repository root, so that `tests.support` imports (tools may
# depend on tests/support, never the reverse; see tests/support/__init__.py).
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support import campaign  # noqa: E402
from tests.support.campaign import KINDS, Campaign  # noqa: E402


def parse_plan(specs: list[str], kinds: list[str]) -> dict[str, int]:
    plan = dict.fromkeys(kinds, 0)
    for spec in specs:
        if "=" in spec:
            k, v = spec.split("=", 1)
            if k not in KINDS:
                raise SystemExit(f"unknown kind {k!r}; known: {', '.join(KINDS)}")
            plan[k] = int(v)
        else:
            for k in kinds:
                plan[k] = int(spec)
    return {k: v for k, v in plan.items() if v > 0}


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        yield p
        return
    tmp = Path(tempfile.mkdtemp(prefix="ckptguard-campaign-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, epilog=campaign.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", action="append", default=[],
                   help="N (every selected kind) or KIND=N; repeatable. Default: 3 per kind.")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds to run")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: time-based, printed)")
    p.add_argument("--json", dest="json_out", default=None, help="write the report as JSON here")
    p.add_argument("--workdir", default=None, help="keep roots and logs here (default: a temp dir, removed)")
    p.add_argument("--yield-to", default=None, metavar="SCRIPT",
                   help="pause before each job while a process runs SCRIPT (e.g. bench_checkpoint)")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        if k not in KINDS:
            p.error(f"unknown kind {k!r}; known: {', '.join(KINDS)}")
    plan = parse_plan(args.trials or ["3"], kinds)
    seed = args.seed if args.seed is not None else int(time.time())
    print(f"campaign: seed {seed}, plan {plan}", flush=True)
    with _workdir(args.workdir) as wd:
        c = Campaign(wd, seed, log=lambda s: print(s, flush=True), yield_to=args.yield_to)
        report = c.run(plan)
    print()
    print(report.table())
    for prob in report.problems[:50]:
        print("PROBLEM", prob)
    if args.json_out:
        doc = {"seed": seed, "plan": plan, "command": " ".join(["python", "tools/campaign.py", *(argv or sys.argv[1:])]),
               **report.to_json()}
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if report.total("failures") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
