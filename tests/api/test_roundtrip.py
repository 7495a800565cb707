"""Every value save accepts loads back equal, with or without a template.

Integer and tuple keys, tuples, numpy arrays and scalars, the numpy / Python / torch RNG
states, empty containers, inside plain values and inside PerRank(...); anything else is
refused by save with a message that says what to do. ``read()`` returns the stored state
without a template (what a framework's ``load_checkpoint(path)`` needs).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ckptguard import Checkpointer, CheckpointError, PerRank, UnsupportedValueError


def equal(a: Any, b: Any) -> bool:
    """Deep equality that also checks types (an int key must not come back as a str)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            type(a) is type(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        )
    if isinstance(a, np.generic) or isinstance(b, np.generic):
        return type(a) is type(b) and a.tobytes() == b.tobytes()
    if isinstance(a, dict) and isinstance(b, dict):
        return (
            list(map(repr, a)) == list(map(repr, b))
            and all(type(ka) is type(kb) for ka, kb in zip(a, b, strict=True))
            and all(equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple | set | frozenset):
        if type(a) is not type(b) or len(a) != len(b):
            return False
        if isinstance(a, set | frozenset):
            return a == b
        return all(equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and a != a:
        return b != b
    return type(a) is type(b) and a == b


def values() -> dict[str, Any]:
    random.seed(3)
    np.random.seed(4)
    gen = np.random.default_rng(5)
    return {
        "int_keys": {0: torch.arange(3.0), 1: "one", 10: {2: 2.5}},
        "mixed_keys": {
            0: "int zero",
            "0": "str zero",
            (1, "a"): "tuple key",
            None: 1,
            True: 2,
            1.5: 3,
            "<odd>": 4,
            "a.b": 5,
        },
        "tuples": (1, "x", (2.0, None), torch.ones(2), {"k": (3, 4)}),
        "tuple_with_array": (np.arange(4, dtype=np.int16), 7),
        "arrays": {
            "f64": np.linspace(0, 1, 5),
            "u32": np.arange(6, dtype=np.uint32).reshape(2, 3),
            "bool": np.array([True, False]),
            "f16": np.ones(3, dtype=np.float16),
            "big_endian": np.arange(3, dtype=">i4"),
            "str": np.array(["ab", "c"]),
            "scalar_f": np.float64(2.5),
            "scalar_i": np.int32(-3),
            "zero_d": np.array(1.5),
            "strided": np.arange(10.0)[::2],
            "empty": np.zeros((0, 3)),
        },
        "np_rng": np.random.get_state(),
        "np_generator": gen.bit_generator.state,
        "py_rng": random.getstate(),
        "torch_rng": torch.get_rng_state(),
        "empty": {"d": {}, "l": [], "t": (), "nested": {"e": {}}},
        "scalars": {
            "big": 2**100,
            "neg": -1,
            "nan": float("nan"),
            "inf": float("-inf"),
            "c": 1 + 2j,
            "b": b"\x00\xff",
            "none": None,
            "s": "",
            "dtype": torch.float16,
            "size": torch.Size([2]),
        },
        "sets": {"s": {1, 2, 3}, "fs": frozenset({"a"})},
        "list_mixed": [torch.zeros(2), {3: "x"}, [np.int64(4)], ()],
        "ordered": OrderedDict([("b", 1), ("a", 2)]),
    }


def optimizer_state() -> dict[str, Any]:
    """What Lightning keeps in its checkpoint: optimizer.state_dict() with integer parameter ids."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optim.step()
    return {"state_dict": model.state_dict(), "optimizer_states": [optim.state_dict()], "epoch": 1, "global_step": 1}


@pytest.fixture
def ck(tmp_path: Path) -> Checkpointer:
    c = Checkpointer(tmp_path / "ckpt")
    yield c
    c.close()


@pytest.mark.parametrize("blocking", [True, False])
def test_every_value_reads_back_equal_without_a_template(ck: Checkpointer, blocking: bool) -> None:
    saved = values()
    ck.save(1, saved, blocking=blocking)
    got = ck.read()
    assert set(got) == set(saved)
    for key in saved:
        assert equal(got[key], saved[key]), key


def test_every_value_loads_back_equal_into_a_template(ck: Checkpointer) -> None:
    saved = values()
    ck.save(1, saved)
    template = values()
    # Change what a template can change in place, so that the load must overwrite it.
    template["int_keys"][0].zero_()
    template["arrays"]["f64"][:] = 0
    template["int_keys"][1] = "changed"
    f64 = template["arrays"]["f64"]
    assert ck.load(template) == 1
    for key in saved:
        assert equal(template[key], saved[key]), key
    assert template["arrays"]["f64"] is f64  # filled in place


def test_rng_states_in_per_rank_round_trip(ck: Checkpointer) -> None:
    np.random.seed(1)
    random.seed(2)
    torch.manual_seed(3)
    state = {"np": np.random.get_state(), "py": random.getstate(), "torch": torch.get_rng_state()}
    ck.save(1, {"rng": PerRank(state)})
    expected = (np.random.rand(3), random.random(), torch.rand(3))
    holder = PerRank({"np": np.random.get_state(), "py": random.getstate(), "torch": torch.get_rng_state()})
    assert ck.load({"rng": holder}) == 1
    np.random.set_state(holder.value["np"])
    random.setstate(holder.value["py"])
    torch.set_rng_state(holder.value["torch"])
    assert np.array_equal(np.random.rand(3), expected[0])
    assert random.random() == expected[1]
    assert torch.equal(torch.rand(3), expected[2])
    assert equal(ck.read()["rng"], state)


def test_optimizer_state_with_integer_ids_keeps_its_moments(ck: Checkpointer) -> None:
    saved = optimizer_state()
    ck.save(1, saved)
    got = ck.read()
    assert equal(got, saved)
    # The read dict is usable as is: load it into a fresh optimizer, the moments are there.
    model = nn.Linear(3, 2)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    optim.load_state_dict(got["optimizer_states"][0])
    assert torch.equal(optim.state_dict()["state"][0]["exp_avg"], saved["optimizer_states"][0]["state"][0]["exp_avg"])
    # Saving what was read again works (0 and "0" no longer flatten to one name).
    ck.save(2, got)
    assert equal(ck.read(), saved)


def test_read_picks_a_step_and_leaves_no_per_rank_suffix(ck: Checkpointer) -> None:
    ck.save(1, {"a": 1, "r": PerRank({"x": np.arange(2)})})
    ck.save(2, {"a": 2, "r": PerRank({"x": np.arange(3)})})
    assert ck.read()["a"] == 2
    one = ck.read(step=1)
    assert one["a"] == 1 and equal(one["r"], {"x": np.arange(2)})
    with pytest.raises(CheckpointError):
        ck.read(step=7)


def test_read_of_some_keys_reads_only_those(ck: Checkpointer) -> None:
    ck.save(1, {"big": torch.arange(6.0), "meta": {"epoch": 3, "ids": (1, 2)}, "r": PerRank({"x": np.arange(2)})})
    assert ck.read(keys=["meta"]) == {"meta": {"epoch": 3, "ids": (1, 2)}}
    got = ck.read(step=1, keys={"r", "absent"})
    assert list(got) == ["r"] and equal(got["r"], {"x": np.arange(2)})


def test_read_of_modules_and_optimizers_gives_their_state_dicts(ck: Checkpointer) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    optim.step()
    ck.save(1, {"model": model, "optim": optim})
    got = ck.read()
    assert equal(got["model"], dict(model.state_dict()))
    assert set(got["optim"]["state"]) == {"weight", "bias"}
    assert got["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)


class Opaque:
    pass


@pytest.mark.parametrize(
    "value, hint",
    [
        (Opaque(), "Opaque"),
        ({"k": Opaque()}, "['k']"),
        ({Opaque(): 1}, "key"),
        (np.array([object()], dtype=object), "object"),
        ({"p": Path("/x")}, "str("),
    ],
)
def test_values_that_cannot_round_trip_are_refused_at_save(ck: Checkpointer, value: Any, hint: str) -> None:
    with pytest.raises(UnsupportedValueError) as info:
        ck.save(1, {"v": value})
    assert hint in str(info.value)
    assert ck.steps() == []
