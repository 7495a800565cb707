"""A template one rank cannot use is refused on every rank, and a refused load changes nothing."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptguard import Checkpointer, TemplateMismatchError
from ckptguard.comm import Comm
from ckptguard.protocol import load as load_protocol
from ckptguard.protocol import save as save_protocol
from ckptguard.protocol.root import open_root
from ckptguard.protocol.session import Options, open_session
from ckptguard.protocol.timing import PhaseTimer
from ckptguard.threadranks import run_ranks


@pytest.mark.parametrize("bad", ["int key", "not a mapping", "optimizer without its module"])
def test_a_template_only_one_rank_cannot_use_is_refused_on_every_rank_and_changes_nothing(
    tmp_path: Path, bad: str
) -> None:
    """Rank 1's template fails the argument checks (before any byte is read); rank 0's is fine. Both
    ranks raise at the same agreement, rank 0's template is untouched, and the next load, with good
    templates, works on both (before, rank 1 raised alone and rank 0 ran on into rank 1's next load)."""

    def body(comm: Comm) -> object:
        session = open_session(
            comm,
            open_root(str(tmp_path / "ck")),
            Options(None, None, 1, "xxh3-64", 10.0),
            read_only=False,
            job_id="t",
            lease_ttl_s=30,
            lease_wait_s=1,
        )
        try:
            save_protocol.save(
                session,
                save_protocol.SaveRequest(
                    1, {"w": torch.arange(4.0)}, [], [], False, {}, None, options=session.options
                ),
                PhaseTimer(),
            )
            template = {"w": torch.zeros(4)}
            if comm.rank == 1:
                model = torch.nn.Linear(2, 2)
                state: object = {
                    "int key": {1: torch.zeros(4)},
                    "not a mapping": [torch.zeros(4)],
                    "optimizer without its module": {
                        "w": torch.zeros(4),
                        "opt": torch.optim.SGD(model.parameters(), lr=0.1),
                    },
                }[bad]
            else:
                state = template
            first: object = None
            try:
                load_protocol.load(session, 1, state, None, True, False)  # type: ignore[arg-type]
            except Exception as e:
                first = e
            unchanged = bool(torch.equal(template["w"], torch.zeros(4)))
            again = {"w": torch.zeros(4)}
            load_protocol.load(session, 1, again, None, True, False)
            return first, unchanged, bool(torch.equal(again["w"], torch.arange(4.0)))
        finally:
            if session.lease is not None:
                session.lease.release()

    out = run_ranks(2, body, timeout_s=30)
    for rank, result in enumerate(out):
        assert isinstance(result, tuple), f"rank {rank}: {result!r}"
        first, unchanged, reloaded = result
        assert isinstance(first, Exception), f"rank {rank} loaded although rank 1's template was refused"
        if rank == 0:  # rank 1 raises its own error; the others are told which rank refused
            assert "rank 1" in str(first), f"rank {rank}: {first}"
        assert unchanged and reloaded


def test_a_refused_load_leaves_an_optimizer_that_never_stepped_without_state(tmp_path: Path) -> None:
    """DCP gives a fresh optimizer a state to load into; a load refused after that (a key the checkpoint
    lacks) must take it back: SGD with momentum steps differently from a zero buffer than from none."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    model(torch.randn(2, 3)).sum().backward()
    optim.step()
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": model, "optim": optim})
        fresh = torch.nn.Linear(3, 2)
        for kind in (torch.optim.SGD, torch.optim.Adam):
            new = kind(fresh.parameters(), lr=0.1)
            with pytest.raises(TemplateMismatchError):
                ck.load({"model": fresh, "optim": new, "not saved": torch.zeros(1)}, step=1)
            assert new.state_dict()["state"] == {}
            assert all(p.grad is None for p in fresh.parameters())


@pytest.mark.parametrize("kind", [torch.optim.SGD, torch.optim.Adam])
def test_a_never_stepped_optimizer_whose_parameters_hold_gradients_loads_and_keeps_them(
    tmp_path: Path, kind: type[torch.optim.Optimizer]
) -> None:
    """A template built after a backward pass (an optimizer re-created mid-training): DCP builds no
    state to load into where a parameter holds a gradient; the load must not be refused with
    "optim.state: not in the checkpoint". It loads, the gradients are as they were, and a refused load
    still leaves the optimizer without state."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optim = kind(model.parameters(), lr=0.1, **({"momentum": 0.9} if kind is torch.optim.SGD else {}))
    model(torch.randn(2, 3)).sum().backward()
    optim.step()
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": model, "optim": optim})
        fresh = torch.nn.Linear(3, 2)
        new = kind(fresh.parameters(), lr=0.5, **({"momentum": 0.9} if kind is torch.optim.SGD else {}))
        fresh(torch.randn(2, 3)).sum().backward()
        grads = [p.grad.clone() for p in fresh.parameters()]  # type: ignore[union-attr]
        with pytest.raises(TemplateMismatchError):
            ck.load({"model": fresh, "optim": new, "not saved": torch.zeros(1)}, step=1)
        assert new.state_dict()["state"] == {}
        assert all(torch.equal(p.grad, g) for p, g in zip(fresh.parameters(), grads, strict=True))  # type: ignore[arg-type]
        ck.load({"model": fresh, "optim": new}, step=1)
    saved, loaded = optim.state_dict(), new.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    for i, st in saved["state"].items():
        for name, value in st.items():
            assert torch.equal(torch.as_tensor(loaded["state"][i][name]), torch.as_tensor(value)), (i, name)
    assert all(torch.equal(p.grad, g) for p, g in zip(fresh.parameters(), grads, strict=True))  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True))


class _CtrlCInStep(torch.optim.SGD):
    """An SGD whose next step() is hit by a Ctrl-C (the step DCP takes to give it a state)."""

    armed = False

    def step(self, closure: Any = None) -> Any:
        if _CtrlCInStep.armed:
            _CtrlCInStep.armed = False
            os.kill(os.getpid(), signal.SIGINT)
        return super().step(closure)


def test_a_ctrl_c_while_a_fresh_optimizer_gets_its_state_leaves_it_as_it_was(tmp_path: Path) -> None:
    """DCP builds a never-stepped optimizer's state with a step at learning rate 0, set and put back
    around it: a Ctrl-C inside must not leave every learning rate 0."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    optim.step()
    fresh = torch.nn.Linear(3, 2)
    new = _CtrlCInStep(fresh.parameters(), lr=0.05, momentum=0.9)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with Checkpointer(tmp_path / "ck") as ck:
            ck.save(1, {"model": model, "optim": optim})
            _CtrlCInStep.armed = True
            with pytest.raises(KeyboardInterrupt):
                ck.load({"model": fresh, "optim": new}, step=1)
    finally:
        _CtrlCInStep.armed = False
        signal.signal(signal.SIGINT, previous)
    assert new.param_groups[0]["lr"] == 0.05 and new.state_dict()["state"] == {}
    assert all(p.grad is None for p in fresh.parameters())


@pytest.mark.parametrize("memory", [None, 64 << 20])
def test_a_template_tensor_whose_elements_share_memory_is_refused_before_anything_changes(
    tmp_path: Path, memory: int | None
) -> None:
    """An expand()ed tensor (stride 0) cannot hold distinct values: refused when the load is planned.
    Before, the copy into it failed with torch's RuntimeError after the other keys (and the objects)
    had been written: a torn template."""
    with Checkpointer(tmp_path / "ck", load_memory_bytes=memory) as ck:
        ck.save(1, {"a": torch.arange(6.0).reshape(2, 3), "m": torch.arange(4.0), "o": {"x": 1}})
        template = {"a": torch.full((3,), -1.0).expand(2, 3), "m": torch.full((4,), -2.0), "o": {"x": -9}}
        with pytest.raises(TemplateMismatchError, match=r"a: the template's tensor has elements that share memory"):
            ck.load(template)
        assert template["o"] == {"x": -9} and torch.equal(template["m"], torch.full((4,), -2.0))
        assert torch.equal(template["a"], torch.full((2, 3), -1.0))


@pytest.mark.parametrize("memory", [None, 64 << 20])
def test_tied_template_tensors_are_refused_where_the_checkpoint_holds_two_values(
    tmp_path: Path, memory: int | None
) -> None:
    """Saved untied, loaded into a model that ties them: one tensor cannot take both values (before,
    the load succeeded and one key did not hold its saved bytes). Saved tied, they load tied."""
    with Checkpointer(tmp_path / "ck", load_memory_bytes=memory) as ck:
        ck.save(1, {"emb": torch.arange(4.0), "head": torch.arange(4.0) + 10})
        shared = torch.zeros(4)
        with pytest.raises(TemplateMismatchError, match=r"emb and head are one tensor in the template"):
            ck.load({"emb": shared, "head": shared})
        assert torch.equal(shared, torch.zeros(4))
        tied = torch.arange(4.0) + 5
        ck.save(2, {"emb": tied, "head": tied})
        assert ck.load({"emb": shared, "head": shared}) == 2 and torch.equal(shared, tied)


def test_a_meta_template_without_a_process_group_is_a_template_mismatch(tmp_path: Path) -> None:
    """DCP cannot initialise a meta tensor without a process group: its ValueError becomes a refusal
    that says what to do."""
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"w": torch.arange(4.0)})
        with pytest.raises(TemplateMismatchError, match=r"to_empty"):
            ck.load({"w": torch.empty(4, device="meta")})


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, inputs: list[torch.Tensor]) -> None:
    for x in inputs:
        model(x).sum().backward()
        optim.step()
        optim.zero_grad()


class _NetWithAnUnusedLayer(torch.nn.Module):
    """Parameters that require grad but take no part in forward: an optimizer keeps no state for them."""

    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(5, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _assert_the_state_of_parameters_0_and_1_only(saved: torch.optim.Optimizer, loaded: torch.optim.Optimizer) -> None:
    """The used layer's two parameters hold the saved state, bitwise; the unused layer's hold none."""
    want, got = saved.state_dict()["state"], loaded.state_dict()["state"]
    assert sorted(got) == sorted(want) == [0, 1]
    for i in (0, 1):
        for k, v in want[i].items():
            assert torch.equal(got[i][k], v)


def test_saving_an_optimizer_that_never_stepped_leaves_it_without_state(tmp_path: Path) -> None:
    """DCP gives a never-stepped optimizer a state to save; that state must not stay on the live
    optimizer: training after a save at step 0 is the same as training without it."""

    def train(save: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        inputs = [torch.randn(4, 3) for _ in range(3)]
        if save:
            with Checkpointer(tmp_path / f"ck{save}") as ck:
                ck.save(0, {"model": model, "optim": optim})
                assert optim.state_dict()["state"] == {}
                assert all(p.grad is None for p in model.parameters())
                other = torch.nn.Linear(3, 2)
                ck.load({"model": other, "optim": torch.optim.Adam(other.parameters(), lr=0.1)}, step=0)
        _train(model, optim, inputs)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(train(save=True), train(save=False))


def test_an_optimizer_with_a_parameter_that_never_had_a_gradient_loads_back(tmp_path: Path) -> None:
    """A parameter that requires grad but takes no part in forward has no optimizer state; DCP's strict
    apply refuses the checkpoint it saved itself ("Missing optimizer state for parameter"), after the
    model is already placed. It loads, and the parameter stays without state."""

    def build(seed: int) -> tuple[_NetWithAnUnusedLayer, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        net = _NetWithAnUnusedLayer()
        optim = torch.optim.Adam(net.parameters(), lr=0.001 * seed)
        net(torch.randn(3, 5)).sum().backward()
        optim.step()
        return net, optim

    net, optim = build(1)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": net, "optim": optim})
        net2, optim2 = build(2)
        ck.load({"model": net2, "optim": optim2}, step=1)
    for a, b in zip(net.parameters(), net2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert optim2.state_dict()["param_groups"][0]["lr"] == 0.001
    _assert_the_state_of_parameters_0_and_1_only(optim, optim2)


@pytest.mark.parametrize("kind", ["adam", "sgd-momentum"])
def test_a_fresh_job_resumes_an_optimizer_whose_parameter_never_had_a_gradient(tmp_path: Path, kind: str) -> None:
    """A restarted job builds a fresh model and optimizer; DCP gives the never-stepped optimizer a
    placeholder state for every parameter, and one that never had a gradient has no state in the
    checkpoint; the load must not be refused ("optim.state.unused.weight...: not in the checkpoint"), or
    the job cannot resume. It loads, that parameter without state, as it was saved."""

    def build() -> tuple[_NetWithAnUnusedLayer, torch.optim.Optimizer]:
        net = _NetWithAnUnusedLayer()
        if kind == "adam":
            return net, torch.optim.Adam(net.parameters(), lr=0.01)
        return net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    torch.manual_seed(0)
    net, optim = build()
    inputs = [torch.randn(3, 5) for _ in range(6)]
    _train(net, optim, inputs[:3])
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(3, {"model": net, "optim": optim})
        net2, optim2 = build()
        assert ck.load({"model": net2, "optim": optim2}) == 3
    _assert_the_state_of_parameters_0_and_1_only(optim, optim2)
    _train(net, optim, inputs[3:])  # training goes on the same from the checkpoint as without the restart
    _train(net2, optim2, inputs[3:])
    for a, b in zip(net.parameters(), net2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_optimizer_saved_before_its_first_step_resumes_without_state(tmp_path: Path) -> None:
    """A save before the first step leaves out the placeholder state DCP gives a never-stepped optimizer
    (Adam with step 1 and zero moments): loaded, it would make the job's next step Adam's second.
    Training is the same as a job's that never saved."""

    def run(resume: bool) -> torch.Tensor:
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 2)
        optim = torch.optim.Adam(net.parameters(), lr=0.1)
        inputs = [torch.randn(4, 3) for _ in range(3)]
        if resume:
            with Checkpointer(tmp_path / "ck") as ck:
                ck.save(0, {"model": net, "optim": optim})
                net2 = torch.nn.Linear(3, 2)
                optim2 = torch.optim.Adam(net2.parameters(), lr=0.1)
                assert ck.load({"model": net2, "optim": optim2}) == 0
                assert optim2.state_dict()["state"] == {}
                net, optim = net2, optim2
        _train(net, optim, inputs)
        return torch.cat([p.detach().flatten() for p in net.parameters()])

    assert torch.equal(run(resume=True), run(resume=False))
