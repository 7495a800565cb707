"""Assign every log of this corpus to the ``dev`` or the ``sealed`` split, deterministically.

    python tests/diagnose/corpus/split.py          # writes split.json and sealed.sha256
    python tests/diagnose/corpus/split.py --check  # exits 1 if either file is out of date

A log is sealed when the first 8 hex digits of sha256(source) are 0 modulo 3 (about a third); the
rule depends only on the thread's source string, so adding logs never moves an existing one.
``sealed.sha256`` lists the sha256 of every sealed log file (``sha256sum`` format): the sealed logs
are scored, never read while writing diagnosis rules, and their hash file proves they did not change.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RULE = "sealed iff int(sha256(source).hexdigest()[:8], 16) % 3 == 0"


def part_of(source: str) -> str:
    """The split a thread's logs belong to."""
    return "sealed" if int(hashlib.sha256(source.encode()).hexdigest()[:8], 16) % 3 == 0 else "dev"


def build(here: Path = HERE) -> tuple[str, str]:
    """The text of split.json and of sealed.sha256 for the corpus in ``here``."""
    rows = [json.loads(x) for x in (here / "labels.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]
    files = {r["file"]: part_of(r["source"]) for r in rows}
    split = json.dumps({"rule": RULE, "files": files}, indent=1, sort_keys=True) + "\n"
    sealed = "".join(
        f"{hashlib.sha256((here / f).read_bytes()).hexdigest()}  {f}\n" for f in sorted(files) if files[f] == "sealed"
    )
    return split, sealed


def main(argv: list[str]) -> int:
    split, sealed = build()
    if "--check" in argv:
        ok = (HERE / "split.json").read_text(encoding="utf-8") == split and (HERE / "sealed.sha256").read_text(
            encoding="utf-8"
        ) == sealed
        print("split up to date" if ok else "split.json or sealed.sha256 is out of date")
        return 0 if ok else 1
    (HERE / "split.json").write_text(split, encoding="utf-8")
    (HERE / "sealed.sha256").write_text(sealed, encoding="utf-8")
    n_sealed = sealed.count("\n")
    print(
        f"{len(json.loads(split)['files'])} logs: {n_sealed} sealed; "
        f"sha256(sealed.sha256) = {hashlib.sha256(sealed.encode()).hexdigest()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
