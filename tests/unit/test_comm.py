"""Comm.step, the one shape of every agreement: typed errors cross ranks, interrupts stay interrupts.

Ranks are threads of this process (ThreadTransport): the agreement logic is the
same as over gloo, and these tests take milliseconds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ckptguard.comm import Comm, agreed_failures
from ckptguard.errors import (
    CheckpointError,
    CorruptCheckpointError,
    DiskFullError,
    PeerError,
    StepExistsError,
    StoragePermissionError,
)
from ckptguard.threadranks import run_ranks

SRC = Path(__file__).resolve().parents[2] / "src" / "ckptguard"


def test_decision_reaches_every_rank_and_local_results_reach_rank_0() -> None:
    def body(comm: Comm) -> object:
        return comm.step("report", lambda: comm.rank * 10, lambda values: sum(values))

    assert run_ranks(4, body) == [60, 60, 60, 60]


def test_without_a_decision_each_rank_gets_its_own_result() -> None:
    assert run_ranks(3, lambda comm: comm.step("echo", lambda: comm.rank)) == [0, 1, 2]


def test_scatter_gives_each_rank_its_part() -> None:
    def body(comm: Comm) -> object:
        return comm.step("parts", lambda: comm.rank, lambda values: [v * v for v in values], scatter=True)

    assert run_ranks(4, body) == [0, 1, 4, 9]


def test_a_typed_failure_on_one_rank_is_raised_with_its_type_on_every_rank() -> None:
    def body(comm: Comm) -> object:
        def local() -> None:
            if comm.rank == 2:
                raise CorruptCheckpointError("bytes 0..8 do not match", rank=2, path="/x/data/rank2.bin")

        return comm.step("load step 7", local)

    out = run_ranks(4, body)
    assert all(isinstance(e, CorruptCheckpointError) for e in out), out
    for e in out:
        assert e.rank == 2 and e.path == "/x/data/rank2.bin"
        assert [f.rank for f in agreed_failures(e)] == [2]
    assert "rank 2" in str(out[0]) and "load step 7" in str(out[0])


def test_os_errors_become_typed_errors_at_the_step() -> None:
    def body(comm: Comm) -> object:
        def local() -> None:
            if comm.rank == 1:
                raise PermissionError(13, "Permission denied", "/root/ckpt/x")

        return comm.step("create the attempt directory", local, where="/root/ckpt")

    out = run_ranks(2, body)
    assert all(isinstance(e, StoragePermissionError) for e in out), out
    assert isinstance(out[1].__cause__, PermissionError)


def test_disk_full_is_its_own_type() -> None:
    def body(comm: Comm) -> object:
        def local() -> None:
            raise OSError(28, "No space left on device", "/ckpt/data/rank0.bin")

        return comm.step("write", local, where="/ckpt")

    assert all(isinstance(e, DiskFullError) for e in run_ranks(2, body))


def test_keyboard_interrupt_stays_one_on_its_rank_and_the_others_do_not_hang() -> None:
    def body(comm: Comm) -> object:
        def local() -> None:
            if comm.rank == 0:
                raise KeyboardInterrupt

        return comm.step("write", local)

    out = run_ranks(3, body, timeout_s=10)
    assert isinstance(out[0], KeyboardInterrupt)
    assert isinstance(out[1], PeerError) and isinstance(out[2], PeerError)
    assert "interrupted" in str(out[1]) and agreed_failures(out[1])[0].interrupted


def test_a_foreign_error_is_a_peer_error_elsewhere_and_itself_on_its_rank() -> None:
    def body(comm: Comm) -> object:
        def local() -> None:
            if comm.rank == 1:
                raise ValueError("bad files= key")

        return comm.step("plan", local)

    out = run_ranks(2, body)
    assert isinstance(out[1], ValueError)
    assert isinstance(out[0], PeerError) and "ValueError: bad files= key" in str(out[0])


def test_a_refusal_decided_by_rank_0_is_raised_everywhere_with_its_type() -> None:
    def body(comm: Comm) -> object:
        def decide(_: list[object]) -> None:
            raise StepExistsError("step 5 is already committed")

        return comm.step("save step 5", lambda: None, decide)

    out = run_ranks(3, body)
    assert all(isinstance(e, StepExistsError) for e in out)
    assert str(out[2]).startswith("step 5 is already committed")


def test_the_earliest_failure_is_named_and_the_others_listed() -> None:
    def body(comm: Comm) -> object:
        def local() -> None:
            if comm.rank in (1, 3):
                raise CheckpointError(f"broken on {comm.rank}", rank=comm.rank)

        return comm.step("commit", local, suffix=" Nothing was committed.")

    out = run_ranks(4, body)
    first = agreed_failures(out[0])[0].rank
    assert first in (1, 3)
    assert "also failed: ranks" in str(out[0]) and str(out[0]).endswith("Nothing was committed.")
    assert str(out[1]).endswith("Nothing was committed.")  # own errors carry the suffix too


def test_one_rank_acts_gives_every_rank_its_result_and_runs_it_once() -> None:
    calls: list[int] = []

    def body(comm: Comm) -> object:
        def act() -> dict[str, int]:
            calls.append(comm.rank)
            return {"step": 7}

        return comm.one_rank_acts("pick a step", act)

    assert run_ranks(3, body) == [{"step": 7}] * 3 and calls == [0]


@pytest.mark.parametrize(
    "raised, expected",
    [
        (CorruptCheckpointError("step-3/data: checksum mismatch", path="step-3/data"), CorruptCheckpointError),
        (PermissionError(13, "Permission denied", "/ckpt/latest"), StoragePermissionError),
        (KeyError("layout"), PeerError),
    ],
)
def test_one_rank_acts_raises_rank_0s_failure_as_its_class_on_every_rank(raised: BaseException, expected: type) -> None:
    def body(comm: Comm) -> object:
        def act() -> None:
            raise raised

        return comm.one_rank_acts("read the pointer", act, where="/ckpt")

    out = run_ranks(3, body, timeout_s=10)
    assert isinstance(out[1], expected) and isinstance(out[2], expected)
    assert "rank 0" in str(out[1]) and "read the pointer" in str(out[1])
    assert out[0] is raised or isinstance(out[0], expected)  # rank 0: its own, an OSError typed


def test_one_rank_acts_interrupted_on_rank_0_leaves_no_rank_waiting() -> None:
    def body(comm: Comm) -> object:
        def act() -> None:
            raise KeyboardInterrupt

        return comm.one_rank_acts("commit", act)

    out = run_ranks(2, body, timeout_s=10)
    assert isinstance(out[0], KeyboardInterrupt) and isinstance(out[1], PeerError) and "interrupted" in str(out[1])


def test_share_in_domain_reaches_only_the_domain() -> None:
    def body(comm: Comm) -> object:
        domain = [0, 1] if comm.rank < 2 else [2, 3]
        return comm.share_in_domain(f"from {comm.rank}" if comm.rank in (0, 2) else None, domain)

    assert run_ranks(4, body) == ["from 0", "from 0", "from 2", "from 2"]


_COLLECTIVES = {
    "gather",
    "broadcast",
    "all_gather",
    "scatter",
    "barrier",
    "gather_object",
    "all_gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
}


def test_no_collective_is_called_outside_the_communication_module() -> None:
    """Every agreement goes through Comm.step: a raw collective elsewhere could leave ranks waiting."""
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "comm.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _COLLECTIVES:
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno} .{node.func.attr}(...)")
    assert not offenders, "collective calls outside comm.py: " + ", ".join(offenders)


@pytest.mark.parametrize("name", ["gather", "broadcast_object_list", "barrier"])
def test_the_scan_would_catch_a_collective(name: str) -> None:
    code = f"import torch.distributed as dist\ndef f(comm):\n    dist.{name}(None)\n    comm.{name}(1)\n"
    calls = [
        n
        for n in ast.walk(ast.parse(code))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _COLLECTIVES
    ]
    assert len(calls) == 2
