"""Ranks as threads of one process: a :class:`~ckptguard.comm.Transport` whose ranks exchange pickled
objects through a barrier, so that the protocol's pieces (agreement steps, probes, lease takeovers)
are tested in milliseconds without torchrun. Not used by a real job.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ckptguard.comm import Comm

T = TypeVar("T")


class _ThreadRendezvous:
    """Where the threads of one simulated group exchange objects (pickled, as between processes)."""

    def __init__(self, size: int, timeout_s: float) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout_s)
        self.slots: list[bytes | None] = [None] * size
        self.lock = threading.Lock()
        self.subgroups: dict[tuple[int, ...], _ThreadRendezvous] = {}
        self.timeout_s = timeout_s

    def subgroup(self, members: tuple[int, ...]) -> _ThreadRendezvous:
        with self.lock:
            if members not in self.subgroups:
                self.subgroups[members] = _ThreadRendezvous(len(members), self.timeout_s)
            return self.subgroups[members]

    def exchange(self, index: int, payload: bytes | None) -> list[bytes | None]:
        self.slots[index] = payload
        self.barrier.wait()
        seen = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read them
        return seen


class ThreadTransport:
    """One rank of a group simulated by threads in one process (unit tests of the protocol)."""

    def __init__(self, rendezvous: _ThreadRendezvous, rank: int) -> None:
        self._rv = rendezvous
        self.rank = rank
        self.world_size = rendezvous.size

    @staticmethod
    def group(world_size: int, timeout_s: float = 60.0) -> list[ThreadTransport]:
        rv = _ThreadRendezvous(world_size, timeout_s)
        return [ThreadTransport(rv, r) for r in range(world_size)]

    @property
    def process_group(self) -> Any:
        return None

    def close(self) -> None:
        pass

    def gather(self, obj: Any) -> list[Any] | None:
        seen = self._rv.exchange(self.rank, pickle.dumps(obj))
        return [pickle.loads(s) for s in seen if s is not None] if self.rank == 0 else None

    def broadcast(self, obj: Any) -> Any:
        seen = self._rv.exchange(self.rank, pickle.dumps(obj) if self.rank == 0 else None)
        assert seen[0] is not None
        return pickle.loads(seen[0])

    def scatter(self, objs: list[Any] | None) -> Any:
        seen = self._rv.exchange(self.rank, pickle.dumps(objs) if self.rank == 0 else None)
        assert seen[0] is not None
        return pickle.loads(seen[0])[self.rank]

    def set_domains(self, domains: Sequence[Sequence[int]]) -> None:
        pass

    def domain_broadcast(self, obj: Any, domain: Sequence[int]) -> Any:
        if len(domain) == 1:
            return obj
        sub = self._rv.subgroup(tuple(domain))
        index = list(domain).index(self.rank)
        seen = sub.exchange(index, pickle.dumps(obj) if index == 0 else None)
        assert seen[0] is not None
        return pickle.loads(seen[0])


def thread_comms(world_size: int, timeout_s: float = 60.0) -> list[Comm]:
    """``world_size`` Comms for threads of one process, one per simulated rank (tests)."""
    return [Comm(t) for t in ThreadTransport.group(world_size, timeout_s)]


def run_ranks(world_size: int, fn: Callable[[Comm], T], timeout_s: float = 60.0) -> list[T | BaseException]:
    """Run ``fn(comm)`` on ``world_size`` threads, one per simulated rank; each rank's result or error."""
    comms = thread_comms(world_size, timeout_s)
    out: list[Any] = [None] * world_size

    def run(r: int) -> None:
        try:
            out[r] = fn(comms[r])
        except BaseException as e:
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
