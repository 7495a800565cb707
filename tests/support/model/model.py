"""What must be true of a root, whatever the jobs did: the model the state machine checks against.

Each step is *live* (committed, not retired: it must be listed and load bitwise-equal to its
digest), *maybe* (an action of unknown outcome touched it: a save killed, stalled or failed under
a fault, a retention that may have retired it; the set says which digests, or ``None`` for
absent, are acceptable), or absent (must not be listed). An audit of the root turns every
*maybe* into what the root shows, once nothing can still change it legitimately.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Absent = None


@dataclass
class Model:
    live: dict[int, str] = field(default_factory=dict)
    maybe: dict[int, set[str | None]] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)  # commit order of live steps (steps() order)
    history: dict[int, set[str]] = field(default_factory=dict)  # every digest a step may ever have held
    tags: dict[str, int] = field(default_factory=dict)
    tags_unknown: set[str] = field(default_factory=set)
    retention_floor: int | None = None  # retention keeps at least this many listed steps
    # (step, digest, who, writes): a fenced job's save that reported success must be live, unless the
    # holder wrote the step since (writes(step) moved on: an overwrite, a delete, a retention may replace it)
    claims: list[tuple[int, str, str, int]] = field(default_factory=list)
    _writes: dict[int, int] = field(default_factory=dict)  # per step: how many holder writes touched it

    # -- what may be there ---------------------------------------------------------------------
    def possible(self, step: int) -> set[str | None]:
        if step in self.live:
            return {self.live[step]}
        return set(self.maybe.get(step, {Absent}))

    def steps_known(self) -> set[int]:
        return set(self.live) | set(self.maybe)

    @property
    def certain(self) -> bool:
        return not self.maybe and not self.tags_unknown

    def tagged(self) -> set[int]:
        return set(self.tags.values())

    def writes(self, step: int) -> int:
        """How many holder writes have touched ``step`` so far (a claim compares it with its own)."""
        return self._writes.get(step, 0)

    def claim(self, step: int, digest: str, who: str, writes: int) -> None:
        """``who`` reported success saving ``digest`` as ``step`` when the step's write count was
        ``writes``: the next audit checks it, unless a holder write touched the step since."""
        self.claims.append((step, digest, who, writes))

    def _touch(self, step: int) -> None:
        self._writes[step] = self.writes(step) + 1

    # -- effects ---------------------------------------------------------------------------------
    def commit(self, step: int, digest: str) -> None:
        self._touch(step)
        self.maybe.pop(step, None)
        self.live[step] = digest
        self.history.setdefault(step, set()).add(digest)
        if step in self.order:
            self.order.remove(step)
        self.order.append(step)

    def unsure(self, step: int, *outcomes: str | None) -> None:
        """``step`` may now hold any of ``outcomes`` besides what it may hold already."""
        allowed = self.possible(step) | set(outcomes)
        self._touch(step)
        self.live.pop(step, None)
        self.maybe[step] = allowed
        for d in outcomes:
            if d is not None:
                self.history.setdefault(step, set()).add(d)

    def retire_candidates(self, new_step: int, keep_last: int) -> None:
        """After a save with keep_last: every untagged older step may be retired (which ones depends
        on commit order and rolled-back branches); at least ``keep_last`` steps stay listed."""
        known = self.steps_known() | {new_step}
        protected = self.tagged() | {new_step}
        for s in known - protected:
            self.unsure(s, Absent)
        certain_before = len(set(self.live) | {new_step})
        self.retention_floor = min(keep_last, certain_before)

    def delete(self, step: int) -> None:
        self._touch(step)
        self.live.pop(step, None)
        self.maybe.pop(step, None)
        if step in self.order:
            self.order.remove(step)
        self.retention_floor = None

    # -- the audit ---------------------------------------------------------------------------------
    def audit(self, listed: list[int], tags: dict[str, int], read: Callable[[int], str | None]) -> list[str]:
        """Compare a root (its steps in commit order, its tags, a reader of one step's digest) with the
        model; resolve every *maybe*; return the violations (empty: the root is as the model allows)."""
        bad: list[str] = []
        listed_set = set(listed)
        for step, digest in sorted(self.live.items()):
            if step not in listed_set:
                bad.append(f"committed step {step} is missing from the listing {listed}")
                continue
            got = read(step)
            if got != digest:
                bad.append(f"committed step {step} does not load as saved: {_what(got)} instead of {digest[:12]}")
        resolved = False
        for step in listed:
            if step in self.live:
                continue
            allowed = self.maybe.get(step, {Absent})
            got = read(step)
            if got is None or got not in allowed:
                why = "was never committed" if allowed == {Absent} else f"may hold only {_names(allowed)}"
                bad.append(f"step {step} is listed and reads as {_what(got)}, but it {why}")
            if got is not None:
                self.maybe.pop(step, None)
                self.live[step] = got
                resolved = True
        for step in list(self.maybe):
            if step not in listed_set:
                if Absent not in self.maybe[step]:
                    bad.append(f"step {step} is missing; it may hold only {_names(self.maybe[step])}")
                del self.maybe[step]
                resolved = True
        if resolved or set(self.order) != listed_set:
            self.order = list(listed)
        if self.retention_floor is not None and len(listed) < self.retention_floor:
            bad.append(f"retention left {len(listed)} steps {listed}, fewer than keep_last={self.retention_floor}")
        self.retention_floor = None
        for name in sorted(set(self.tags) | set(tags)):
            if name in self.tags_unknown:
                continue
            if self.tags.get(name) != tags.get(name):
                bad.append(f"tag {name!r} names step {tags.get(name)}, the model says {self.tags.get(name)}")
        self.tags = dict(tags)
        self.tags_unknown.clear()
        for name, step in tags.items():
            if step not in listed_set:
                bad.append(f"tag {name!r} names step {step}, which is not listed {listed}")
        for step, digest, who, writes in self.claims:
            if self.writes(step) == writes and self.live.get(step) != digest:
                bad.append(
                    f"{who} reported success, but step {step} does not hold what it saved "
                    f"({_names(self.possible(step))})"
                )
        self.claims.clear()
        return bad


def _what(digest: str | None) -> str:
    return "nothing (unreadable)" if digest is None else digest[:12]


def _names(allowed: set[str | None]) -> str:
    return "{" + ", ".join(sorted("absent" if d is None else d[:12] for d in allowed)) + "}"
