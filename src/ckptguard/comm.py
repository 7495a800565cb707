"""The control plane: small object collectives between ranks.

The protocol only ever needs gather-to-one, broadcast, scatter and broadcast
within a storage domain. Keeping it behind this interface lets the protocol run
without a process group (one rank), and lets benchmarks drive the leader's work
for 16,384 simulated ranks without processes.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch.distributed as dist

from ckptguard.errors import CheckpointError, CorruptCheckpointError


class Comm(Protocol):
    rank: int
    world_size: int

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None: ...
    def broadcast(self, obj: Any, src: int = 0) -> Any: ...
    def scatter(self, objs: list[Any] | None, src: int = 0) -> Any: ...
    def barrier(self) -> None: ...
    def domain_broadcast(self, obj: Any, domain: list[int]) -> Any: ...
    def set_domains(self, domains: list[list[int]]) -> None: ...
    @property
    def process_group(self) -> dist.ProcessGroup | None: ...


class LocalComm:
    """One rank, no process group."""

    rank = 0
    world_size = 1

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        return [obj]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def scatter(self, objs: list[Any] | None, src: int = 0) -> Any:
        assert objs is not None
        return objs[0]

    def barrier(self) -> None:
        pass

    def domain_broadcast(self, obj: Any, domain: list[int]) -> Any:
        return obj

    def set_domains(self, domains: list[list[int]]) -> None:
        pass

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return None


class TorchComm:
    """Object collectives over a dedicated gloo group.

    Object collectives over NCCL would stage through GPU memory and need the
    right current device; a CPU group keeps the control plane out of the way.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if group is None:
            # A group of our own over all ranks (collective): a background save must never
            # interleave its collectives with the training loop's on the same group.
            group = dist.new_group(backend="gloo")
        elif dist.get_backend(group) != "gloo":
            raise ValueError(
                "process_group must be a gloo group (ckptguard's control messages are small CPU objects): "
                "create one with dist.new_group(ranks, backend='gloo') and keep it for ckptguard alone")
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._global_ranks = dist.get_process_group_ranks(group)
        self._domain_groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self._group

    def _global(self, group_rank: int) -> int:
        return self._global_ranks[group_rank]

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=self._global(dst), group=self._group)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(src), group=self._group)
        return box[0]

    def scatter(self, objs: list[Any] | None, src: int = 0) -> Any:
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if self.rank == src else None, src=self._global(src), group=self._group)
        return out[0]

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def set_domains(self, domains: list[list[int]]) -> None:
        """Create one subgroup per storage domain (collective: every rank calls it with the same list)."""
        if len(domains) == 1:
            self._domain_groups = {tuple(domains[0]): self._group}
            return
        for d in domains:
            key = tuple(d)
            if key not in self._domain_groups:
                g = dist.new_group(ranks=[self._global(r) for r in d], backend="gloo")
                self._domain_groups[key] = g

    def domain_broadcast(self, obj: Any, domain: list[int]) -> Any:
        """Broadcast from the domain's leader (its lowest rank) to the ranks of that domain."""
        if len(domain) == 1:
            return obj
        group = self._domain_groups[tuple(domain)]
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(domain[0]), group=group)
        return box[0]


def default_comm(group: dist.ProcessGroup | None = None) -> Comm:
    if dist.is_available() and dist.is_initialized():
        return TorchComm(group)
    return LocalComm()


def hostname() -> str:
    return socket.gethostname()


# -- agreement: one failure anywhere makes every rank raise the same error -------------


def describe_error(err: BaseException) -> str:
    if isinstance(err, CheckpointError):
        return str(err)
    return f"{type(err).__name__}: {err}"


@dataclass(frozen=True)
class Failure:
    rank: int
    host: str
    message: str
    corrupt: bool  # the failure is a corrupt checkpoint (load may fall back to an older one)
    at: float


def local_failure(err: BaseException | None) -> Failure | None:
    if err is None:
        return None
    return Failure(-1, hostname(), describe_error(err), isinstance(err, CorruptCheckpointError), time.time())


def order_failures(statuses: list[Failure | None]) -> list[Failure]:
    """Failures with their ranks filled in, earliest first (the first is most likely the cause)."""
    found = [replace(s, rank=r) for r, s in enumerate(statuses) if s is not None]
    return sorted(found, key=lambda f: (f.at, f.rank))


def gather_failures(comm: Comm, err: BaseException | None) -> list[Failure]:
    """Every rank's outcome of a local step, agreed by all ranks, earliest first."""
    statuses = comm.gather(local_failure(err))
    failures = order_failures(statuses) if comm.rank == 0 and statuses is not None else None
    return comm.broadcast(failures)


def failure_message(failures: list[Failure], what: str) -> str:
    first = failures[0]
    text = f"rank {first.rank} on {first.host} could not {what}: {first.message}"
    if len(failures) > 1:
        others = ", ".join(str(f.rank) for f in failures[1:6])
        more = "..." if len(failures) > 6 else ""
        text += f" (also failed: ranks {others}{more})"
    return text


def with_suffix(message: str, suffix: str) -> str:
    if not suffix:
        return message
    return message + ("" if message.rstrip().endswith((".", "!", "?")) else ".") + suffix


def raise_failures(failures: list[Failure], what: str, suffix: str = "") -> None:
    if failures:
        cls = CorruptCheckpointError if any(f.corrupt for f in failures) else CheckpointError
        raise cls(with_suffix(failure_message(failures, what), suffix), rank=failures[0].rank)


def agree(comm: Comm, err: BaseException | None, what: str, suffix: str = "") -> None:
    """Collective: raise one CheckpointError on every rank if any rank failed ``what``."""
    raise_failures(gather_failures(comm, err), what, suffix)
