"""Counts of this corpus: per class, per project, per launcher, per split.

python tests/diagnose/corpus/stats.py
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent


def table(title: str, counts: Counter[str], total: int) -> str:
    """A markdown table of counts, largest first, with each value's share of ``total``."""
    lines = [f"## {title} ({len(counts)})", "", "| value | logs | share |", "| --- | --- | --- |"]
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    lines += [f"| {k} | {n} | {100 * n / total:.1f} % |" for k, n in ordered]
    return "\n".join(lines)


def main() -> None:
    """Print the corpus' totals and its per-class, per-launcher, per-project and per-licence tables."""
    rows = [json.loads(x) for x in (HERE / "labels.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]
    split_file = HERE / "split.json"
    split = json.loads(split_file.read_text(encoding="utf-8"))["files"] if split_file.is_file() else {}
    n = len(rows)
    print(
        f"{n} logs from {len({r['project'] for r in rows})} projects; "
        f"class scored {sum(r['score_class'] for r in rows)}, "
        f"first rank labelled {sum(r['initiating_rank'] is not None for r in rows)}, "
        f"rank scored {sum(r['score_rank'] for r in rows)}; "
        f"dev {sum(v == 'dev' for v in split.values())}, sealed {sum(v == 'sealed' for v in split.values())}\n"
    )
    print(table("per class", Counter(r["failure_class"] for r in rows), n), "\n")
    print(table("per launcher", Counter(r["launcher"] for r in rows), n), "\n")
    print(table("per project", Counter(r["project"] for r in rows), n), "\n")
    print(table("per licence", Counter(r["licence"] for r in rows), n))


if __name__ == "__main__":
    main()
