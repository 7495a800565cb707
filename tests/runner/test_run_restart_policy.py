"""Every knowledge-base class declares whether `ckptguard run --max-restarts` restarts it."""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

import pytest

from ckptguard.diagnose.kb import KBError, load_kb, load_kb_dir

TRANSIENT = {
    "nccl_network_error",
    "peer_connection_lost",
    "rendezvous_failure",
    "nccl_watchdog_timeout",
    "scheduler_time_limit",
    "launcher_sigterm",
}
DETERMINISTIC = {
    "python_exception",
    "cuda_oom",
    "state_dict_mismatch",
    "checkpoint_corrupt_load",
    "permission_denied_checkpoint_dir",
    "disk_full_enospc",
}


def test_every_class_declares_its_restart_policy() -> None:
    kb = load_kb()
    for fc in kb.classes.values():
        assert fc.restart.why, fc.id
    assert {c for c in TRANSIENT if kb[c].restart.transient} == TRANSIENT
    assert not any(kb[c].restart.transient for c in DETERMINISTIC)
    # A SIGKILL with an out-of-memory message recurs; one without it may be a lost process.
    assert kb["host_oom_sigkill"].restart.transient is False
    assert kb["host_oom_sigkill"].restart.unproven_transient is True


def _kb_copy(tmp_path: Path) -> Path:
    with resources.as_file(resources.files("ckptguard.diagnose") / "kb") as src:
        shutil.copytree(src, tmp_path / "kb")
    return tmp_path / "kb"


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("[restart]\ntransient = false\n", "", "restart"),  # the table missing
        ("transient = false\n", 'transient = "no"\n', "transient"),  # wrong type
        ("transient = false\n", "transient = false\nretries = 3\n", "retries"),  # unknown key
    ],
)
def test_a_class_without_a_valid_restart_table_is_refused(tmp_path: Path, old: str, new: str, message: str) -> None:
    kb_dir = _kb_copy(tmp_path)
    f = kb_dir / "python_exception.toml"
    text = f.read_text()
    assert old in text
    text = text.replace(old, new, 1)
    if not new:  # the table's other key goes with it
        text = "\n".join(x for x in text.splitlines() if not x.startswith("why = ")) + "\n"
    f.write_text(text)
    with pytest.raises(KBError, match=message) as e:
        load_kb_dir(kb_dir)
    assert "python_exception.toml" in str(e.value)
