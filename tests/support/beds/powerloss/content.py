"""What a scenario saves, as a pure function of (step, gen, rank), and the bitwise comparison.

``gen`` tells two saves of one step apart (``overwrite=True``); it is stored in the
checkpoint itself, so a checker can tell which save it loaded and recompute the rest.
Sizes are small but span several 4 KiB blocks, so a torn block is visible.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ckptguard import PerRank


def _gen(step: int, gen: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(step * 1_000_003 + gen * 1009 + salt)


def make_state(step: int, gen: int, rank: int) -> dict[str, Any]:
    g = _gen(step, gen)
    model = nn.Linear(32, 16)
    with torch.no_grad():
        model.weight.copy_(torch.randn(16, 32, generator=g))
        model.bias.copy_(torch.randn(16, generator=g))
    mine = torch.randint(0, 256, (300 + 700 * rank,), generator=_gen(step, gen, 7 + rank), dtype=torch.uint8)
    return {
        "model": model,
        "big": torch.randn(2500, generator=g),  # 10 KB: three 4 KiB blocks
        "half": torch.randn(300, generator=g).to(torch.bfloat16),
        "ints": torch.randint(-(2**40), 2**40, (64,), generator=g),
        "gen": torch.tensor([step, gen]),
        "meta": {"step": step, "gen": gen, "tag": f"s{step}g{gen}"},
        "mine": PerRank(mine),
    }


def blank_state(rank: int) -> dict[str, Any]:
    """Same structure, other values: what a load must overwrite entirely."""
    s = make_state(0, 0, rank)
    with torch.no_grad():
        for p in s["model"].parameters():
            p.zero_()
    for k in ("big", "half", "ints", "gen"):
        s[k] = torch.zeros_like(s[k])
    s["meta"] = {"step": -1, "gen": -1, "tag": ""}
    s["mine"] = PerRank(torch.zeros_like(s["mine"].value))
    return s


def loaded_id(state: dict[str, Any]) -> tuple[int, int]:
    step, gen = state["gen"].tolist()
    return int(step), int(gen)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bytes(a.contiguous().view(torch.uint8).numpy()) == bytes(b.contiguous().view(torch.uint8).numpy())
    )


def differences(state: dict[str, Any], step: int, gen: int, rank: int) -> list[str]:
    """Keys whose loaded value differs, bit for bit, from what save (step, gen) wrote."""
    want = make_state(step, gen, rank)
    bad = []
    for name, p in want["model"].state_dict().items():
        if not _same(state["model"].state_dict()[name], p):
            bad.append(f"model.{name}")
    for k in ("big", "half", "ints", "gen"):
        if not _same(state[k], want[k]):
            bad.append(k)
    if state["meta"] != want["meta"]:
        bad.append("meta")
    if not _same(state["mine"].value, want["mine"].value):
        bad.append("mine")
    return bad


def artifact_files(step: int, gen: int, rank: int) -> dict[str, bytes]:
    """The files= directory of one rank: nested, so per-key and per-directory entries matter."""
    g = _gen(step, gen, 100 + rank)
    rnd = bytes(torch.randint(0, 256, (6000,), generator=g, dtype=torch.uint8).tolist())
    return {
        "a.bin": rnd,
        "sub/b.bin": rnd[::-1][:700],
        "sub/deep/c.txt": f"step {step} gen {gen} rank {rank}\n".encode(),
    }


def write_tree(base: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        p = os.path.join(base, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)


def read_tree(base: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(base):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, base)] = f.read()
    return out


def file_object(gen: int) -> dict[str, Any]:
    """What the save_file scenario saves (gen 1 before, gen 2 replacing it)."""
    g = _gen(99, gen)
    return {"gen": torch.tensor([gen]), "w": torch.randn(3000, generator=g), "b": torch.randn(40, generator=g)}


def file_object_differences(obj: Any, gen: int) -> list[str]:
    want = file_object(gen)
    if not isinstance(obj, dict) or set(obj) != set(want):
        return ["structure"]
    return [k for k in want if not _same(obj[k], want[k])]
