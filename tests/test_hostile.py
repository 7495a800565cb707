"""A hostile or damaged checkpoint can neither hang nor exhaust a reader.

Each case starts from a real committed checkpoint and damages it the way an
attacker or a broken tool could; the manifest is re-sealed with a valid
checksum where the attack needs it, so only the new checks can catch it.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptguard import Checkpointer, CorruptCheckpointError
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import Manifest

STEP_DIR = CheckpointName(1).dirname


def committed(tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.arange(256.0), "v": torch.ones(16)})
    return root


def reseal(root: Path, change: object) -> None:
    path = root / STEP_DIR / "MANIFEST.json"
    manifest = Manifest.from_json(path.read_bytes(), str(path))
    path.write_bytes(change(manifest).to_json())  # type: ignore[operator]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptguard.cli", *args], capture_output=True, text=True, timeout=60)


def test_an_item_claiming_more_bytes_than_its_file_is_refused_before_allocating(tmp_path: Path) -> None:
    root = committed(tmp_path)
    reseal(root, lambda m: dataclasses.replace(m, items=[i._replace(length=64 << 30, shape=(16 << 30,))
                                                          if i.fqn == "w" else i for i in m.items]))
    with Checkpointer(root, read_only=True) as ck, pytest.raises(CorruptCheckpointError, match="claims bytes"):
        ck.load({"w": torch.zeros(256), "v": torch.zeros(16)}, step=1)
    assert cli("verify", str(root)).returncode == 1


def test_an_item_whose_shape_does_not_match_its_length_is_refused(tmp_path: Path) -> None:
    root = committed(tmp_path)
    reseal(root, lambda m: dataclasses.replace(m, items=[i._replace(shape=(1 << 40,)) if i.fqn == "w" else i
                                                          for i in m.items]))
    with Checkpointer(root, read_only=True) as ck, pytest.raises(CorruptCheckpointError, match="does not match its"):
        ck.load({"w": torch.zeros(256), "v": torch.zeros(16)}, step=1)
    # verify said "intact" here (the campaign's hostile kind found it): only the load checked the shape.
    assert cli("verify", str(root)).returncode == 1


def test_a_fifo_in_place_of_the_manifest_blocks_neither_ls_nor_verify_nor_load(tmp_path: Path) -> None:
    root = committed(tmp_path)
    manifest = root / STEP_DIR / "MANIFEST.json"
    manifest.unlink()
    os.mkfifo(manifest)
    ls = cli("ls", str(root), "--json")
    assert ls.returncode == 0 and "not a regular file" in ls.stdout
    assert cli("verify", str(root)).returncode == 1
    with Checkpointer(root, read_only=True) as ck, pytest.raises(CorruptCheckpointError, match="regular file"):
        ck.load({"w": torch.zeros(256), "v": torch.zeros(16)}, step=1)


def test_a_symlinked_data_file_is_not_followed(tmp_path: Path) -> None:
    root = committed(tmp_path)
    data = next((root / STEP_DIR / "data").iterdir())
    outside = tmp_path / "outside.bin"
    outside.write_bytes(data.read_bytes())
    data.unlink()
    os.symlink(outside, data)
    with Checkpointer(root, read_only=True) as ck, pytest.raises(CorruptCheckpointError, match="not a regular file"):
        ck.load({"w": torch.zeros(256), "v": torch.zeros(16)}, step=1)
    assert cli("verify", str(root)).returncode == 1


@pytest.mark.parametrize("linked", [STEP_DIR, f"{STEP_DIR}/data", f"{STEP_DIR}/files/rank00000"])
def test_a_symlinked_directory_in_a_checkpoint_is_refused_by_load_and_verify(tmp_path: Path, linked: str) -> None:
    root = tmp_path / "ck"
    art = tmp_path / "art"
    art.mkdir()
    (art / "f.txt").write_text("hello")
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.arange(256.0)}, files={"k": art})
    real, outside = root / linked, tmp_path / "outside"
    real.rename(outside)  # the same bytes, outside the checkpoint
    os.symlink(outside, real)
    with Checkpointer(root, read_only=True) as ck, pytest.raises(CorruptCheckpointError, match="not a real directory"):
        ck.load({"w": torch.zeros(256)}, step=1, files={"k": tmp_path / "restore"})
    proc = cli("verify", str(root))
    assert proc.returncode == 1 and "not a real directory" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_a_deeply_nested_manifest_is_corrupt_not_a_crash(tmp_path: Path) -> None:
    root = committed(tmp_path)
    path = root / STEP_DIR / "MANIFEST.json"
    from ckptguard.protocol.manifest import seal

    path.write_bytes(seal(b"[" * 100_000 + b"]" * 100_000, b""))
    with Checkpointer(root, read_only=True) as ck, pytest.raises(CorruptCheckpointError):
        ck.load({"w": torch.zeros(256), "v": torch.zeros(16)}, step=1)
    proc = cli("verify", str(root))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
