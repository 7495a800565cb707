"""Power loss: every crash state of the disk loads the old or the new checkpoint.

A real 2-rank save runs on the recording FUSE file system (tests/support/beds/powerloss); its
operations are replayed into the disk states a power cut may leave, under crash models A
(ext4 data=ordered-like) and B (only what an fsync covers survives), and each state is
loaded with a read_only Checkpointer (docs/crash-consistency.md, docs/testbeds.md).

CI explores ``CKPTGUARD_POWERLOSS_STATES`` (default 24) distinct states per scenario and
model; the long tier (``pytest -m long``) explores ``LONG_STATES`` with another seed, and
tests/support/beds/powerloss/explorer.py as many as asked.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.beds.powerloss.bed import Recording, recording_mount, unavailable_reason
from tests.support.beds.powerloss.checker import Checker
from tests.support.beds.powerloss.explorer import check_built, explore, record, tmpfs_base
from tests.support.beds.powerloss.model import Choice, CrashModel
from tests.support.beds.powerloss.scenarios import SCENARIOS

_REASON = unavailable_reason()
pytestmark = [
    pytest.mark.powerloss,
    pytest.mark.skipif(_REASON is not None, reason=f"power-loss bed unavailable: {_REASON}"),
]

STATES = int(os.environ.get("CKPTGUARD_POWERLOSS_STATES", "24"))
LONG_STATES = 200
_recordings: dict[tuple[str, str | None], Recording] = {}
_explored: dict[tuple[str, str], int] = {}  # (scenario, model) -> distinct crash states checked


def recording(name: str, broken: str | None = None) -> Recording:
    """One recording per scenario (and broken variant) per test session: recording costs ~7 s."""
    key = (name, broken)
    if key not in _recordings:
        _recordings[key] = record(SCENARIOS[name], world=2, broken=broken)
    return _recordings[key]


@pytest.fixture(scope="module")
def checker() -> Iterator[Checker]:
    with Checker(2) as c:
        yield c


def _after_commit_minimal(rec: Recording) -> tuple[CrashModel, Choice]:
    """Model B, power cut right after the first rank's save() returned, only fsync-covered operations
    on disk, unsynced data lost: the harshest state in which the new checkpoint must be there."""
    cm = CrashModel(rec)
    k = min(cm.marks("committed")) + 1
    covered, _ = cm.b_uncovered(k)
    return cm, Choice("B", k, frozenset(covered), "synced")


# -- the CI slice: every scenario, both models ---------------------------------------------------------


def _explore_both_models(scenario: str, checker: Checker, states: int, seed: int, *, ci: bool = True) -> None:
    rec = recording(scenario)
    for model in ("A", "B"):
        res = explore(SCENARIOS[scenario], rec, model, states, checker, seed=seed)
        if ci:
            _explored[(scenario, model)] = res.states
        print(
            f"{scenario} model {model}: {len(rec.ops)} operations, {res.states} crash states, "
            f"{res.verified} verify runs, {len(res.violations)} violations, {res.seconds:.1f} s"
        )
        assert res.states >= min(states, 15), f"only {res.states} distinct states explored"
        assert not res.violations, "\n".join(v.describe() for v in res.violations[:10])


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_crash_state_loads_old_or_new(scenario: str, checker: Checker) -> None:
    _explore_both_models(scenario, checker, STATES, seed=12)


@pytest.mark.long
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_crash_state_loads_old_or_new_long(scenario: str, checker: Checker) -> None:
    """The long tier: more crash states of every scenario, drawn with another seed."""
    _explore_both_models(scenario, checker, LONG_STATES, seed=13, ci=False)


def test_ci_slice_explores_a_few_hundred_states() -> None:
    if len(_explored) < 2 * len(SCENARIOS):
        pytest.skip("runs after the whole slice only")
    total = sum(_explored.values())
    assert total >= min(300, 12 * STATES), f"the slice explored only {total} crash states: {_explored}"


# -- regressions: crash states that showed library bugs ---------------------------------------------


def test_files_artifact_directories_survive_a_power_cut_after_save(checker: Checker) -> None:
    """Found by this bed (model B): artifacts.store() created files/rankNNNNN and files/rankNNNNN/<key>
    with os.makedirs and never fsynced their parents, so after save() returned a power cut could
    drop both directory entries: the committed checkpoint lost every rank's files= artifacts and
    load fell back to the previous step."""
    rec = recording("files")
    cm, choice = _after_commit_minimal(rec)
    state = cm.build(choice)
    for rank in (0, 1):
        assert f"ckpt/step-00000002/files/rank0000{rank}/offload/sub/deep/c.txt" in state.files
    problems = check_built(SCENARIOS["files"], cm, state, checker, tmpfs_base(), do_verify=True)
    assert not problems, problems


def test_a_root_the_checkpointer_created_survives_a_power_cut_after_the_first_save(checker: Checker) -> None:
    """Found by this bed (model B): Checkpointer() created a missing root (and .ckptguard/) with
    os.makedirs and never fsynced the root's parent, so after the first save() returned a power
    cut could drop the root's directory entry: every checkpoint in it gone."""
    rec = recording("first_save")
    cm, choice = _after_commit_minimal(rec)
    state = cm.build(choice)
    assert "ckpt/step-00000001/MANIFEST.json" in state.files
    assert not check_built(SCENARIOS["first_save"], cm, state, checker, tmpfs_base(), do_verify=True)


def test_save_file_into_a_new_directory_survives_a_power_cut() -> None:
    """Found by this bed (model B): save_file() created a missing directory with os.makedirs and
    never fsynced its parent, so after save_file() returned a power cut could drop the directory
    and the file with it."""
    rec = recording("save_file_new")
    cm, choice = _after_commit_minimal(rec)
    state = cm.build(choice)
    assert "ckpt/new/dir/model.pt" in state.files
    assert not check_built(SCENARIOS["save_file_new"], cm, state, None, tmpfs_base(), do_verify=False)


# -- the bed is sharp: broken variants of the library are caught ---------------------------------------


@pytest.mark.parametrize(("broken", "model"), [("no_dir_fsync", "B"), ("no_file_fsync", "A")])
def test_a_library_without_fsyncs_is_caught(broken: str, model: str, checker: Checker) -> None:
    rec = recording("first_save", broken)
    res = explore(SCENARIOS["first_save"], rec, model, 400, checker, seed=3, stop_at_first=True)
    assert res.violations, f"{broken}: {res.states} states under model {model} and no violation"


def test_no_dir_fsync_loses_a_returned_save(checker: Checker) -> None:
    """Without directory fsyncs the publishing rename is not durable when save() returns."""
    rec = recording("first_save", "no_dir_fsync")
    cm, choice = _after_commit_minimal(rec)
    problems = check_built(SCENARIOS["first_save"], cm, cm.build(choice), checker, tmpfs_base(), do_verify=False)
    assert any("is lost, though committed" in p or "itself is gone" in p for p in problems), problems


# -- the recorder and the models themselves -----------------------------------------------------------


def test_recorder_sees_the_library_operations() -> None:
    ops = recording("first_save").ops
    kinds = {o["op"] for o in ops}
    assert {"mkdir", "create", "write", "fsync", "fsyncdir", "rename", "link", "unlink", "rmdir", "mark"} <= kinds
    # The publishing rename is renameat2(RENAME_NOREPLACE), passed through with its flag.
    assert any(o["op"] == "rename" and o["flags"] == 1 and o["dname"] == "step-00000001" for o in ops)


def test_mount_passes_rename_noreplace_and_unmounts_on_error() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    with pytest.raises(RuntimeError, match="boom"), recording_mount() as m:
        mp = str(m.mountpoint)
        for name in ("a", "b"):
            with open(os.path.join(mp, name), "w") as f:
                f.write(name)
        rc = libc.renameat2(-100, f"{mp}/a".encode(), -100, f"{mp}/b".encode(), 1)
        assert rc == -1 and ctypes.get_errno() == errno.EEXIST
        assert Path(mp, "b").read_text() == "b"
        proc = m.proc
        raise RuntimeError("boom")
    assert not os.path.ismount(mp)
    assert proc.poll() is not None
    assert f" {m.mountpoint} " not in subprocess.run(["mount"], capture_output=True, text=True).stdout


def _synthetic(ops: list[dict[str, object]], data: bytes) -> Recording:
    # root (1) holds dir d (2); the library is not involved: this tests the crash models only.
    return Recording(
        {"root": 1, "inodes": {"1": {"kind": "dir", "entries": {"d": 2}}, "2": {"kind": "dir", "entries": {}}}},
        ops,
        data,
    )


def test_models_fsync_of_a_file_does_not_persist_its_entry_under_b() -> None:
    rec = _synthetic(
        [
            {"op": "create", "parent": 2, "name": "f", "ino": 3},
            {"op": "write", "ino": 3, "off": 0, "blob": [0, 10]},
            {"op": "fsync", "ino": 3, "datasync": False},
        ],
        b"0123456789",
    )
    cm = CrashModel(rec)
    _, unc = cm.b_uncovered(3)
    assert unc == [0]  # the create is not covered by the file's fsync
    assert cm.a_min_prefix(3) == 1  # under A the fsync commits it (journal)
    gone = cm.build(Choice("B", 3, frozenset(), "synced"))
    assert "d/f" not in gone.files
    kept = cm.build(Choice("A", 3, frozenset([0]), "synced"))
    assert kept.files["d/f"] == b"0123456789"


def test_models_tear_unsynced_data_at_4k_blocks() -> None:
    new = bytes([1]) * 8192 + bytes([2]) * 100
    rec = _synthetic(
        [
            {"op": "create", "parent": 2, "name": "f", "ino": 3},
            {"op": "fsyncdir", "ino": 2},
            {"op": "write", "ino": 3, "off": 0, "blob": [0, len(new)]},
        ],
        new,
    )
    cm = CrashModel(rec)
    seen = set()
    for seed in range(40):
        c = cm.build(Choice("B", 3, frozenset([0]), f"mix:{seed}")).files["d/f"]
        assert len(c) in (0, len(new))
        blocks = tuple(
            c[i : i + 4096] in (new[i : i + 4096], b"\0" * len(c[i : i + 4096])) for i in range(0, len(c), 4096)
        )
        assert all(blocks)
        seen.add(c)
    assert len(seen) > 3  # several tears, not only all-or-nothing
