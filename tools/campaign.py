#!/usr/bin/env python
"""Crash-consistency campaign: real multi-process torchrun jobs, injected faults, checks after restart.

    python tools/campaign.py --trials 5                      # every kind, 5 trials each
    python tools/campaign.py --trials 20 --trials corruption=400 --json out.json
    python tools/campaign.py --kinds kill_phase,kill_random --trials 30
    python tools/campaign.py --kinds kill_overwrite,stop --trials 50 --results docs/campaign/results.jsonl
    python tools/campaign.py --report --results docs/campaign/results.jsonl [--write-docs docs/crash-consistency.md]

With ``--results FILE`` every trial appends one JSON record to FILE (kind, variant, seed, fault,
outcome, torn/lost, seconds, commit): a run can stop at any moment and a later run continues the
count. Without ``--seed``, the seed is ``--base-seed`` plus the number of runs already in the file,
so a resumed run never repeats the trials of an earlier one. ``--report`` prints the cumulative
table of the file (``--write-docs`` also puts it between the markers of a Markdown file).

The command line only: the engine (fault kinds, checks, report) is tests/support/campaign.py,
shared with tests/crash/test_campaign.py. It prints a table and can write JSON.
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
from typing import Any

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


BEGIN, END = "<!-- campaign-results:begin -->", "<!-- campaign-results:end -->"


def load_results(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill of the campaign itself
    return out


def load_excluded(results: Path) -> dict[str, str]:
    """Runs whose checks were wrong (a bug of the campaign, not of ckptguard), run id -> why, from
    ``excluded-runs.json`` beside the results file. Their records stay in the file; the report lists
    them under the totals instead of counting them."""
    path = results.with_name("excluded-runs.json")
    return json.loads(path.read_text()) if path.exists() else {}


#: The signal of the first round's kinds, whose records before 2026-11-30 22:30 UTC do not name it.
IMPLIED_SIGNAL = {
    "kill_phase": "kill",
    "kill_random": "kill",
    "kill_load": "kill",
    "stale_cache": "kill",
    "takeover": "stop",
}


def _signal(r: dict[str, Any]) -> str:
    return r.get("signal") or (IMPLIED_SIGNAL.get(r["kind"], "") if r["injected"] else "")


def cumulative_table(records: list[dict[str, Any]], excluded: dict[str, str] | None = None) -> str:
    """The table of every trial in the results file, by kind and variant, with the totals."""
    excluded = excluded or {}
    left_out = [r for r in records if r["run"] in excluded]
    records = [r for r in records if r["run"] not in excluded]
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for r in records:
        row = rows.setdefault(
            (r["kind"], r["variant"]),
            dict.fromkeys(("trials", "faults", "kills", "stops", "failures", "torn", "lost", "seconds"), 0),
        )
        row["trials"] += 1
        row["faults"] += r["injected"]
        row["kills"] += int(_signal(r) == "kill")
        row["stops"] += int(_signal(r) == "stop")
        row["failures"] += int(r["outcome"] != "ok")
        row["torn"] += r["torn"]
        row["lost"] += r["lost"]
        row["seconds"] += r["seconds"]
    order = {k: i for i, k in enumerate(KINDS)}
    keys = sorted(rows, key=lambda k: (order.get(k[0], len(order)), k[1]))
    cols = ("trials", "faults", "kills", "stops", "failures", "torn", "lost", "seconds")
    lines = [
        "| kind | variant | trials | faults | SIGKILL | SIGSTOP | failures | torn loads | lost ckpts | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k in keys:
        row = rows[k]
        lines.append(f"| {k[0]} | {k[1]} | " + " | ".join(f"{row[c]:.0f}" for c in cols) + " |")

    def total(kinds: set[str] | None) -> dict[str, float]:
        sel = [rows[k] for k in keys if kinds is None or k[0] in kinds]
        return {c: sum(r[c] for r in sel) for c in cols}

    lifecycle = total(set(campaign.LIFECYCLE_KINDS))
    everything = total(None)
    lines.append("| **lifecycle kinds** | | " + " | ".join(f"{lifecycle[c]:.0f}" for c in cols) + " |")
    lines.append("| **TOTAL** | | " + " | ".join(f"{everything[c]:.0f}" for c in cols) + " |")
    runs = sorted({r["run"] for r in records})
    commits = sorted({r["commit"] for r in records if r.get("commit")})
    lines.append("")
    lines.append("| commit | first trial | trials | SIGKILL + SIGSTOP | failures | torn | lost |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    by_commit: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_commit.setdefault(r.get("commit") or "?", []).append(r)
    for commit, rs in sorted(by_commit.items(), key=lambda kv: min(r["time"] for r in kv[1])):
        first = time.strftime("%Y-%m-%d %H:%M", time.gmtime(min(r["time"] for r in rs)))
        lines.append(
            f"| {commit} | {first} UTC | {len(rs)} | {sum(_signal(r) in ('kill', 'stop') for r in rs)} | "
            f"{sum(r['outcome'] != 'ok' for r in rs)} | {sum(r['torn'] for r in rs)} | "
            f"{sum(r['lost'] for r in rs)} |"
        )
    lines.append("")
    lines.append(
        f"{len(records)} trials in {len(runs)} run(s), commits {', '.join(commits) or '?'}; "
        f"{everything['faults']:.0f} injected faults, {everything['kills'] + everything['stops']:.0f} of them "
        f"SIGKILLs/SIGSTOPs, {lifecycle['kills'] + lifecycle['stops']:.0f} of these in the lifecycle kinds; "
        f"{everything['failures']:.0f} failures, "
        f"{everything['torn']:.0f} torn, {everything['lost']:.0f} lost."
    )
    for run, why in excluded.items():
        rs = [r for r in left_out if r["run"] == run]
        lines.append("")
        lines.append(
            f"Not counted above: run {run} ({len(rs)} trials, "
            f"{sum(r['injected'] for r in rs)} injected faults, "
            f"{sum(r['outcome'] != 'ok' for r in rs)} failures, {sum(r['torn'] for r in rs)} torn, "
            f"{sum(r['lost'] for r in rs)} lost): {why}"
        )
    return "\n".join(lines)


def write_docs(doc: Path, table: str) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, epilog=campaign.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--trials",
        action="append",
        default=[],
        help="N (every selected kind) or KIND=N; repeatable. Default: 3 per kind.",
    )
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds to run")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: time-based, printed)")
    p.add_argument("--json", dest="json_out", default=None, help="write the report as JSON here")
    p.add_argument("--workdir", default=None, help="keep roots and logs here (default: a temp dir, removed)")
    p.add_argument(
        "--yield-to",
        default=None,
        metavar="SCRIPT",
        help="pause before each job while a process runs SCRIPT (e.g. bench_checkpoint)",
    )
    p.add_argument(
        "--results",
        default=None,
        metavar="FILE",
        help="append one JSON record per trial to FILE (resumable; see --report)",
    )
    p.add_argument(
        "--base-seed",
        type=int,
        default=20261210,
        help="with --results and no --seed: seed = base + runs already in the file",
    )
    p.add_argument("--report", action="store_true", help="print the cumulative table of --results and exit")
    p.add_argument(
        "--write-docs",
        default=None,
        metavar="MD",
        help="with --report: put the table between the campaign-results markers of MD",
    )
    args = p.parse_args(argv)
    if args.report:
        if not args.results:
            p.error("--report needs --results FILE")
        table = cumulative_table(load_results(Path(args.results)), load_excluded(Path(args.results)))
        print(table)
        if args.write_docs:
            write_docs(Path(args.write_docs), table)
        return 0
    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        if k not in KINDS:
            p.error(f"unknown kind {k!r}; known: {', '.join(KINDS)}")
    plan = parse_plan(args.trials or ["3"], kinds)
    results = Path(args.results).resolve() if args.results else None
    if args.seed is not None:
        seed = args.seed
    elif results is not None:
        earlier = load_results(results)
        seed = args.base_seed + len({r["run"] for r in earlier})
        print(f"campaign: {len(earlier)} trials already in {results}", flush=True)
    else:
        seed = int(time.time())
    print(f"campaign: seed {seed}, plan {plan}", flush=True)
    with _workdir(args.workdir) as wd:
        c = Campaign(wd, seed, log=lambda s: print(s, flush=True), yield_to=args.yield_to, results=results)
        report = c.run(plan)
    print()
    print(report.table())
    for prob in report.problems[:50]:
        print("PROBLEM", prob)
    if args.json_out:
        doc = {
            "seed": seed,
            "plan": plan,
            "command": " ".join(["python", "tools/campaign.py", *(argv or sys.argv[1:])]),
            **report.to_json(),
        }
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if report.total("failures") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
