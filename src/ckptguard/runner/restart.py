"""`ckptguard run --max-restarts`: restart only what a restart can cure.

Each knowledge-base class declares in its ``[restart]`` table whether a failure of that class is
transient (a network or rendezvous failure, a lost process or node, preemption, a hang) or
deterministic (an exception in the code, out of memory, a state-dict mismatch, a corrupt
checkpoint, permissions, a full disk), and why. ``--restart-on CLASS,...`` makes more classes
transient. The same failure twice in a row with no new committed step in between is
deterministic, whatever its class: the job is not getting anywhere.

On several nodes the decision is made once for the job: the first runner to decide writes it to
``.restart_<job>_<attempt>.json`` in the shared log directory (created exclusively), and the
others follow it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from ckptguard.errors import CheckpointError
from ckptguard.files import read_json

if TYPE_CHECKING:
    from ckptguard.diagnose.model import Diagnosis

#: The wait before a restart doubles each time (--restart-backoff), up to this.
MAX_BACKOFF_S = 120.0


class _Attempt(Protocol):
    failure: str | None
    resumed_from: int | None
    reached: int | None


def decide(
    diag: Diagnosis | None, attempts: Sequence[_Attempt], restart_on: Sequence[str], budget_left: bool
) -> tuple[bool, str]:
    """Whether to run the command again after the last of ``attempts`` failed, and why (a sentence
    that says what to fix when the answer is no)."""
    from ckptguard.diagnose.kb import load_kb

    if diag is None or not diag.found or not diag.kind:
        return False, "the failure was not diagnosed, and an unknown failure is not retried blindly"
    kb = load_kb()
    cls = diag.kind
    fc = kb.classes.get(cls)
    named = cls in restart_on or (diag.failure_class or "") in restart_on
    if fc is None and not named:
        return False, f"{cls} is not a class of the knowledge base"
    if named:
        transient, why = True, f"{cls} is named by --restart-on"
    else:
        assert fc is not None
        transient, why = fc.restart.transient, fc.restart.why
        if fc.unproven is not None and fc.restart.unproven_transient is not None and diag.title == fc.unproven.title:
            transient = fc.restart.unproven_transient
            why = "the log shows no sign of the class's cause (an unproven kill): treated as a lost process"
    if not transient:
        return False, f"{cls} is deterministic: {why}. Fix: {' '.join(diag.fix.split())}"
    if len(attempts) >= 2:
        last, before = attempts[-1], attempts[-2]
        if last.failure == before.failure and last.reached == before.reached:
            return False, (
                f"{cls} twice in a row with no new committed step in between (step "
                f"{last.reached}): deterministic, not transient"
            )
    if not budget_left:
        return False, f"{cls} is transient ({why}), but --max-restarts is used up"
    return True, f"{cls} is transient: {why}"


def agree(logs: str, job_id: str | None, attempt: int, again: bool, why: str, wait_s: float) -> tuple[bool, str]:
    """The job's one decision after ``attempt``: ours if we are the first node to decide (or the
    job has no id to share it under), else the first node's."""
    if job_id is None:
        return again, why
    path = os.path.join(logs, f".restart_{re.sub(r'[^A-Za-z0-9_.=-]', '_', job_id)}_{attempt}.json")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        deadline = time.monotonic() + wait_s
        while True:
            with contextlib.suppress(OSError, CheckpointError):  # not written in full yet: read it again
                data = read_json(path, "restart decision")
                if isinstance(data, dict) and isinstance(data.get("restart"), bool):
                    return data["restart"], f"{data.get('why', '')} (decided by {data.get('host', 'another node')})"
            if time.monotonic() >= deadline:
                return again, why
            time.sleep(0.1)
    except OSError:
        return again, why
    import socket

    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"restart": again, "why": why, "host": socket.gethostname(), "pid": os.getpid()}, f)
    return again, why
