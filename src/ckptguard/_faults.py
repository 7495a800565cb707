"""Fault injection for crash-consistency tests.

``CKPTGUARD_FAULT="phase:rank[:action]"`` (several separated by commas) makes the
named rank act at the named phase of the protocol: ``kill`` (SIGKILL itself, the
default), ``raise`` (an OSError), ``sleep`` (hang for 3600 s), ``stop`` (SIGSTOP
itself, every thread with it, as a frozen node: a test resumes it with SIGCONT), or
``interrupt`` (SIGINT itself: a Ctrl-C, handled by Python right after the point). ``rank`` may be
``*`` for every rank. The variable is read once; outside tests it is unset and
each fault point costs one dict lookup.
"""

from __future__ import annotations

import os
import signal
import time
from enum import StrEnum


class FaultPhase(StrEnum):
    """Points of the protocol where a test can crash a rank (the library and the campaign share them)."""

    SAVE_START = "save_start"  # a save begins, before anything is written
    BEFORE_WRITE = "before_write"  # staging directory exists, this rank has written nothing
    MID_WRITE = "mid_write"  # this rank has written part of its data
    AFTER_WRITE = "after_write"  # this rank's data is written and fsynced, commit not started
    BEFORE_PUBLISH = "before_publish"  # leader: manifest written, staging not yet renamed
    AFTER_PUBLISH = "after_publish"  # leader: renamed into place, `latest` not yet moved
    AFTER_COMMIT = "after_commit"  # every domain published, retention not yet run
    MID_LOAD = "mid_load"  # a load has read part of the data
    AFTER_PLACE = "after_place"  # a load has put this rank's bytes in place, not yet its objects


PHASES = tuple(p.value for p in FaultPhase)


def _parse(spec: str) -> dict[tuple[str, str], str]:
    faults: dict[tuple[str, str], str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        fields = part.split(":")
        if len(fields) < 2 or fields[0] not in PHASES:
            raise ValueError(f"CKPTGUARD_FAULT: cannot parse {part!r}; phases are {', '.join(PHASES)}")
        faults[(fields[0], fields[1])] = fields[2] if len(fields) > 2 else "kill"
    return faults


_FAULTS = _parse(os.environ.get("CKPTGUARD_FAULT", ""))


def arm(spec: str) -> None:
    """Replace the configured faults (tests use it to crash at a chosen save, not the first)."""
    _FAULTS.clear()
    _FAULTS.update(_parse(spec))


def fault_point(phase: FaultPhase, rank: int) -> None:
    """Act out an injected fault for ``phase`` on ``rank``, if one is configured."""
    if not _FAULTS:
        return
    action = _FAULTS.get((phase.value, str(rank))) or _FAULTS.get((phase.value, "*"))
    if action is None:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "raise":
        raise OSError(f"injected fault at {phase} on rank {rank}")
    elif action == "sleep":
        time.sleep(3600)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "interrupt":
        os.kill(os.getpid(), signal.SIGINT)
