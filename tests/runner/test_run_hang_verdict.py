"""Which rank stopped, from every rank's state at a hang (generated jobs of 1 to 64 ranks)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from ckptguard.runner.hang import classify, stopped_rank

OUTSIDE = st.sampled_from(
    [
        ("user", "in user code at step (train.py:9)"),
        ("io", "blocked in read() on /nfs/x"),
        ("dataloader", "waiting for the next batch"),
        ("device", "in a device call"),
    ]
)


def _procs(states: dict[int, tuple[str, str]]) -> list[dict[str, Any]]:
    return [
        {
            "processes": [
                {
                    "rank": r,
                    "state": s,
                    "detail": d,
                    "threads": [[{"file": "t.py", "line": 1, "func": "f", "current": True}]],
                }
                for r, (s, d) in states.items()
            ]
        }
    ]


@given(world=st.integers(2, 64), data=st.data())
def test_the_one_rank_outside_the_collective_is_named(world: int, data: st.DataObject) -> None:
    stopped = data.draw(st.integers(0, world - 1))
    op = data.draw(st.sampled_from(["all_reduce", "barrier", "broadcast", "backward (DDP's gradient all-reduce)"]))
    states = {r: ("collective", op) for r in range(world)}
    states[stopped] = data.draw(OUTSIDE)
    # Split over nodes: each node's record holds some ranks.
    cut = data.draw(st.integers(0, world))
    records = _procs({r: s for r, s in states.items() if r < cut}) + _procs(
        {r: s for r, s in states.items() if r >= cut}
    )
    v = stopped_rank(records)
    assert v.rank == stopped
    assert v.state == states[stopped][0]
    assert v.waiting == [r for r in range(world) if r != stopped]


@given(world=st.integers(3, 64), data=st.data())
def test_the_odd_one_out_of_the_collectives_is_named(world: int, data: st.DataObject) -> None:
    stopped = data.draw(st.integers(0, world - 1))
    states = {r: ("collective", "all_reduce") for r in range(world)}
    states[stopped] = ("collective", data.draw(st.sampled_from(["broadcast", "recv", "barrier"])))
    v = stopped_rank(_procs(states))
    assert v.rank == stopped and v.state == "other_collective"


def test_every_rank_in_the_same_collective_names_no_rank() -> None:
    v = stopped_rank(_procs({r: ("collective", "all_reduce") for r in range(4)}))
    assert v.rank is None and "not among them" in v.text


def test_ddp_backward_is_a_collective_and_a_read_names_its_path(tmp_path: Any) -> None:
    backward = [
        [
            {
                "file": "/x/site-packages/torch/autograd/graph.py",
                "line": 1,
                "func": "_engine_run_backward",
                "current": True,
            },
            {"file": "/x/site-packages/torch/_tensor.py", "line": 2, "func": "backward", "current": True},
            {"file": "/job/train.py", "line": 3, "func": "<module>", "current": True},
        ]
    ]
    assert classify(backward, None, None, None)[0] == "collective"
    user = [
        [
            {"file": "/job/train.py", "line": 9, "func": "load_shard", "current": True},
            {"file": "/job/train.py", "line": 3, "func": "<module>", "current": True},
        ]
    ]
    state, detail = classify(user, "read", str(tmp_path / "ck" / "step-3" / "x.bin"), str(tmp_path / "ck"))
    assert state == "io" and "(the checkpoint path)" in detail and "load_shard" in detail
    assert classify(user, "read", "pipe:[1234]", None)[0] == "user"  # a pipe is not a stalled path


def _frame(file: str, func: str, current: bool = False) -> dict[str, Any]:
    return {"file": file, "line": 1, "func": func, "current": current}


@given(others=st.integers(0, 5), at=st.integers(0, 5), data=st.data())
def test_a_rank_with_any_thread_in_a_collective_waits_in_it(others: int, at: int, data: st.DataObject) -> None:
    # The main thread waits for an async save in close(); wherever the save's thread is among the
    # others, the rank waits in its collective.
    op = data.draw(st.sampled_from(["all_gather", "broadcast", "barrier"]))
    main = [_frame("/x/ckptguard/checkpointer.py", "close"), _frame("/job/train.py", "<module>")]
    idle = [_frame("/usr/lib/python3.11/threading.py", "wait"), _frame("/usr/lib/python3.11/threading.py", "run")]
    save = [
        _frame("/x/site-packages/torch/distributed/distributed_c10d.py", op),
        _frame("/x/ckptguard/comm.py", "gather"),
        _frame("/usr/lib/python3.11/threading.py", "run"),
    ]
    threads = [idle] * others
    threads.insert(min(at, others), save)
    assert classify([*threads, main], None, None, None) == ("collective", op)


@given(world=st.integers(2, 16), data=st.data())
def test_processes_of_unknown_rank_are_named_by_pid_leaving_out_the_wrapper(world: int, data: st.DataObject) -> None:
    stopped = data.draw(st.integers(0, world - 1))
    wrapper = {
        "pid": 10,
        "ppid": 1,
        "rank": None,
        "state": "user",
        "detail": "in user code",
        "threads": [[_frame("/usr/lib/python3.11/subprocess.py", "wait"), _frame("w.py", "<module>")]],
    }
    procs = [wrapper]
    for i in range(world):
        state = ("user", "in user code at stuck") if i == stopped else ("collective", "all_reduce")
        frame = _frame("t.py", "<module>", True)
        procs.append(
            {"pid": 100 + i, "ppid": 10, "rank": None, "state": state[0], "detail": state[1], "threads": [[frame]]}
        )
    v = stopped_rank([{"processes": procs}])
    assert v.rank is None and v.pid == 100 + stopped
    assert v.waiting == [100 + i for i in range(world) if i != stopped]
    assert f"process {100 + stopped}" in v.text and "rank" not in v.text.split(":", 1)[1]
