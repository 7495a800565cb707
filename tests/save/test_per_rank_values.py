"""A plain value that differs across ranks is refused whatever its size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptguard import PerRank, ReplicatedValueError
from ckptguard.comm import Comm
from ckptguard.protocol import save as save_protocol
from ckptguard.protocol.root import open_root
from ckptguard.protocol.session import Options, open_session
from ckptguard.protocol.timing import PhaseTimer
from ckptguard.state import prepare_state
from ckptguard.threadranks import run_ranks


def save_on_thread_ranks(root: Path, world: int, state_of_rank: object) -> list[object]:
    """A real save, by ``world`` ranks simulated by threads sharing one root."""

    def body(comm: Comm) -> object:
        session = open_session(
            comm,
            open_root(str(root)),
            Options(None, None, 1, "xxh3-64", 10.0),
            read_only=False,
            job_id="test",
            lease_ttl_s=30,
            lease_wait_s=1,
        )
        try:
            state = prepare_state(state_of_rank(comm.rank), comm.rank).state_dict  # type: ignore[operator]
            request = save_protocol.SaveRequest(1, state, [], [], False, {}, None, options=session.options)
            return save_protocol.save(session, request, PhaseTimer())
        finally:
            if session.lease is not None:
                session.lease.release()

    return run_ranks(world, body, timeout_s=60)


@pytest.mark.parametrize("nbytes", [64, 160_000, 4 << 20])
def test_a_per_rank_tensor_of_any_size_is_refused_and_named(tmp_path: Path, nbytes: int) -> None:
    out = save_on_thread_ranks(
        tmp_path / "ck", 2, lambda r: {"w": torch.ones(16), "buf": torch.full((nbytes // 4,), float(r))}
    )
    assert all(isinstance(e, ReplicatedValueError) for e in out), out
    assert "'buf'" in str(out[0]) and "PerRank" in str(out[0])


def test_a_large_per_rank_object_is_refused(tmp_path: Path) -> None:
    out = save_on_thread_ranks(tmp_path / "ck", 3, lambda r: {"log": {"lines": ["x" * 200_000, str(r)]}})
    assert all(isinstance(e, ReplicatedValueError) for e in out), out


def test_identical_values_and_per_rank_wrapped_ones_save(tmp_path: Path) -> None:
    out = save_on_thread_ranks(
        tmp_path / "ck", 2, lambda r: {"w": torch.ones(100_000), "rng": PerRank(torch.full((60_000,), float(r)))}
    )
    assert all(isinstance(o, save_protocol.SaveOutcome) for o in out), out


def test_a_value_on_one_rank_only_is_not_a_divergence(tmp_path: Path) -> None:
    out = save_on_thread_ranks(tmp_path / "ck", 2, lambda r: {"w": torch.ones(8), **({"only0": 1} if r == 0 else {})})
    assert all(isinstance(o, save_protocol.SaveOutcome) for o in out), out


@pytest.mark.parametrize(
    ("rank0", "rank1", "named"),
    [
        ({"w": torch.zeros(4)}, {"w": torch.zeros(4, dtype=torch.int32)}, "shape [4] int32"),
        ({"w": torch.zeros(4)}, {"w": torch.zeros(8, dtype=torch.float16)}, "shape [8] float16"),  # the same 16 bytes
        ({"w": torch.zeros(4)}, {"w": torch.zeros(2, 2)}, "shape [2, 2] float32"),
        ({"a": {"b": torch.ones(2)}}, {"a.b": torch.ones(2)}, "nested as ['a.b']"),
        ({"o": torch.tensor(1)}, {"o": 1}, "an object"),
    ],
    ids=["dtype", "shape-same-bytes", "shape", "nesting", "tensor-object"],
)
def test_a_plain_value_of_the_same_bytes_but_another_kind_is_refused_and_named(
    tmp_path: Path, rank0: dict[str, object], rank1: dict[str, object], named: str
) -> None:
    """The bytes of a plain value are compared after the write; the same bytes as another dtype or
    shape, or under another nesting, were saved silently and rank 1 loaded rank 0's (or DCP failed
    with a bare AssertionError): the local plans are compared before anything is written."""
    out = save_on_thread_ranks(tmp_path / "ck", 2, lambda r: rank0 if r == 0 else rank1)
    assert all(isinstance(e, ReplicatedValueError) for e in out), out
    assert named in str(out[0]) and "PerRank" in str(out[0]) and "Nothing was committed" in str(out[0]), out[0]
    assert not list((tmp_path / "ck").glob("step*")), "a refused save committed a step"
