"""Tensors the data path does not store, and two values under one DCP name, are refused at the save
with UnsupportedValueError naming the value (nothing committed), never a raw torch error; an async
save refuses at its call, not at wait(). And the load into an optimizer with state for fewer
parameters than the checkpoint keeps the others' saved state. Each case failed before (a raw torch
error, the refusal only at wait(), the saved state dropped)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptguard import Checkpointer, UnsupportedValueError

pytestmark = pytest.mark.filterwarnings("ignore:.*(beta|deprecated|prototype).*:UserWarning")

SUB_BYTE = [
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "bits16",
    *(f"int{n}" for n in range(1, 8)),
    *(f"uint{n}" for n in range(1, 8)),
]

TENSORS: dict[str, Callable[[], torch.Tensor]] = {
    "sparse_coo": lambda: torch.eye(4).to_sparse(),
    "sparse_csr": lambda: torch.eye(4).to_sparse_csr(),
    "quantized": lambda: torch.quantize_per_tensor(torch.ones(8), 0.1, 0, torch.quint8),
    "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    "meta": lambda: torch.empty(8, device="meta"),
    **{
        name: (lambda name=name: torch.zeros(8, dtype=torch.uint8).view(getattr(torch, name)))  # type: ignore[misc]
        for name in SUB_BYTE
    },
}


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Checkpointer:
    with Checkpointer(tmp_path_factory.mktemp("refusals") / "ck") as ck:
        yield ck  # type: ignore[misc]


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
@pytest.mark.parametrize("kind", list(TENSORS))
def test_a_tensor_the_data_path_does_not_store_is_refused_at_the_save(
    ck: Checkpointer, kind: str, blocking: bool
) -> None:
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


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, both: bool = True) -> torch.Tensor:
        return self.b(self.a(x)) if both else self.a(x)


@pytest.mark.parametrize("kind", ["adam", "sgd-momentum"])
def test_an_optimizer_with_state_for_fewer_parameters_loads_the_others_saved_state(tmp_path: Path, kind: str) -> None:
    """The template's optimizer stepped only on layer a (layer b had no gradient yet); the checkpoint holds
    state for both layers. Layer b's saved state was dropped: only the template's keys were planned."""

    def build() -> tuple[_TwoLayers, torch.optim.Optimizer]:
        net = _TwoLayers()
        if kind == "adam":
            return net, torch.optim.Adam(net.parameters(), lr=0.01)
        return net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    torch.manual_seed(0)
    net, optim = build()
    for _ in range(2):
        net(torch.randn(3, 5)).sum().backward()
        optim.step()
        optim.zero_grad()
    net2, optim2 = build()
    net2(torch.randn(3, 5), both=False).sum().backward()
    optim2.step()
    optim2.zero_grad()
    assert sorted(optim2.state_dict()["state"]) == [0, 1]
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": net, "optim": optim})
        assert ck.load({"model": net2, "optim": optim2}) == 1
    want, got = optim.state_dict()["state"], optim2.state_dict()["state"]
    assert sorted(got) == sorted(want) == [0, 1, 2, 3]
    for i in want:
        for k, v in want[i].items():
            assert torch.equal(got[i][k], v), (i, k)
