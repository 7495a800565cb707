"""`ckptguard ls` and `ckptguard verify` through the real command line: output, JSON schema, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptguard import Checkpointer


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptguard.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ckpt"
    with Checkpointer(r, keep_last=3) as ck:
        for step in (10, 20, 30):
            ck.save(
                step, {"w": torch.arange(50_000, dtype=torch.float32) + step, "n": step}, metadata={"loss": step / 10}
            )
    return r


def data_file(root: Path, step: int) -> Path:
    return sorted((root / f"step-{step:08d}" / "data").iterdir())[0]


def test_verify_intact(root: Path) -> None:
    out = cli("verify", str(root))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("│ intact ") == 3 and "safe to resume from: step 30" in out.stdout


def test_verify_json_schema(root: Path) -> None:
    out = cli("verify", str(root), "--json")
    assert out.returncode == 0
    doc = json.loads(out.stdout)
    assert doc["schema_version"] == 1 and doc["intact"] is True and doc["safe_to_resume"] == 30
    assert [c["step"] for c in doc["checked"]] == [10, 20, 30]
    first = doc["checked"][0]
    assert set(first) == {"step", "version", "dir", "intact", "files_checked", "bytes_checked", "seconds", "problems"}
    assert first["bytes_checked"] > 200_000 and first["problems"] == []


@pytest.mark.parametrize(
    "damage,kind",
    [
        ("bitflip", "checksum"),
        ("truncate", "size"),
        ("zeros", "checksum"),
        ("delete", "missing"),
        ("manifest", "manifest"),
    ],
)
def test_verify_finds_each_kind_of_damage(root: Path, damage: str, kind: str) -> None:
    target = data_file(root, 30)
    if damage == "bitflip":
        data = bytearray(target.read_bytes())
        data[1234] ^= 0x40
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-1])
    elif damage == "zeros":
        data = bytearray(target.read_bytes())
        data[4096:8192] = bytes(4096)
        target.write_bytes(bytes(data))
    elif damage == "delete":
        target.unlink()
    else:
        m = root / "step-00000030" / "MANIFEST.json"
        m.write_bytes(m.read_bytes().replace(b'"loss"', b'"lost"'))
    out = cli("verify", str(root), "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    bad = [c for c in doc["checked"] if not c["intact"]]
    assert [c["step"] for c in bad] == [30] and doc["safe_to_resume"] == 20
    assert bad[0]["problems"][0]["kind"] == kind
    human = cli("verify", str(root), "--step", "30")
    assert human.returncode == 1 and "NOT INTACT" in human.stdout and kind in human.stdout


@pytest.mark.parametrize("stray", ["data/rank00009_0.bin", "data/extra.bin", "NOTES.txt", "data/fifo", "link"])
def test_a_file_the_manifest_does_not_list_is_a_warning_and_verify_agrees_with_load(root: Path, stray: str) -> None:
    """No load reads a file its manifest does not list: verify reports it as a warning, the step stays
    intact and safe to resume from, and load(step=None) gives that same step."""
    path = root / "step-00000030" / stray
    if stray == "data/fifo":
        os.mkfifo(path)
    elif stray == "link":
        path.symlink_to(data_file(root, 20))
    else:
        path.write_bytes(b"stray")
    out = cli("verify", str(root), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["intact"] is True and doc["safe_to_resume"] == 30
    (newest,) = [c for c in doc["checked"] if c["step"] == 30]
    assert newest["intact"] is True
    assert [(p["kind"], p["severity"], p["path"]) for p in newest["problems"]] == [("extra", "warning", str(path))]
    human = cli("verify", str(root))
    assert human.returncode == 0 and "NOT INTACT" not in human.stdout
    assert f"step 30: extra (warning): step-00000030/{stray}" in human.stdout
    assert "safe to resume from: step 30" in human.stdout
    with Checkpointer(root, read_only=True) as ck:
        assert ck.load({"w": torch.zeros(50_000), "n": 0}) == 30


def test_verify_usage_errors(root: Path, tmp_path: Path) -> None:
    assert cli("verify", str(tmp_path / "nope")).returncode == 2
    missing = cli("verify", str(root), "--step", "11")
    assert missing.returncode == 2 and "step 11 is not a committed checkpoint" in missing.stderr
    assert cli("verify").returncode == 2
    assert cli("verify", str(root), "--threads", "0").returncode == 2


def test_verify_empty_root_is_not_a_failure(tmp_path: Path) -> None:
    Checkpointer(tmp_path / "empty").close()  # a root opened for writing, nothing saved yet
    out = cli("verify", str(tmp_path / "empty"))
    assert out.returncode == 0 and "no committed checkpoint" in out.stdout


def test_ls_shows_checkpoints_attempts_and_lease(root: Path) -> None:
    stale = root / ".ckptguard" / "staging" / ("step-00000040." + "cd" * 16)
    (stale / "data").mkdir(parents=True)
    (stale / "data" / "rank00000_0.bin").write_bytes(b"x" * 100)
    old = 1_000_000_000
    os.utime(stale, (old, old))
    out = cli("ls", str(root))
    assert out.returncode == 0
    assert "step-00000030" in out.stdout and "latest" in out.stdout and '"loss": 3.0' in out.stdout
    assert "attempt abandoned: step 40" in out.stdout
    doc = json.loads(cli("ls", str(root), "--json").stdout)
    assert doc["schema_version"] == 1
    assert [(c["step"], c["latest"]) for c in doc["checkpoints"]] == [(10, False), (20, False), (30, True)]
    assert doc["attempts"][0]["state"] == "abandoned" and doc["attempts"][0]["bytes"] == 100
    assert doc["lease"] is None  # the Checkpointer was closed


def test_ls_usage_error(tmp_path: Path) -> None:
    out = cli("ls", str(tmp_path / "missing"))
    assert out.returncode == 2 and "is not a directory" in out.stderr


def test_ls_and_verify_start_without_torch(root: Path) -> None:
    """Inspecting a checkpoint on a login node must not pay for importing torch."""
    for cmd in ("ls", "verify"):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "ckptguard.cli", cmd, str(root)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0
        imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
        assert "torch" not in imported, cmd
