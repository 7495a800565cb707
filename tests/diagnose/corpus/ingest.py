"""Add hand-copied crash logs and their labels to this corpus.

    PYTHONPATH=src python tests/diagnose/corpus/ingest.py BATCH_FILE [...]

A batch file holds entries separated by lines starting with ``@@@@ SLUG``; each entry is a block of
``key: value`` header lines, a line ``---``, then the log exactly as it was pasted (cuts marked
with a line ``[...]``). Header keys: ``src`` (thread URL), ``cls``, ``rank`` (int or ``null``),
``coll`` (comma-separated ranks), ``launch``, ``sc``/``sr`` (0/1: score class / rank; default 1,
rank score 0 when rank is null), ``root``, ``fix``, ``ev`` (repeatable), ``notes``, ``lic``,
``mask`` (``real=host1, other=host2``: replaced in the log and the evidence).

Each entry is refused unless: its source passes ``is_excluded`` (../shared/corpus/excluded.py), it
is not a thread already in this corpus or in ../shared/corpus/diagnose-dev*, its class is a
knowledge-base class, and every evidence line is a substring of the masked log. Masking is applied
to the log and the evidence alike: user names in home paths -> ``user``, public IPv4 addresses ->
``10.0.0.N`` (one number per address within a log), e-mail addresses -> ``user@example.com``,
Hugging Face / GitHub / W&B style tokens -> ``***``.
"""

from __future__ import annotations

import ipaddress
import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
KB = REPO / "src" / "ckptguard" / "diagnose" / "kb"
SHARED = next(
    (p for p in (REPO.parent / "shared" / "corpus", Path("/work/shared/corpus")) if p.is_dir()),
    REPO.parent / "shared" / "corpus",
)
LABELS = HERE / "labels.jsonl"

sys.path.insert(0, str(SHARED))
from excluded import is_excluded  # type: ignore[import-not-found]  # noqa: E402

KEEP_USERS = {"user", "root", "ubuntu", "runner", "admin", "jovyan", "<user>", "username", "ec2-user"}
LICENCES = {
    "pytorch/pytorch": "BSD-3-Clause",
    "huggingface/transformers": "Apache-2.0",
    "huggingface/accelerate": "Apache-2.0",
    "huggingface/trl": "Apache-2.0",
    "huggingface/peft": "Apache-2.0",
    "microsoft/DeepSpeed": "Apache-2.0",
    "deepspeedai/DeepSpeed": "Apache-2.0",
    "Lightning-AI/pytorch-lightning": "Apache-2.0",
    "Lightning-AI/lightning": "Apache-2.0",
    "NVIDIA/Megatron-LM": "BSD-3-Clause",
    "NVIDIA/NeMo": "Apache-2.0",
    "open-mmlab/mmengine": "Apache-2.0",
    "open-mmlab/mmdetection": "Apache-2.0",
    "facebookresearch/detectron2": "Apache-2.0",
    "hpcaitech/ColossalAI": "Apache-2.0",
    "volcengine/verl": "Apache-2.0",
    "hiyouga/LLaMA-Factory": "Apache-2.0",
    "modelscope/ms-swift": "Apache-2.0",
    "meta-llama/llama": "custom (Llama 2 Community License)",
    "OpenBMB/MiniCPM-V": "Apache-2.0",
    "NVIDIA/nccl": "BSD-3-Clause",
    "ultralytics/ultralytics": "AGPL-3.0",
    "facebookresearch/fairseq": "MIT",
    "open-mmlab/mmsegmentation": "Apache-2.0",
    "pytorch/torchtitan": "BSD-3-Clause",
    "pytorch/torchtune": "BSD-3-Clause",
    "huggingface/diffusers": "Apache-2.0",
    "EleutherAI/gpt-neox": "Apache-2.0",
    "THUDM/ChatGLM-6B": "Apache-2.0",
    "haotian-liu/LLaVA": "Apache-2.0",
    "tloen/alpaca-lora": "Apache-2.0",
    "tatsu-lab/stanford_alpaca": "Apache-2.0",
    "OpenRLHF/OpenRLHF": "Apache-2.0",
    "Dao-AILab/flash-attention": "BSD-3-Clause",
    "QwenLM/Qwen": "unknown",
    "mosaicml/composer": "Apache-2.0",
    "mosaicml/llm-foundry": "Apache-2.0",
    "ultralytics/yolov5": "AGPL-3.0",
    "open-mmlab/mmcv": "Apache-2.0",
    "facebookresearch/dinov2": "Apache-2.0",
}

IPV4 = re.compile(r"(?<![\w.])(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})(?![\w.]*\d)")
EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.(?:com|org|net|edu|cn|io|de|uk|fr|jp|kr|ai)\b")
HOME = re.compile(r"(/home/|/Users/|/users/|C:\\\\Users\\\\|C:\\Users\\|/mnt/home/|/scratch/|/nfs/home/)([^/\\\s'\"]+)")
TOKEN = re.compile(r"\b(hf_[A-Za-z0-9]{20,}|ghp_[A-Za-z0-9]{20,}|[0-9a-f]{40})\b")


def source_of(url: str) -> tuple[str, str]:
    """The corpus' source string and project (owner/repo or the site) for a thread URL."""
    m = re.match(r"https?://github\.com/([^/]+)/([^/]+)/(issues|pull|discussions)/(\d+)", url)
    if m:
        kind = {"issues": "issue", "pull": "pull request", "discussions": "discussion"}[m.group(3)]
        return f"github.com/{m.group(1)}/{m.group(2)} {kind} #{m.group(4)}", f"{m.group(1)}/{m.group(2)}"
    site = re.sub(r"^https?://", "", url).split("/")[0]
    return re.sub(r"^https?://", "", url), site


class Masker:
    """Consistent replacements inside one log (and its evidence)."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self.pairs = pairs
        self.ips: dict[str, str] = {}

    def _ip(self, m: re.Match[str]) -> str:
        s = m.group(0)
        try:
            ip = ipaddress.IPv4Address(s)
        except ValueError:
            return s
        if ip.is_private or ip.is_loopback or ip.is_unspecified or ip.is_multicast or ip.is_reserved:
            return s
        if s not in self.ips:
            self.ips[s] = f"10.0.0.{len(self.ips) + 1}"
        return self.ips[s]

    def __call__(self, text: str) -> str:
        """``text`` with every identifier replaced."""
        for real, fake in self.pairs:
            text = text.replace(real, fake)
        text = HOME.sub(lambda m: m.group(0) if m.group(2).lower() in KEEP_USERS else m.group(1) + "user", text)
        text = EMAIL.sub("user@example.com", text)
        text = TOKEN.sub("***", text)
        return IPV4.sub(self._ip, text)


def parse(batch: str) -> list[dict[str, Any]]:
    """The entries of a batch file: header keys, ``ev`` as a list, and ``log``."""
    out = []
    for chunk in re.split(r"^@@@@ ", batch, flags=re.M)[1:]:
        first, rest = chunk.split("\n", 1)
        head, log = rest.split("\n---\n", 1)
        e: dict[str, Any] = {"slug": first.strip(), "ev": [], "log": log.rstrip("\n") + "\n"}
        for line in head.splitlines():
            if not line.strip():
                continue
            k, v = line.split(":", 1)
            v = v.strip()
            if k == "ev":
                e["ev"].append(v)
            else:
                e[k] = v
        out.append(e)
    return out


def main(paths: list[str]) -> int:
    """Check, mask and add every entry of the batch files; print what was refused and why."""
    classes = {p.stem for p in KB.glob("*.toml") if not p.stem.startswith("_")}
    known = set()
    for lab in SHARED.glob("diagnose-dev*/labels.jsonl"):
        known |= {json.loads(x)["source"] for x in lab.read_text().splitlines() if x.strip()}
    rows = [json.loads(x) for x in LABELS.read_text().splitlines() if x.strip()] if LABELS.exists() else []
    known |= {r["source"] for r in rows}
    n = max((int(Path(r["file"]).name[:4]) for r in rows), default=0)
    added = 0
    for path in paths:
        for e in parse(Path(path).read_text(encoding="utf-8")):
            url = str(e["src"])
            source, project = source_of(url)
            problems = []
            if is_excluded(url) or is_excluded(source):
                problems.append("EXCLUDED source")
            if source in known:
                problems.append("duplicate source")
            if e["cls"] not in classes:
                problems.append(f"unknown class {e['cls']}")
            pairs = [tuple(p.split("=", 1)) for p in str(e.get("mask", "")).split(",") if "=" in p]
            mask = Masker([(a.strip(), b.strip()) for a, b in pairs])
            log = mask(str(e["log"]))
            ev = [mask(x) for x in e["ev"]]
            missing = [x for x in ev if x not in log]
            if missing or not ev:
                problems.append(f"evidence not in log: {missing}")
            if problems:
                print(f"REFUSED {e['slug']}: {'; '.join(problems)}")
                continue
            rank = None if e.get("rank", "null") in ("null", "None", "") else int(str(e["rank"]))
            coll = [int(x) for x in str(e.get("coll", "")).split(",") if x.strip()]
            n += 1
            name = f"logs/{n:04d}-{e['slug']}.log"
            (HERE / name).write_text(log, encoding="utf-8")
            row = {
                "file": name,
                "source": source,
                "failure_class": e["cls"],
                "initiating_rank": rank,
                "collateral_ranks": coll,
                "root_cause": e.get("root", ""),
                "fix": e.get("fix", ""),
                "evidence_lines": ev,
                "notes": e.get("notes", ""),
                "project": project,
                "licence": e.get("lic") or LICENCES.get(project, "unknown"),
                "launcher": e.get("launch", "unknown"),
                "score_class": e.get("sc", "1") == "1",
                "score_rank": rank is not None and e.get("sr", "1") == "1",
            }
            rows.append(row)
            known.add(source)
            added += 1
    LABELS.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"added {added}; corpus now {len(rows)} logs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
