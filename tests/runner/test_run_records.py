"""A run.json of any shape never costs the whole job's diagnosis (`diagnose DIR`, every node's `run`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ckptguard.cli import _register, app
from ckptguard.runner import logdir, report

_register()

FIELDS = [
    "host",
    "pid",
    "command",
    "job_id",
    "cwd",
    "started_at",
    "ended_at",
    "exit_status",
    "attempt",
    "signals_forwarded",
    "error",
    "report_json",
    "report_html",
    "hang_detected_at",
    "hang_timeout_s",
    "attempts",
]
LOG = 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nValueError: bad label at step 7\n'
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


def _good(started: float) -> dict[str, Any]:
    return {
        "host": "node0",
        "pid": 12,
        "command": ["python", "train.py"],
        "job_id": None,
        "cwd": "/",
        "started_at": started,
        "ended_at": started + 5,
        "exit_status": 1,
        "attempt": 1,
        "signals_forwarded": [],
        "attempts": [],
    }


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, min_size=1, max_size=4))
def test_a_run_json_with_fields_of_any_type_keeps_the_diagnosis(tmp_path_factory: Any, bad: dict[str, Any]) -> None:
    logs = tmp_path_factory.mktemp("logs")
    for i, node in enumerate(("node0", "node1")):
        d = logs / f"20261207-000000_{node}_{i}"
        d.mkdir()
        (d / "stderr.log").write_text(LOG if i == 1 else "")
        record = _good(1_700_000_000.0) | {"host": node}
        if i == 0:
            record |= bad  # one node's record is damaged, the other's holds the failure
        (d / "run.json").write_text(json.dumps(record))
    failed = next(logs.glob("*_node1_*"))
    found = logdir.runs_for_path(str(failed))  # the failed node's job: the damaged node's run or not
    assert found is not None
    runs = found[0]
    for r in runs:  # what is read back has the declared types
        assert isinstance(r.host, str) and isinstance(r.started, float) and isinstance(r.attempt, int)
    diag = report.diagnose_runs(runs)
    assert diag.found and diag.failure_class == "python_exception"
    report.job_json(diag, None, runs)
    for path in (failed, logs):  # the job of a run, and the job that started last in the directory
        res = CliRunner().invoke(app, ["diagnose", str(path), "--json"])
        assert res.exit_code != 2, res.output
        if path == failed:
            assert "python_exception" in res.output


def test_a_field_of_the_wrong_type_is_named_in_a_note(tmp_path: Path) -> None:
    d = tmp_path / "20261207-000000_node0_1"
    d.mkdir()
    (d / "stderr.log").write_text(LOG)
    (d / "run.json").write_text(
        json.dumps(_good(1_700_000_000.0) | {"started_at": "yesterday", "signals_forwarded": 15})
    )
    found = logdir.runs_for_path(str(tmp_path))
    assert found is not None
    diag = report.diagnose_runs(found[0])
    notes = " ".join(diag.notes)
    assert "'started_at' ignored" in notes and "'signals_forwarded' ignored" in notes
