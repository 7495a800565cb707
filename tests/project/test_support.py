"""What tests and tools share (tests/support): the RESULT line, the campaign's phases, the import direction."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptguard._faults import FaultPhase

from tests.support import campaign
from tests.support.jobs import REPO
from tests.support.results import emit_result, parse_results


def test_result_lines_round_trip_and_a_cut_line_is_skipped(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "3")
    emit_result(event="saved", step=7, committed=[5, 6, 7])
    emit_result(rank=1, note="RESULT {not this}")
    log = capsys.readouterr().out
    log += 'RESULT {"event": "saving", "st'  # SIGKILL in the middle of a print: no newline, no closing brace
    log += '\nRESULT [1, 2]\nnoise RESULT {"x": 1}\nRESULT {"rank": 0, "broken": }\n'
    assert parse_results(log) == [
        {"rank": 3, "event": "saved", "step": 7, "committed": [5, 6, 7]},
        {"rank": 1, "note": "RESULT {not this}"},
    ]
    assert json.loads(log.splitlines()[0].removeprefix("RESULT "))["rank"] == 3


def test_campaign_phases_are_the_library_fault_points(tmp_path: Path) -> None:
    """The campaign kills at every fault point the library has, leader-only ones at a leader."""
    assert set(campaign.SAVE_PHASES) | set(campaign.LOAD_PHASES) == set(FaultPhase)
    assert not set(campaign.SAVE_PHASES) & set(campaign.LOAD_PHASES)
    assert set(campaign.SAVE_PHASES) >= campaign.LEADER_PHASES
    assert campaign.SAVE_PHASES[0] is FaultPhase.SAVE_START  # cycled in the order a save passes them
    c = campaign.Campaign(tmp_path, seed=0, log=lambda _: None)
    topo = campaign.Topo("local", 2, 2, [Path("/a"), Path("/b")], [Path("/a"), Path("/b")], (0, 2))
    for i, phase in enumerate(campaign.SAVE_PHASES):
        sub, spec = c._fault("kill_phase", i, topo)
        kind, name, rank = spec.split(":")
        assert (sub, kind, name) == (phase.value, "phase", phase.value)
        assert phase not in campaign.LEADER_PHASES or int(rank) in topo.leaders


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_tests_never_depend_on_tools() -> None:
    """Tools may use tests/support; nothing under tests/ imports tools/ or loads a file from it."""
    offenders = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path == Path(__file__).resolve():
            continue
        mods = _imports(path)
        loads_a_tool = any(
            "spec_from_file_location" in line and any(d in line for d in ("tools", "bench", "examples"))
            for line in path.read_text().splitlines()
        )
        if any(m.split(".")[0] in ("tools", "bench", "examples") for m in mods) or loads_a_tool:
            offenders.append(str(path.relative_to(REPO)))
        if path.is_relative_to(REPO / "tests" / "support"):
            outside = [m for m in mods if m.startswith("tests.") and not m.startswith("tests.support")]
            if outside:
                offenders.append(f"{path.relative_to(REPO)} imports {outside}")
    assert not offenders, offenders


def test_campaign_command_line_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "tools/campaign.py", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--trials" in proc.stdout and "kill_phase" in proc.stdout
