"""The knowledge base must describe failures, not the logs it was developed on.

A rule (class signature, context, anchor, launcher format, rank hint, operation, cross-rank rule)
fails this test when it contains a filesystem path, a user name or project name taken from a
corpus log, or a one-off identifier (a pid, a job or commit id, a hex address) that occurs in a
corpus log. Frameworks whose own wording the KB knows (torch, Lightning, DeepSpeed, ...) are not
"project names". Every operation also needs a reworded variant: test_variant_logs.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ckptguard.diagnose.kb import load_kb

from .corpus_score import CORPORA

PRESENT = [c for c in CORPORA if (c / "labels.jsonl").is_file()]
# Frameworks, launchers and libraries whose messages and frames the KB describes on purpose.
FRAMEWORKS = {
    "pytorch",
    "torch",
    "lightning",
    "pytorch_lightning",
    "deepspeed",
    "transformers",
    "accelerate",
    "nccl",
    "gloo",
    "megatron",
    "torchtitan",
    "torchtune",
    "horovod",
    "submitit",
    "safetensors",
    "apex",
    "fairscale",
    "mmengine",
    "detectron2",
    "slurm",
    "ray",
    "tune",
    "huggingface",
    "nvidia",
}
# Plain words that also happen to be parts of a corpus project's name (open-gpu-kernel-modules).
VOCABULARY = {"kernel"}
_ABS_PATH = re.compile(
    r"(?:^|[^\w\\])/(?:home|Users|root|data\d*|mnt|scratch|work|workspace|tmp|opt|usr|srv|cvmfs|"
    r"content|public|environment|gpfs|lustre|nfs|fsx)/|[A-Za-z]:\\\\"
)
_HOME = re.compile(r"/(?:home|Users|scratch|public/home|data\d*|mnt|u)/([A-Za-z][\w.\-]{2,})/")
_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_\-]{3,}")
_ID = re.compile(r"(?<![\w])(?:\d{4,}|(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{6,})(?![\w])")


def rule_texts() -> list[tuple[str, str]]:
    """(where, regex source or literal) of everything in the KB that can decide an answer."""
    kb = load_kb()
    out: list[tuple[str, str]] = []
    for fc in kb.classes.values():
        for s in fc.signatures:
            out.append((f"{fc.id} signature", s.pattern.pattern))
            if s.context is not None:
                out.append((f"{fc.id} context", s.context.pattern))
            if s.anchor:
                out.append((f"{fc.id} anchor", s.anchor))
    r = kb.rules
    out += [(f"launcher {x.name}", x.pattern.pattern) for x in r.launchers]
    if r.silent_exit is not None:
        out += [
            ("silent exit memory", r.silent_exit.memory.pattern),
            ("silent exit deliberate", r.silent_exit.deliberate.pattern),
        ]
    out += [("rank hint", x.pattern.pattern) for x in r.rank_hints]
    out += [("rank report", x.pattern.pattern) for x in r.rank_reports]
    out += [("traceback owner", x.pattern) for x in r.traceback_owners]
    out += [("hint", x.pattern) for x in r.hints]
    out += [
        ("launcher traceback", r.launcher_frames.pattern),
        ("race announce", r.race.announce.pattern),
        ("race same error", r.race.same_error.pattern),
        ("desync", r.desync_pattern.pattern),
    ]
    if r.progress is not None:
        out.append(("desync progress", r.progress.pattern))
    for op in r.operations:
        if op.frames is not None:
            out.append((f"operation {op.name}", op.frames.pattern))
        if op.announce is not None:
            out.append((f"operation {op.name} announce", op.announce.pattern))
        if op.errors is not None:
            out.append((f"operation {op.name} errors", op.errors.pattern))
    return out


def corpus_names() -> tuple[set[str], set[str], str]:
    """User names (from home directories in the logs), project names (from the labels' sources,
    minus the frameworks) and the logs' whole text."""
    users: set[str] = set()
    projects: set[str] = set()
    texts = []
    seen_in: dict[str, int] = {}  # word -> in how many logs it occurs
    for c in PRESENT:
        for raw in (c / "labels.jsonl").read_text(encoding="utf-8").splitlines():
            if raw.strip():
                src = json.loads(raw)["source"]
                m = re.search(r"github\.com/([\w.\-]+)/([\w.\-]+)", src)
                if m:
                    for part in re.split(r"[-_.]", f"{m.group(1)}-{m.group(2)}"):
                        if len(part) >= 4:
                            projects.add(part.lower())
        for log in sorted((c / "logs").glob("*.log")):
            t = log.read_text(encoding="utf-8", errors="replace")
            texts.append(t)
            users |= {u.lower() for u in _HOME.findall(t)}
            for w in {w.lower() for w in _WORD.findall(t)}:
                seen_in[w] = seen_in.get(w, 0) + 1
    # a word that many logs hold ('open', 'time', 'data') is vocabulary, whoever it also names
    common = {w for w, n in seen_in.items() if n > 3}
    known = FRAMEWORKS | VOCABULARY | common
    return users - known, projects - known, "\n".join(texts)


@pytest.mark.skipif(not PRESENT, reason="corpora not found (a clean clone has them in ../shared)")
def test_rules_hold_no_path_name_or_one_off_id() -> None:
    users, projects, text = corpus_names()
    assert users and projects, "the corpora's paths and sources must yield names to check against"
    bad = []
    for where, src in rule_texts():
        if _ABS_PATH.search(src):
            bad.append(f"{where}: a filesystem path in {src!r}")
        words = {w.lower() for w in _WORD.findall(src)}
        for w in sorted(words & (users | projects)):
            bad.append(f"{where}: the user or project name {w!r} in {src!r}")
        for ident in _ID.findall(src):
            if ident in text:
                bad.append(f"{where}: the identifier {ident!r} (from a corpus log) in {src!r}")
    assert not bad, "\n".join(bad)


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+|[a-z]+[A-Z][A-Za-z0-9]+")  # snake_case, camelCase


@pytest.mark.skipif(not PRESENT, reason="corpora not found (a clean clone has them in ../shared)")
def test_no_code_identifier_from_one_log_only() -> None:
    """A function or variable name in a rule that one corpus log holds, and none of the
    project's own fixtures and variants, was copied from that log."""
    here = Path(__file__).parent
    own = "\n".join(
        p.read_text(encoding="utf-8", errors="replace")
        for d in (here / "fixtures", here / "variants")
        for p in d.rglob("*")
        if p.is_file()
    )
    logs = [p.read_text(encoding="utf-8", errors="replace") for c in PRESENT for p in (c / "logs").glob("*.log")]
    bad = []
    for where, src in rule_texts():
        for ident in set(_IDENT.findall(src)):
            if len(ident) >= 6 and ident not in own and sum(ident in t for t in logs) == 1:
                bad.append(f"{where}: {ident!r} occurs in one corpus log and in no fixture or variant")
    assert not bad, "\n".join(sorted(bad))


def test_the_check_catches_what_it_is_for() -> None:
    """The checks above flag a path, a user, a project and an id of a corpus log."""
    users, projects, text = corpus_names() if PRESENT else ({"kyoungrok"}, {"diffusers"}, "pid 29001 at 0x7fad0a5e2cc8")
    assert _ABS_PATH.search(r"FileNotFoundError: .*/home/\w+/ckpt")
    assert {w.lower() for w in _WORD.findall(r"(?i)diffusers|train_unconditional")} & projects
    some_user = sorted(users)[0]
    assert {w.lower() for w in _WORD.findall(rf"/{some_user}/")} & users
    ident = next(i for i in _ID.findall(text))
    assert ident in text
