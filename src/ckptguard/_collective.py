"""The guard of a Checkpointer's collective calls: refused once this rank's calls are out of step.

A Ctrl-C (or another exception that is not an Exception) that ends a collective call on one rank at a
point the other ranks did not agree on leaves them inside it: the next collective here would pair
with a different one there (a load's with a save's: a hang, or another call's answers). From then on
every collective call of that Checkpointer on this rank is refused, naming why.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ckptguard.comm import Comm, was_agreed
from ckptguard.errors import CheckpointError


class CollectiveOwner(Protocol):
    """What the guard reads off the object whose methods it wraps."""

    _comm: Comm
    _out_of_step: str | None
    _pid: int

    @property
    def root(self) -> str: ...


_Method = TypeVar("_Method", bound=Callable[..., Any])


def refuse_in_a_forked_child(owner: CollectiveOwner, call: str) -> None:
    """Raise CheckpointError in a child forked from the process that made ``owner``.

    The child shares the object but none of its threads: its collective calls would rewrite the lease
    with the child's pid (another job then takes the root over once the child exits) and its waits for
    the parent's background work would never end.
    """
    if os.getpid() != owner._pid:
        raise CheckpointError(
            f"{call}(): this Checkpointer on {owner.root} was made by process {owner._pid}; process "
            f"{os.getpid()} is a child forked from it and may not use it (the lease and the saves in "
            "flight are the parent's). Open a Checkpointer of its own in the child (on another root: "
            "this one is held), or use it in the parent only.",
            path=owner.root,
        )


def collective(only_with: str | None = None) -> Callable[[_Method], _Method]:
    """Mark a method as a collective call (only when its keyword ``only_with`` is true, if given)."""

    def wrap(method: _Method) -> _Method:
        @functools.wraps(method)
        def call(self: CollectiveOwner, *args: Any, **kwargs: Any) -> Any:
            if only_with is not None and not kwargs.get(only_with):
                return method(self, *args, **kwargs)
            refuse_in_a_forked_child(self, method.__name__)
            if self._out_of_step is not None:
                raise CheckpointError(self._out_of_step, rank=self._comm.rank)
            try:
                return method(self, *args, **kwargs)
            except BaseException as e:
                if not isinstance(e, Exception) and self._comm.world_size > 1 and not was_agreed(e):
                    self._out_of_step = (
                        f"rank {self._comm.rank}: a {type(e).__name__} ended {method.__name__}() on this rank "
                        "at a point the other ranks did not agree on; they may still be inside it, so this "
                        "Checkpointer's ranks are out of step (its next collective would pair with a different "
                        "one on another rank). The others raise PeerError within collective_timeout_s. Create "
                        "a new Checkpointer on every rank, or end the job."
                    )
                raise

        return call  # type: ignore[return-value]

    return wrap
