"""Tensors the data path does not store, and two values under one DCP name, are refused at the save
with UnsupportedValueError naming the value (nothing committed), never a raw torch error; an async
save refuses at its call, not at wait(). Each case failed before (a raw torch error, or the refusal
only at wait())."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptguard import Checkpointer, UnsupportedValueError

pytestmark = pytest.mark.filterwarnings("ignore:.*(beta|deprecated|prototype).*:UserWarning")

SUB_BYTE = ["bits1x8", "bits2x4", "bits4x2", "bits8", "bits16", *(f"int{n}" for n in range(1, 8)),
            *(f"uint{n}" for n in range(1, 8))]

TENSORS: dict[str, Callable[[], torch.Tensor]] = {
    "sparse_coo": lambda: torch.eye(4).to_sparse(),
    "sparse_csr": lambda: torch.eye(4).to_sparse_csr(),
    "quantized": lambda: torch.quantize_per_tensor(torch.ones(8), 0.1, 0, torch.quint8),
    "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    "meta": lambda: torch.empty(8, device="meta"),
    **{name: (lambda name=name: torch.zeros(8, dtype=torch.uint8).view(getattr(torch, name)))  # type: ignore[misc]
       for name in SUB_BYTE},
}


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Checkpointer:
    with Checkpointer(tmp_path_factory.mktemp("refusals") / "ck") as ck:
        yield ck  # type: ignore[misc]


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
@pytest.mark.parametrize("kind", list(TENSORS))
def test_a_tensor_the_data_path_does_not_store_is_refused_at_the_save(ck: Checkpointer, kind: str,
                                                                      blocking: bool) -> None:
    state = {"ok": torch.ones(4), "nested": {"bad": TENSORS[kind]()}}
    with pytest.raises(UnsupportedValueError, match=r"\['nested'\]\['bad'\]"):
        ck.save(1, state, blocking=blocking)
    ck.wait()
    assert ck.steps() == [] and not list(Path(ck.root).glob("step-*"))


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_two_values_of_one_dcp_name_are_refused_at_the_call(ck: Checkpointer, blocking: bool) -> None:
    with pytest.raises(UnsupportedValueError, match=r"'a\.b'"):
        ck.save(1, {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, blocking=blocking)
    ck.wait()  # nothing left to raise here
    assert ck.steps() == []
    ck.save(2, {"a.b": torch.ones(2), "a": {"c": torch.zeros(2)}}, blocking=blocking)
    ck.wait()
    assert ck.steps() == [2]
    ck.delete(2)
