"""S3 at scale, checked at the scale this machine has: the requests a save and a load make (counted at
the test proxy, against the model of bench/sim_s3_scale.py), and saves and loads through a burst of
``503 SlowDown`` answers (retried with backoff, a bounded number of times, bitwise equal)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto")

from ckptguard import Checkpointer, PerRank
from ckptguard.comm import Comm
from ckptguard.protocol import load as load_protocol
from ckptguard.protocol import save as save_protocol
from ckptguard.protocol.root import open_root
from ckptguard.protocol.session import Options, open_session
from ckptguard.protocol.timing import PhaseTimer
from ckptguard.state import prepare_state
from ckptguard.storage.s3 import S3Storage
from ckptguard.threadranks import run_ranks

from tests.support import s3_requests as sim
from tests.support.beds.s3 import Request, S3Bed, count_requests, s3_bed_in_env

PART = 5 << 20
# As on AWS: no probe of conditional writes (the store is known to check them).
OPTIONS = {"part_size": PART, "check_conditional_writes": False}
ELEMS = (PART + PART // 5) // 4  # per rank: one full part and a short one
SMALL = 1000  # a second tensor per rank, in the same file


@pytest.fixture(scope="module")
def bed() -> Iterator[S3Bed]:
    with s3_bed_in_env(seed=22) as b:
        yield b


def _state(rank: int, step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"big": PerRank(torch.randn(ELEMS, generator=g)), "small": PerRank(torch.randn(SMALL, generator=g))}


def _empty() -> dict[str, object]:
    return {"big": PerRank(torch.zeros(ELEMS)), "small": PerRank(torch.zeros(SMALL))}


def _run(bed: S3Bed, world: int, between: Callable[[str], None] = lambda _: None) -> tuple[list[int], list[bool]]:
    """``world`` thread ranks: save step 1, then (marks in the proxy's log around each) save step 2 and load
    it. Marks: [after step 1, after step 2, after the load]; whether each rank loaded its state bitwise."""
    url = f"s3://{bed.make_bucket(f'scale-{uuid.uuid4().hex[:10]}')}/run"
    marks: list[int] = []

    def decide(what: str) -> None:
        marks.append(len(bed.proxy.stats.log))
        between(what)

    def mark(comm: Comm, what: str) -> None:
        """Rank 0 marks the log once every rank is done with the phase; no rank goes on before."""
        comm.step(f"mark {what}", lambda: None, lambda _: decide(what))

    def body(comm: Comm) -> bool:
        session = open_session(
            comm,
            open_root(url, OPTIONS),
            Options(None, None, 4, "crc32c", 10.0),
            read_only=False,
            job_id="scale",
            lease_ttl_s=60,
            lease_wait_s=1,
        )
        try:
            for step in (1, 2):
                state = prepare_state(_state(comm.rank, step), comm.rank).state_dict
                save_protocol.save(
                    session,
                    save_protocol.SaveRequest(step, state, [], [], False, {}, None, options=session.options),
                    PhaseTimer(),
                )
                mark(comm, f"saved {step}")
            out = prepare_state(_empty(), comm.rank).state_dict
            loaded = load_protocol.load(session, None, out, None, True, False)[0]
            mark(comm, "loaded")
            want = prepare_state(_state(comm.rank, 2), comm.rank).state_dict
            return loaded == 2 and all(torch.equal(out[k], want[k]) for k in want)
        finally:
            if session.lease is not None:
                session.lease.release()

    out = run_ranks(world, body, timeout_s=120)
    errors = [e for e in out if isinstance(e, BaseException)]
    if errors:
        raise errors[0]
    return marks, [bool(x) for x in out]


def _data(path: str) -> bool:
    return "/data/" in path


def _not_lease(path: str) -> bool:
    return not path.endswith("/lease.json")  # renewed on a timer: not part of what a save or load asks


def _control(path: str) -> bool:
    return not _data(path) and _not_lease(path)


def test_requests_of_a_save_and_a_load_are_the_models(bed: S3Bed) -> None:
    """4 ranks, op by op (2 ranks: the burst test below, in total)."""
    world = 4
    marks, equal = _run(bed, world)
    assert all(equal)
    log = bed.proxy.stats.log
    save, load = log[marks[0] : marks[1]], log[marks[1] : marks[2]]
    items = [4 * ELEMS, 4 * SMALL]
    want_save = sim.save_requests(world, items, PART)
    want_load = sim.load_requests(world, items, PART)
    assert count_requests(save, _data) == want_save.data()
    assert count_requests(save, _control) == want_save.control
    got = count_requests(load, _data)
    assert got["HeadObject"] == want_load.data()["HeadObject"]
    assert want_load.data()["GetObject"] <= got["GetObject"] <= world * sim.most_gets_per_rank(items, PART), got
    assert set(got) == {"HeadObject", "GetObject"}
    assert count_requests(load, _control) == want_load.control


def test_a_burst_of_slowdown_is_retried_with_backoff_and_a_bounded_number_of_times(bed: S3Bed) -> None:
    """S3 answers ``503 SlowDown`` to parts, whole-object PUTs, ranged GETs and a control write while it
    splits a prefix: every such request is retried (with backoff) until it lands, and the save and the
    load are bitwise; each refusal costs exactly one more request."""

    def data_write(r: Request) -> bool:
        return "/data/" in r.path and r.method in ("PUT", "POST")

    def data_read(r: Request) -> bool:
        return "/data/" in r.path and r.method == "GET"

    def index_write(r: Request) -> bool:
        return r.path.endswith("/index.json") and r.method == "PUT"

    rules = []

    def arm(what: str) -> None:
        if what == "saved 1":
            rules.extend(
                [
                    bed.proxy.add_rule(data_write, "slowdown", times=3),
                    bed.proxy.add_rule(index_write, "slowdown", times=1),
                ]
            )
        elif what == "saved 2":
            rules.append(bed.proxy.add_rule(data_read, "slowdown", times=2))

    try:
        marks, equal = _run(bed, 2, arm)
    finally:
        bed.proxy.clear_rules()
    assert all(equal)
    assert [r.hits for r in rules] == [3, 1, 2]
    log = bed.proxy.stats.log
    save, load = log[marks[0] : marks[1]], log[marks[1] : marks[2]]
    assert [sum(1 for e in phase if e[3] == 503) for phase in (save, load)] == [4, 2]
    # Each refusal costs one more request and nothing else: the model's count + the refusals.
    items = [4 * ELEMS, 4 * SMALL]
    save_model, load_model = sim.save_requests(2, items, PART), sim.load_requests(2, items, PART)
    assert sum(count_requests(save, _not_lease).values()) == save_model.count() + 4
    got = count_requests(load, _data)
    assert got["HeadObject"] == load_model.data()["HeadObject"]
    assert load_model.data()["GetObject"] + 2 <= got["GetObject"] <= 2 * sim.most_gets_per_rank(items, PART) + 2
    assert count_requests(load, _control) == load_model.control


def test_retry_mode_adaptive_reaches_the_data_client_only() -> None:
    """``retry_mode="adaptive"``: the data client paces its own rate after a throttle (botocore's
    adaptive mode); the control client keeps standard retries; anything else is refused."""
    options = {**OPTIONS, "retry_mode": "adaptive"}
    storage = S3Storage("s3://adaptive/run", options)
    assert storage.client.meta.config.retries["mode"] == "adaptive"
    assert storage.control.meta.config.retries["mode"] == "standard"
    assert S3Storage("s3://adaptive/run", OPTIONS).client.meta.config.retries["mode"] == "standard"
    with pytest.raises(ValueError, match="retry_mode"):
        S3Storage("s3://adaptive/run", {"retry_mode": "legacy"})


def test_data_requests_outlast_slowdown_after_botocores_retries_gave_up(bed: S3Bed) -> None:
    """botocore gives up on a throttled request after ``max_attempts`` tries or once the process's retry
    quota is spent (thousands of ranks on one new prefix); a data request then waits and goes again:
    with ``max_attempts=1`` (botocore retries nothing) a save and a load through SlowDown still land.
    And a rank never has more than ``max_concurrency`` data requests in flight."""
    url = f"s3://{bed.make_bucket(f'outlast-{uuid.uuid4().hex[:10]}')}/run"
    options = {**OPTIONS, "max_attempts": 1, "max_concurrency": 2}
    state = {"w": torch.randn(4 * PART // 4 + 1000, generator=torch.Generator().manual_seed(6))}  # 5 parts
    writes = bed.proxy.add_rule(lambda r: "/data/" in r.path and r.method in ("PUT", "POST"), "slowdown", times=1)
    reads = bed.proxy.add_rule(lambda r: "/data/" in r.path and r.method == "GET", "slowdown", times=1)
    slow = bed.proxy.add_rule(lambda r: "/data/" in r.path and r.method in ("PUT", "GET"), "delay", delay_s=0.1)
    bed.proxy.track = lambda method, path: "/data/" in path and method in ("PUT", "GET")
    bed.proxy.peak_in_flight = 0
    try:
        with Checkpointer(url, process_group="local", storage_options=options) as ck:
            ck.save(1, state)
            out = {"w": torch.zeros_like(state["w"])}
            assert ck.load(out) == 1 and torch.equal(out["w"], state["w"])
        peak = bed.proxy.peak_in_flight
    finally:
        bed.reset_faults()
    assert writes.hits == 1 and reads.hits == 1 and slow.hits >= 10
    assert peak == 2  # parts and ranges overlapped, never more than max_concurrency
