"""The ``RESULT {json}`` line: how a test worker reports an observation to the test that started it.

A worker prints one line per observation, ``RESULT `` followed by a JSON object, flushed at
once (a worker SIGKILLed right after still leaves the line in its log). The test reads each
rank's complete log after the job (:meth:`JobResult.rank_output`, not the console tail)
and parses the lines back. This module is the only place that writes or reads that format;
workers (``tests/workers/*.py``) import it, so it imports nothing but the standard library.
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .jobs import JobResult

PREFIX = "RESULT "
_LINE = re.compile(r"^RESULT (\{.*\})$", re.M)


def emit_result(**fields: Any) -> None:
    """Print one observation. ``rank`` defaults to this worker's global rank (torchrun's ``RANK``)."""
    record = {"rank": int(os.environ.get("RANK", "0")), **fields}
    print(PREFIX + json.dumps(record), flush=True)


def parse_results(text: str) -> list[dict[str, Any]]:
    """Every RESULT line in ``text``, in order. A line cut short (a SIGKILL mid-print) is skipped."""
    out = []
    for m in _LINE.finditer(text):
        try:
            record = json.loads(m.group(1))
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def results_by_rank(job: JobResult, world: int) -> dict[int, list[dict[str, Any]]]:
    """Rank -> that rank's RESULT lines (an empty list for a rank that printed none)."""
    return {r: parse_results(job.rank_output(r)) for r in range(world)}


def job_results(job: JobResult) -> list[dict[str, Any]]:
    """Every RESULT line of every rank of ``job``, rank by rank."""
    return [rec for agent in job.agents for log in agent.worker_logs.values() for rec in parse_results(log)]


def by_rank(job: JobResult, key: str) -> dict[int, Any]:
    """Rank -> the value of ``key`` in the (last) RESULT line of that rank holding it."""
    return {r["rank"]: r[key] for r in job_results(job) if key in r}
