"""The random number generators' states of this process, to save per rank and restore on resume.

    ck.save(step, {"model": model, "rng": PerRank(ckptguard.rng_state())})
    holder = PerRank(ckptguard.rng_state()); ck.load({"model": model, "rng": holder})
    ckptguard.set_rng_state(holder.value)          # or: ckptguard.set_rng_state(ck.read()["rng"])

or, as one Stateful object: ``{"rng": PerRank(ckptguard.RNGState())}`` (saved and restored
by save and load themselves). Covers torch (CPU, and every CUDA device when CUDA is
initialised), numpy's global generator and Python's ``random``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """A snapshot of torch's, numpy's and Python's global RNG states (a plain dict save round-trips)."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state()`` returned (keys it lacks are left alone)."""
    if not isinstance(state, dict):
        raise TypeError(f"set_rng_state takes the dict rng_state() returned, not {type(state).__name__}")
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "python" in state:
        random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RNGState:
    """The global RNG states as a Stateful: saved with ``state_dict()``, restored by ``load_state_dict()``."""

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state)
