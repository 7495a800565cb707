"""The project's own corpus of real crash logs (tests/diagnose/corpus): its labels are sound, its
split is current, and the diagnosis keeps its measured score on the dev and on the sealed split.

The sealed split is only ever scored: these tests report its figures, never its logs' content.
"""

from __future__ import annotations

import hashlib
import importlib.util
import ipaddress
import json
import os
import re
from functools import cache
from pathlib import Path

import pytest

from .corpus_score import REAL, REPO, Scored, score_split, summary

KB = REPO / "src" / "ckptguard" / "diagnose" / "kb"
KEYS = {
    "file",
    "source",
    "failure_class",
    "initiating_rank",
    "collateral_ranks",
    "root_cause",
    "fix",
    "evidence_lines",
    "notes",
    "project",
    "licence",
    "launcher",
    "score_class",
    "score_rank",
}
# split -> (minimum share of scored rows with the right class, minimum share of scored ranks right),
# a few points under the figures measured with the current rules (dev: class 215/219 = 98.2 %, rank
# 33/33; sealed: class 108/116 = 93.1 %, rank 13/13; one sealed rank miss is 92.3 %)
FLOORS = {"dev": (0.95, 0.93), "sealed": (0.89, 0.88)}
# the list of held-out threads the diagnosis is scored on, kept next to the repository
EXCLUDED = Path(os.environ.get("CKPTGUARD_SHARED_CORPUS", REPO.parent / "shared" / "corpus")) / "excluded.py"
HOME = re.compile(r"(?:/home/|/Users/|C:\\\\Users\\\\|C:\\Users\\)([^/\\\s'\"]+)")
IPV4 = re.compile(r"(?<![\w.])\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}(?![\w.]*\d)")
EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.(?:com|org|net|edu|cn|io|de|uk|fr|jp|kr|ai)\b")


@cache
def rows() -> list[dict[str, object]]:
    text = (REAL / "labels.jsonl").read_text(encoding="utf-8")
    return [json.loads(x) for x in text.splitlines() if x.strip()]


@cache
def scored(part: str) -> list[Scored]:
    return score_split(REAL, part)


def test_every_label_is_complete_and_its_evidence_is_in_its_log() -> None:
    classes = {p.stem for p in KB.glob("*.toml") if not p.stem.startswith("_")}
    logs = {f"logs/{p.name}" for p in (REAL / "logs").glob("*.log")}
    assert len(rows()) >= 50 and {r["file"] for r in rows()} == logs
    assert len({r["source"] for r in rows()}) == len(rows()), "one log per thread"
    for r in rows():
        assert set(r) == KEYS, r["file"]
        assert r["failure_class"] in classes, (r["file"], r["failure_class"])
        text = (REAL / str(r["file"])).read_text(encoding="utf-8")
        evidence = r["evidence_lines"]
        assert isinstance(evidence, list) and evidence, r["file"]
        missing = [e for e in evidence if e not in text]
        assert not missing, (r["file"], missing)
        assert r["initiating_rank"] is not None or not r["score_rank"], r["file"]


def test_logs_carry_no_personal_identifiers() -> None:
    """Home-directory user names, public IP addresses and e-mail addresses are masked in every log."""
    for r in rows():
        text = (REAL / str(r["file"])).read_text(encoding="utf-8")
        users = {u for u in HOME.findall(text)} - {
            "user",
            "root",
            "ubuntu",
            "runner",
            "admin",
            "jovyan",
            "<user>",
            "username",
            "ec2-user",
        }
        assert not users, (r["file"], users)
        public = [ip for ip in IPV4.findall(text) if _public(ip)]
        assert not public, (r["file"], public)
        assert not [m for m in EMAIL.findall(text) if m != "user@example.com"], r["file"]


def _public(ip: str) -> bool:
    try:
        a = ipaddress.IPv4Address(ip)
    except ValueError:
        return False
    return not (a.is_private or a.is_loopback or a.is_unspecified or a.is_multicast or a.is_reserved)


@pytest.mark.skipif(
    not EXCLUDED.is_file(),
    reason=f"{EXCLUDED} is absent: the held-out source list is not here to check the corpus' sources against",
)
def test_no_source_is_a_held_out_thread() -> None:
    spec = importlib.util.spec_from_file_location("excluded", EXCLUDED)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    held_out = [r["file"] for r in rows() if module.is_excluded(str(r["source"]))]
    assert not held_out, held_out


def test_split_covers_every_log_and_the_sealed_hashes_match() -> None:
    split = json.loads((REAL / "split.json").read_text(encoding="utf-8"))["files"]
    assert set(split) == {r["file"] for r in rows()}
    sealed = {f for f, part in split.items() if part == "sealed"}
    assert 0.2 <= len(sealed) / len(split) <= 0.45, len(sealed)
    listed = {}
    for line in (REAL / "sealed.sha256").read_text(encoding="utf-8").splitlines():
        digest, name = line.split(maxsplit=1)
        listed[name] = digest
    assert set(listed) == sealed
    for name, digest in listed.items():
        # the sealed logs are frozen: a change shows here, without printing the log
        assert hashlib.sha256((REAL / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("part", ["dev", "sealed"])
def test_diagnosis_keeps_its_score_on_the_split(part: str) -> None:
    """Class and first-rank accuracy (rows scored for each) stay above the recorded floors."""
    s = summary(scored(part))
    (cls_ok, cls_n), (rank_ok, rank_n) = s["class"], s["rank"]
    floor_cls, floor_rank = FLOORS[part]
    assert cls_n > 0 and cls_ok / cls_n >= floor_cls, f"{part}: class {cls_ok}/{cls_n} under {floor_cls:.0%}"
    assert rank_n > 0 and rank_ok / rank_n >= floor_rank, f"{part}: rank {rank_ok}/{rank_n} under {floor_rank:.0%}"
