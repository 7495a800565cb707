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
    reseal(
        root,
        lambda m: dataclasses.replace(
            m, items=[i._replace(length=64 << 30, shape=(16 << 30,)) if i.fqn == "w" else i for i in m.items]
        ),
    )
    with Checkpointer(root, read_only=True) as ck, pytest.raises(CorruptCheckpointError, match="claims bytes"):
        ck.load({"w": torch.zeros(256), "v": torch.zeros(16)}, step=1)
    assert cli("verify", str(root)).returncode == 1


def test_an_item_whose_shape_does_not_match_its_length_is_refused(tmp_path: Path) -> None:
    root = committed(tmp_path)
    reseal(
        root,
        lambda m: dataclasses.replace(m, items=[i._replace(shape=(1 << 40,)) if i.fqn == "w" else i for i in m.items]),
    )
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


# -- the manifest's binary row section ------------------------------------------------------------


def reseal_rows(root: Path, change: object) -> Path:
    """Edit the decoded row section (and the JSON body) of a manifest, then seal it again: only the
    parser's own checks stand between the edit and a reader."""
    import json

    import msgspec

    from ckptguard.protocol.manifest import Tables, seal

    path = root / STEP_DIR / "MANIFEST.json"
    data = path.read_bytes()
    end = data.index(b"\n")
    body = json.loads(data[data.index(b'"body":') + len('"body":') : end - 1])
    tables = msgspec.msgpack.decode(data[end + 1 :], type=Tables)
    change(body, tables)  # type: ignore[operator]
    raw = msgspec.msgpack.encode(tables)
    body["rows"]["bytes"] = len(raw)
    path.write_bytes(seal(json.dumps(body).encode(), raw))
    return path


def _column(values: list[int], code: str = "u8") -> object:
    import numpy as np

    from ckptguard.protocol.itemtable import Column

    return Column(code, np.array(values, dtype="<" + code).tobytes())


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda b, t: setattr(t.items, "count", t.items.count + 1000), "not .* values"),
        (lambda b, t: setattr(t.items, "file", _column([7] * t.items.count)), "file index 7 is not below 1"),
        (lambda b, t: setattr(t.items, "name", _column([1 << 40] * t.items.count)), "name index"),
        (lambda b, t: setattr(t.items, "offset", _column([1 << 63] * t.items.count)), "2\\*\\*63"),
        (lambda b, t: setattr(t.items, "shape_ndim", _column([90] * t.items.count)), "dimensions"),
        (lambda b, t: setattr(t.items.offset, "code", "f8"), "encoding 'f8'"),
        (lambda b, t: setattr(t.items, "checksum_width", 0), "checksum width"),
        (lambda b, t: setattr(t.items, "checksum", t.items.checksum[:-1]), "checksums take"),
        (lambda b, t: t.files.size.pop(), "file columns"),
        (lambda b, t: b["rows"].update(encoding="zip"), "rows.encoding"),
    ],
)
def test_a_malformed_row_section_is_corrupt_naming_the_manifest(tmp_path: Path, change: object, says: str) -> None:
    root = committed(tmp_path)
    path = reseal_rows(root, change)
    with Checkpointer(root, read_only=True) as ck, pytest.raises(CorruptCheckpointError, match=says) as info:
        ck.load({"w": torch.zeros(256), "v": torch.zeros(16)}, step=1)
    assert info.value.path == str(path)
    proc = cli("verify", str(root))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr


def test_a_row_section_of_the_wrong_type_names_the_field(tmp_path: Path) -> None:
    import json

    import msgspec

    from ckptguard.errors import MalformedRecordError
    from ckptguard.protocol.manifest import seal

    root = committed(tmp_path)
    path = root / STEP_DIR / "MANIFEST.json"
    data = path.read_bytes()
    end = data.index(b"\n")
    body = json.loads(data[data.index(b'"body":') + len('"body":') : end - 1])
    files, items, dcp = msgspec.msgpack.decode(data[end + 1 :])
    files[1] = ["many"] * len(files[1])  # sizes that are not numbers
    raw = msgspec.msgpack.encode([files, items, dcp])
    body["rows"]["bytes"] = len(raw)
    path.write_bytes(seal(json.dumps(body).encode(), raw))
    with Checkpointer(root, read_only=True) as ck, pytest.raises(MalformedRecordError) as info:
        ck.read(1)
    assert info.value.field == "files.size[0]" and info.value.path == str(path)


def test_rows_of_every_kind_come_back_from_the_columns(tmp_path: Path) -> None:
    """Objects, 0-d, 1-d and 2-d tensors and chunks without offsets in one manifest: every field of
    every row survives the column encoding exactly."""
    from ckptguard.dcp.records import FileEntry, StoredItem

    root = committed(tmp_path)
    path = root / STEP_DIR / "MANIFEST.json"
    m = Manifest.from_json(path.read_bytes(), str(path))
    file = "data/extra.bin"  # a data file of their own, which they tile (as every save's rows do)
    extra = [
        StoredItem("obj", None, file, 0, 3, "00000000deadbeef"),
        StoredItem("scalar", (), file, 3, 8, "0123456789abcdef", "int64", ()),
        StoredItem("w", None, file, 11, 1024, "fedcba9876543210", "float32", (256,)),
        StoredItem("grid", (2, 0), file, 1035, 24, "00000000000000ff", "bfloat16", (3, 4)),
    ]
    rows = [*m.items, *extra]
    files = [*m.files, FileEntry(file, 1059, 0)]
    changed = dataclasses.replace(m, files=files, items=rows, dcp={**m.dcp, "state_dict": {}})
    again = Manifest.from_json(changed.to_json(), "x")
    assert list(again.items) == rows
