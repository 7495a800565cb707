"""Which checkpoint a load reads: the one asked for, or the newest intact one, falling back past
corrupt ones (quarantined so that later loads skip them) and listing again when retention retires
what is being read (collective throughout: every rank takes the same branch).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import TypeVar

from ckptguard.comm import agreed_failures
from ckptguard.errors import (
    CheckpointError,
    CorruptCheckpointError,
    ReplicatedValueError,
    StepNotFoundError,
    StepRetiredError,
    TornLoadError,
)
from ckptguard.protocol.decisions import DomainListing, Listing, agreed_listing, commit_order, quarantined_steps
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.quarantine import QuarantineRecord
from ckptguard.protocol.session import Session

log = logging.getLogger("ckptguard")

T = TypeVar("T")


def falls_back(err: BaseException) -> bool:
    """Whether a failed load may try an older checkpoint: decided from what every rank agreed on,
    so that all ranks take the same branch (never on an interrupt)."""
    failures = agreed_failures(err)
    if not failures or any(f.interrupted for f in failures):
        return False
    return any(issubclass(f.error_class, CorruptCheckpointError) for f in failures)


#: How many times load(step=None) lists the root again when what it reads is retired under it.
_RELISTS = 8


def first_intact(
    session: Session, step: int | None, attempt: Callable[[CheckpointName, int | None], T]
) -> tuple[int | None, T | None, Listing]:
    """Run ``attempt`` (a load or a read, collective) on ``step``, or on the checkpoint committed last
    and, while that one turns out corrupt, the ones committed before it; the step it succeeded on
    (None if nothing is committed), its result, and the agreed listing it was chosen from.

    A checkpoint retired under the reader (a writer's retention) is not corrupt: ``step=None``
    lists the root again, ``step=N`` raises StepRetiredError.
    """
    errors: list[str] = []
    corrupt: set[tuple[int, int]] = set()
    for _ in range(_RELISTS):
        current, quarantined = agreed_current_and_quarantined(session, step)
        if step is not None:
            if step not in current:
                raise StepNotFoundError(
                    f"step {step} is not a committed checkpoint in {session.url}; committed steps: "
                    f"{commit_order(current) or 'none'}"
                )
            candidates = [step]  # asked for by number: read again, quarantined or not
        else:
            candidates = [
                s
                for s in reversed(commit_order(current))
                if (s, current[s].version) not in corrupt and s not in quarantined
            ]
        retired = False
        for s in candidates:
            name = CheckpointName(s, current[s].version)
            try:
                result = attempt(name, current[s].seq)
            except BaseException as e:
                failures = agreed_failures(e)
                if not failures or any(f.interrupted for f in failures):
                    raise
                if any(issubclass(f.error_class, TornLoadError) for f in failures):
                    raise  # the state may hold part of it: neither retired nor corrupt, whatever else
                # Every rank failed at the same agreement: ask whether the checkpoint is still there.
                if _was_retired(session, name, current[s].seq):
                    if step is not None:
                        raise StepRetiredError(
                            f"step {step} was retired while this job was reading it (the job writing to "
                            f"{session.url} deleted it under its retention policy); nothing of it was "
                            "loaded. Load a step that is kept, or load(step=None) for the newest.",
                            path=session.root.dir(name),
                        ) from e
                    retired = True
                    break
                if not falls_back(e):
                    raise
                _quarantine(session, name, current[s].seq, e)
                if step is not None:
                    raise
                corrupt.add((s, name.version))
                errors.append(f"step {s}: {e}")
                if session.comm.rank == 0:
                    warnings.warn(
                        f"ckptguard: checkpoint step {s} in {session.url} is corrupt ({e}); "
                        "falling back to the previous committed checkpoint",
                        stacklevel=4,
                    )
                continue
            if step is None and session.comm.rank == 0:
                order = commit_order(current)
                for q in order[order.index(s) + 1 :]:
                    if q in quarantined:
                        warnings.warn(
                            f"ckptguard: checkpoint step {q} in {session.url} is corrupt (quarantined: "
                            f"{quarantined[q]}); skipped without reading it again, step {s} loaded. The "
                            f"next save of step {q} replaces it.",
                            stacklevel=4,
                        )
            return s, result, current
        if not retired:
            errors.extend(
                f"step {s}: quarantined ({reason})" for s, reason in sorted(quarantined.items()) if step is None
            )
            if errors:
                raise CorruptCheckpointError(
                    f"every committed checkpoint in {session.url} is corrupt: " + "; ".join(errors)
                )
            return None, None, current
        log.info("ckptguard: a checkpoint in %s was retired while being read; listing again", session.url)
    raise StepRetiredError(
        f"the checkpoints of {session.url} were retired faster than this job could read "
        f"them ({_RELISTS} tries): is a writer saving with keep_last=1 in a tight loop?"
    )


_View = tuple[int | None, DomainListing | None, dict[CheckpointName, QuarantineRecord] | None]


def agreed_current_and_quarantined(session: Session, step: int | None = None) -> tuple[Listing, dict[int, str]]:
    """The agreed listing (as ``save.agreed_current``), and of its steps those quarantined in some storage
    domain, with the reason recorded (collective: one agreement, the listing's own). Every rank must ask
    for the same ``step`` (ReplicatedValueError naming the rank that does not: each would read another)."""

    def look() -> _View:
        if not session.topo.is_leader:
            return step, None, None
        return step, session.root.listing(), session.root.quarantined()

    def decide(views: list[_View]) -> tuple[Listing, dict[int, str]]:
        other = next((r for r, v in enumerate(views) if v[0] != views[0][0]), None)
        if other is not None:
            raise ReplicatedValueError(
                f"load() was asked for step={views[0][0]} on rank 0 and step={views[other][0]} on rank {other}: "
                "every rank must load the same step. Nothing was loaded.",
                rank=other,
            )
        listing = agreed_listing([v[1] for v in views if v[1] is not None])
        return listing, quarantined_steps(listing, [v[2] for v in views if v[2] is not None])

    agreed: tuple[Listing, dict[int, str]] = session.comm.step(f"list the checkpoints in {session.url}", look, decide)
    return agreed


def _quarantine(session: Session, name: CheckpointName, seq: int | None, err: BaseException) -> None:
    """Record that the commit ``name`` is corrupt, so that listings skip it and the next save of its step
    replaces it (collective; a writing job's leaders, under the fence). A read-only job writes nothing;
    a record that cannot be written costs only the next load a read of the checkpoint."""
    if session.holder is None:
        return

    def record() -> None:
        if session.topo.is_leader:
            session.root.quarantine(name, seq, str(err))

    try:
        session.comm.step(f"quarantine {name.dirname} in {session.url}", record, where=session.url)
    except (OSError, CheckpointError) as e:
        log.warning("ckptguard: could not record %s in %s as corrupt: %s", name.dirname, session.url, e)


def _was_retired(session: Session, name: CheckpointName, seq: int | None) -> bool:
    """Whether ``name`` is gone from some storage domain, or was saved again since it was listed with
    ``seq`` (collective; the leaders look)."""

    def look() -> bool | None:
        if not session.topo.is_leader:
            return None
        return session.root.still_committed(name, seq)

    gone: bool = session.comm.step(
        f"look for {name.dirname} in {session.url}", look, lambda seen: any(x is False for x in seen), where=session.url
    )
    return gone
