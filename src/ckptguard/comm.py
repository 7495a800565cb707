"""The control plane: the one place where ranks talk to each other.

The protocol is a sequence of *steps*: every rank runs a local action, rank 0
gathers the outcomes and decides, every rank learns the decision, and if any
rank failed, every rank raises. :meth:`Comm.step` is that shape, written once;
no other module calls a collective (a test checks it).

The raw collectives sit behind a small :class:`Transport`: torch.distributed
over a gloo group for real jobs, one rank without a process group, or threads
in one process (:class:`ckptguard.threadranks.ThreadTransport`) so the
protocol's pieces get fast unit tests without torchrun.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from ckptguard.errors import CheckpointError, FailureRecord, PeerError, from_os_error

T = TypeVar("T")

#: How long a collective of ckptguard's own group waits for a rank that died or stalled.
DEFAULT_TIMEOUT_S = 300.0

_FAILURES_ATTR = "_ckptguard_failures"


class Transport(Protocol):
    """Raw object collectives among the ranks of one group (rank 0 is the coordinator)."""

    rank: int
    world_size: int

    def gather(self, obj: Any) -> list[Any] | None: ...
    def broadcast(self, obj: Any) -> Any: ...
    def scatter(self, objs: list[Any] | None) -> Any: ...
    def domain_broadcast(self, obj: Any, domain: Sequence[int]) -> Any: ...
    def set_domains(self, domains: Sequence[Sequence[int]]) -> None: ...
    def close(self) -> None: ...
    @property
    def process_group(self) -> Any: ...


class LocalTransport:
    """One rank, no process group."""

    rank = 0
    world_size = 1

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj

    def scatter(self, objs: list[Any] | None) -> Any:
        assert objs is not None
        return objs[0]

    def domain_broadcast(self, obj: Any, domain: Sequence[int]) -> Any:
        return obj

    def set_domains(self, domains: Sequence[Sequence[int]]) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def process_group(self) -> Any:
        return None


class TorchTransport:
    """Object collectives over a dedicated gloo group.

    Object collectives over NCCL would stage through GPU memory and need the
    right current device; a CPU group keeps the control plane out of the way.
    """

    def __init__(self, group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.timeout_s = timeout_s
        if group is None:
            # A group of our own over all ranks (collective): a background save must never
            # interleave its collectives with the training loop's on the same group. Its timeout
            # bounds how long survivors wait for a rank that died or stalled (gloo's own: 30 min).
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        elif dist.get_backend(group) != "gloo":
            raise ValueError(
                "process_group must be a gloo group (ckptguard's control messages are small CPU objects): "
                "create one with dist.new_group(ranks, backend='gloo') and keep it for ckptguard alone"
            )
        self._group = group
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        self._global_ranks: list[int] = dist.get_process_group_ranks(group)
        self._domain_groups: dict[tuple[int, ...], Any] = {}

    @property
    def process_group(self) -> Any:
        return self._group

    def close(self) -> None:
        """Drop this transport's references to its groups. A closed Checkpointer is cyclic garbage that
        lives until a garbage collection: holding its gloo groups, it kept their native threads alive past
        destroy_process_group(), to be destroyed while the interpreter shuts down, where PyTorch aborts
        now and then ("terminate called without an active exception") after the job's work is done."""
        self._group = None
        self._domain_groups = {}

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self._dist.gather_object(obj, out, dst=self._global_ranks[0], group=self._group)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._global_ranks[0], group=self._group)
        return box[0]

    def scatter(self, objs: list[Any] | None) -> Any:
        out: list[Any] = [None]
        self._dist.scatter_object_list(
            out, objs if self.rank == 0 else None, src=self._global_ranks[0], group=self._group
        )
        return out[0]

    def set_domains(self, domains: Sequence[Sequence[int]]) -> None:
        """One subgroup per storage domain (collective: every rank calls it with the same list)."""
        if len(domains) == 1:
            self._domain_groups = {tuple(domains[0]): self._group}
            return
        for d in domains:
            key = tuple(d)
            if key not in self._domain_groups:
                ranks = [self._global_ranks[r] for r in d]
                self._domain_groups[key] = self._dist.new_group(
                    ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s)
                )

    def domain_broadcast(self, obj: Any, domain: Sequence[int]) -> Any:
        if len(domain) == 1:
            return obj
        box = [obj]
        self._dist.broadcast_object_list(
            box, src=self._global_ranks[domain[0]], group=self._domain_groups[tuple(domain)]
        )
        return box[0]


def hostname() -> str:
    return socket.gethostname()


class Comm:
    """The agreement API the protocol is written in (see the module docstring)."""

    def __init__(self, transport: Transport) -> None:
        self._t = transport
        self.rank = transport.rank
        self.world_size = transport.world_size

    @property
    def process_group(self) -> Any:
        return self._t.process_group

    def set_domains(self, domains: Sequence[Sequence[int]]) -> None:
        """Prepare one channel per storage domain (collective: every rank, the same list)."""
        self._t.set_domains(domains)

    def close(self) -> None:
        """Release the process groups (no collective; this Comm is not used after)."""
        self._t.close()

    def step(
        self,
        what: str,
        local_fn: Callable[[], T] | None = None,
        decide_fn: Callable[[list[Any]], Any] | None = None,
        *,
        scatter: bool = False,
        suffix: str = "",
        where: str | None = None,
        on_error: Callable[[BaseException], BaseException] | None = None,
    ) -> Any:
        """Run ``local_fn`` on every rank, let rank 0 decide, and agree; collective.

        ``decide_fn`` (rank 0 only) gets every rank's local result, in rank
        order, and returns the decision every rank gets back (with
        ``scatter=True``: a list with one part per rank). Without ``decide_fn``
        each rank gets its own local result back.

        If any rank failed (in ``local_fn``, or rank 0 in ``decide_fn``), every
        rank raises: a rank that failed re-raises its own error (a
        KeyboardInterrupt stays one), the others raise the first failure's
        class rebuilt from what crossed ranks. ``what`` completes "rank N could
        not ...". An OSError becomes a typed error here (:func:`from_os_error`,
        ``where`` names the root for disk-full messages); ``on_error`` may
        replace a local error before it is shared (a save that was fenced off
        reports the takeover rather than the file that vanished under it).
        """
        own: BaseException | None = None
        value: Any = None
        if local_fn is not None:
            try:
                value = local_fn()
            except BaseException as e:  # every failure must reach the agreement, or the others wait
                own = self._typed(e, where, on_error)
        with self._transport_failures(what):
            gathered = self._t.gather((self._record(own), value if decide_fn is not None else None))
        verdict: Any = None
        if self.rank == 0:
            assert gathered is not None
            failures = ordered_failures([g[0] for g in gathered])
            decision: Any = None
            if not failures and decide_fn is not None:
                try:
                    decision = decide_fn([g[1] for g in gathered])
                except BaseException as e:  # a refusal decided by rank 0 (the step exists, paths collide)
                    own = e
                    failures = [self._decision_record(e)]
            if failures:
                verdict = [("failed", failures)] * self.world_size if scatter else ("failed", failures)
            elif scatter:
                verdict = [("ok", part) for part in decision]
            else:
                verdict = ("ok", decision)
        with self._transport_failures(what):
            if scatter:
                # Rank 0 keeps its own part: pickling a large part to send it to itself costs real time.
                if self.rank == 0:
                    self._t.scatter([None, *verdict[1:]])
                    kind, payload = verdict[0]
                else:
                    kind, payload = self._t.scatter(None)
            else:
                kind, payload = self._t.broadcast(verdict)
        if kind == "failed":
            try:
                raise_agreed(payload, own, what, suffix, self.rank)
            except BaseException as e:
                with contextlib.suppress(AttributeError, TypeError):  # never replaces the agreed error
                    setattr(e, _AGREED, True)  # on the error itself: no reference to it (and its frames) kept
                raise
        if decide_fn is None:
            return value
        return payload

    def share_in_domain(self, value: Any, domain: Sequence[int]) -> Any:
        """The domain leader's ``value`` on every rank of its storage domain (collective in the domain)."""
        with self._transport_failures("share the checkpoint's manifest within its storage domain"):
            return self._t.domain_broadcast(value, domain)

    @contextlib.contextmanager
    def _transport_failures(self, what: str) -> Iterator[None]:
        """A collective that fails (a rank died, or stalled past the group's timeout) is a PeerError."""
        try:
            yield
        except CheckpointError:
            raise
        except (RuntimeError, OSError, ConnectionError) as e:
            timeout = getattr(self._t, "timeout_s", None)
            bound = f" (ckptguard's control group gives up after {timeout:.0f} s)" if timeout else ""
            raise PeerError(
                f"rank {self.rank} lost contact with the other ranks while trying to {what}: {e}. Another rank "
                f"died or stalled{bound}; its own log says why. Nothing of this step was agreed.",
                rank=self.rank,
            ) from e

    def _typed(
        self, err: BaseException, where: str | None, on_error: Callable[[BaseException], BaseException] | None
    ) -> BaseException:
        return typed_failure(err, self.rank, where, on_error)

    def _decision_record(self, err: BaseException) -> FailureRecord:
        record = self._record(err)
        assert record is not None
        rank = err.rank if isinstance(err, CheckpointError) else None
        return replace(record, rank=rank, decision=True)

    def _record(self, err: BaseException | None) -> FailureRecord | None:
        return failure_record(err, self.rank)

    def one_rank_acts(self, what: str, act: Callable[[], T], *, where: str | None = None) -> T:
        """Rank 0 runs ``act``; every rank gets its result, or raises its failure as the same class; collective.

        One broadcast (no gather: the other ranks have nothing to report). ``what`` completes
        "rank 0 could not ..."; ``where`` names the root for an OSError's message.
        """

        def broadcast(verdict: Any) -> Any:
            with self._transport_failures(what):
                return self._t.broadcast(verdict)

        return rank0_outcome(self.rank, broadcast, what, act, where)


def typed_failure(
    err: BaseException,
    rank: int,
    where: str | None = None,
    on_error: Callable[[BaseException], BaseException] | None = None,
) -> BaseException:
    """``err`` as it crosses ranks: an OSError becomes a typed error here (:func:`from_os_error`)."""
    if isinstance(err, OSError):
        translated = from_os_error(err, getattr(err, "filename", None) or where or "?", rank, root=where)
        translated.__cause__ = err
        err = translated
    if on_error is not None and isinstance(err, Exception):
        err = on_error(err)
    return err


def failure_record(err: BaseException | None, rank: int) -> FailureRecord | None:
    """What crosses ranks of ``err`` (None: no failure)."""
    if err is None:
        return None
    if isinstance(err, CheckpointError):
        message, path = str(err), err.path
    else:
        message, path = str(err) or type(err).__name__, None
    return FailureRecord(
        rank, hostname(), type(err).__name__, message, path, time.time(), interrupted=not isinstance(err, Exception)
    )


def rank0_outcome(
    rank: int, broadcast: Callable[[Any], Any], what: str, act: Callable[[], T], where: str | None = None
) -> T:
    """Rank 0 runs ``act`` and ``broadcast`` shares the outcome: its result on every rank, or its failure,
    raised on rank 0 as itself and on the others rebuilt as the same class (:func:`raise_agreed`)."""
    own: BaseException | None = None
    verdict: Any = None
    if rank == 0:
        try:
            verdict = ("ok", act())
        except BaseException as e:  # every rank must learn of it, or the others wait for a result
            own = typed_failure(e, rank, where)
            verdict = ("failed", [failure_record(own, rank)])
    kind, payload = broadcast(verdict)
    if kind == "failed":
        raise_agreed(payload, own, what, rank=rank)
    result: T = payload
    return result


def ordered_failures(records: Sequence[FailureRecord | None]) -> list[FailureRecord]:
    """Failures with their ranks filled in, earliest first (the first is most likely the cause)."""
    found = [replace(f, rank=r) for r, f in enumerate(records) if f is not None]
    return sorted(found, key=lambda f: (f.at, f.rank))


def failure_message(failures: Sequence[FailureRecord], what: str) -> str:
    first = failures[0]
    if first.decision:
        return first.describe()
    text = f"rank {first.rank} on {first.host} could not {what}: {first.describe()}"
    if len(failures) > 1:
        others = ", ".join(str(f.rank) for f in failures[1:6])
        more = "..." if len(failures) > 6 else ""
        text += f" (also failed: ranks {others}{more})"
    return text


def with_suffix(message: str, suffix: str) -> str:
    if not suffix:
        return message
    return message + ("" if message.rstrip().endswith((".", "!", "?")) else ".") + suffix


_AGREED = "_ckptguard_agreed"


def was_agreed(err: BaseException) -> bool:
    """Whether ``err`` was raised by an agreement (Comm.step): every rank raised at that same point."""
    return getattr(err, _AGREED, False) is True


def raise_agreed(
    failures: list[FailureRecord], own: BaseException | None, what: str, suffix: str = "", rank: int | None = None
) -> None:
    """Raise the agreed failure: this rank's own error if it failed, else the first one, rebuilt.

    A rank whose own failure was not the first says which was (its error may only be a
    consequence, e.g. a disk another rank filled first)."""
    if own is not None:
        first = failures[0]
        extra = ""
        if rank is not None and first.rank != rank and not first.decision:
            extra = f" (rank {first.rank} on {first.host} failed first: {first.describe()})"
        if isinstance(own, CheckpointError):
            own.args = (with_suffix(str(own) + extra, suffix), *own.args[1:])
        elif isinstance(own, Exception) and (suffix or extra):
            own.add_note((extra.strip() + " " + suffix.strip()).strip())
        setattr(own, _FAILURES_ATTR, failures)
        raise own
    first = failures[0]
    cls = first.error_class
    if first.interrupted:
        message = f"rank {first.rank} on {first.host} was interrupted ({first.kind}) while it tried to {what}"
    else:
        message = failure_message(failures, what)
    err = cls(with_suffix(message, suffix), rank=first.rank, path=first.path)
    setattr(err, _FAILURES_ATTR, failures)
    raise err


def agreed_failures(err: BaseException) -> list[FailureRecord]:
    """The failures every rank agreed on, for an error raised by :meth:`Comm.step` (else [])."""
    found: list[FailureRecord] = getattr(err, _FAILURES_ATTR, [])
    return found


def default_comm(group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Comm:
    """All ranks of ``group`` (default: the world) through gloo, or one rank without a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return Comm(TorchTransport(group, timeout_s))
    return Comm(LocalTransport())


# -- the frameworks' own group ---------------------------------------------------------------
# Integrations run inside a framework's collective schedule (Trainer, Accelerate, DeepSpeed) and
# share a decision of rank 0 with the others in the framework's default group; they call these,
# so that collectives stay in this module.


def world_broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank of the default process group (``value`` without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def world_one_rank_acts(what: str, act: Callable[[], T], *, where: str | None = None) -> T:
    """Rank 0 of the default process group runs ``act``; every rank gets its result, or raises its
    failure as the same class (``act()`` alone without a process group); collective."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return rank0_outcome(rank, world_broadcast, what, act, where)


def world_all_gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank of the default process group (``[value]`` without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def world_barrier() -> None:
    """A barrier of the default process group (nothing without one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
