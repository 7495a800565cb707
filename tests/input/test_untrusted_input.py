"""Bytes from a root's control files, a checkpoint or an imported file are untrusted: every one is
bounded before it is used as a size, an index, a path or a depth, and every refusal is a
CheckpointError naming the file; nothing hangs, recurses without bound or follows a link out.

The CLI runs in-process (typer's runner): an exception escaping a command is a failure here.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckptguard import (
    Checkpointer,
    CheckpointError,
    CorruptCheckpointError,
    DiskFullError,
    MalformedRecordError,
    load_file,
    save_file,
)
from ckptguard.cli import _register, app

DEEP = "[" * 20_000  # small enough for every control-file size limit, deep enough for any recursion


def cli(*args: str) -> tuple[int, str]:
    _register()
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.arange(8.0)})
        ck.tag("best", 1)
    return root


def test_deep_json_in_latest_and_tags_is_a_note_not_a_crash_and_root_stays_intact(root: Path) -> None:
    (root / "latest").write_text(DEEP)
    (root / "tags" / "best").write_text(DEEP)
    code, out = cli("verify", str(root))
    assert code == 0 and "intact" in out and "`latest` pointer is unreadable" in out and "nested" in out
    code, out = cli("ls", str(root), "--json")
    assert code == 0 and "nested" in json.loads(out)["latest_error"]
    with Checkpointer(root) as ck:
        assert ck.tags() == {}  # an unreadable tag is no tag
        ck.save(2, {"w": torch.ones(8)})  # and the next save rewrites `latest`
    assert json.loads((root / "latest").read_text())["step"] == 2


def test_deep_json_in_the_lease_is_an_expired_lease(root: Path) -> None:
    lease = root / ".ckptguard" / "lease.json"
    lease.write_text(DEEP)
    old = time.time() - 3600
    os.utime(lease, (old, old))  # garbage counts as expired once its mtime is older than the TTL
    assert cli("ls", str(root))[0] == 0
    with Checkpointer(root) as ck:
        ck.save(2, {"w": torch.ones(8)})


def test_the_guarded_parser_names_the_file_and_the_field(tmp_path: Path) -> None:
    from ckptguard.protocol import records

    with pytest.raises(MalformedRecordError) as info:
        records.decode(b'{"step": -3}', records.LatestRecord, "ROOT/latest")
    assert info.value.path == "ROOT/latest" and info.value.field == "step"
    with pytest.raises(MalformedRecordError) as info:
        records.decode(b'{"step": 1, "dir": ' + b"[" * 100 + b"]" * 100 + b"}", records.LatestRecord, "L")
    assert info.value.field == "(nesting)"
    assert records.nesting_depth(b'["[[[\\"[", {"a": [1]}]') == 3


def test_verify_and_ls_never_follow_directory_symlinks(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.bin").write_bytes(b"x" * 10)
    step = root / "step-00000001"
    os.symlink(outside, step / "data" / "escape")
    os.symlink(step / "data", step / "data" / "loop")
    os.symlink(root / ".ckptguard" / "staging", root / ".ckptguard" / "staging" / "step-00000009.0123456789abcdef")
    code, out = cli("verify", str(root), "--json")
    report = json.loads(out)
    # No load opens a file its manifest does not list: reported as warnings, the step stays intact.
    assert code == 0 and "secret.bin" not in out and report["checked"][0]["intact"]
    kinds = {os.path.basename(p["path"]): (p["detail"], p["severity"]) for p in report["checked"][0]["problems"]}
    assert set(kinds) == {"escape", "loop"}
    assert all("not followed" in d and s == "warning" for d, s in kinds.values())
    code, out = cli("ls", str(root), "--json")
    assert code == 0 and "secret.bin" not in out


def test_save_file_on_a_full_disk_is_disk_full_and_leaves_no_lock(small_fs: Path) -> None:
    target = small_fs / "model.pt"
    with open(small_fs / "filler", "wb") as f, pytest.raises(OSError):
        while True:
            f.write(b"\0" * (1 << 20))
            f.flush()
    with pytest.raises(DiskFullError) as info:
        save_file({"w": torch.ones(4)}, target, lock_timeout_s=1)
    assert str(target) in str(info.value)
    assert not (small_fs / "model.pt.lock").exists()
    (small_fs / "filler").unlink()
    save_file({"w": torch.ones(4)}, target, lock_timeout_s=1)
    assert torch.equal(load_file(target)["w"], torch.ones(4))


def test_an_abandoned_empty_lock_is_broken(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    lock = tmp_path / "model.pt.lock"
    lock.write_bytes(b"")
    old = time.time() - 60
    os.utime(lock, (old, old))
    save_file({"w": torch.ones(4)}, target, lock_timeout_s=2)
    lock.write_bytes(b"\xff\xfe not utf-8")  # unreadable token, fresh: waited for, refused by name
    with pytest.raises(CheckpointError, match="being written by another process"):
        save_file({"w": torch.ones(4)}, target, lock_timeout_s=0.2)


@pytest.mark.parametrize("token", [b"garbage", b"\xff" * 600, b"not-a-host not-a-pid\n"])
def test_an_old_lock_whose_token_names_no_writer_is_broken(tmp_path: Path, token: bytes) -> None:
    lock = tmp_path / "model.pt.lock"
    lock.write_bytes(token)
    old = time.time() - 3600
    os.utime(lock, (old, old))
    save_file({"w": torch.ones(4)}, tmp_path / "model.pt", lock_timeout_s=5)  # before: waited, then refused
    assert torch.equal(load_file(tmp_path / "model.pt")["w"], torch.ones(4)) and not lock.exists()


def test_a_directory_where_the_lock_goes_is_refused_by_name_and_left_alone(tmp_path: Path) -> None:
    from ckptguard import PathCollisionError

    lock = tmp_path / "model.pt.lock"
    lock.mkdir()
    (lock / "mine.txt").write_text("the user's")
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pytest.raises(PathCollisionError) as info:
        save_file({"w": torch.ones(4)}, tmp_path / "model.pt", lock_timeout_s=1)
    assert info.value.path == str(lock) and str(lock) in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt.lock"] and (lock / "mine.txt").exists()


def test_the_next_save_file_removes_what_a_killed_writer_left(tmp_path: Path) -> None:
    import subprocess
    import sys

    target = tmp_path / "model.pt"
    save_file({"w": torch.zeros(4)}, target)
    # A writer killed after writing its temporary file, before renaming it over the target.
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import os, torch, ckptguard\n"
                "os.replace = lambda *a, **k: os._exit(9)\n"
                f"ckptguard.save_file({{'w': torch.ones(4)}}, {str(target)!r})\n"
            ),
        ],
        capture_output=True,
        text=True,
    )
    assert killed.returncode == 9, killed.stderr
    left = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert len(left) == 1
    mine = tmp_path / ".model.pt.tmp-notmine"  # not a name save_file makes: never touched
    mine.write_text("x")
    save_file({"w": torch.full((4,), 2.0)}, target)
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == [mine.name]
    assert torch.equal(load_file(target)["w"], torch.full((4,), 2.0))


def _safetensors(path: Path, header: object, data: bytes = b"\0" * 16) -> Path:
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.mark.parametrize(
    ("header", "says"),
    [
        ({"__metadata__": [1]}, "__metadata__"),
        ({"__metadata__": {"ckptguard": 5}}, "__metadata__"),
        (b"[" * 5000 + b"]" * 5000, "nested"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}, "data_offsets"),
        ({"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 16]}}, "shape"),
        ({"w": "x"}, "'w'"),
        (b"not json", "not JSON"),
    ],
)
def test_load_file_refuses_hostile_safetensors_headers_by_name(tmp_path: Path, header: object, says: str) -> None:
    path = _safetensors(tmp_path / "m.safetensors", header)
    with pytest.raises(CorruptCheckpointError, match=says) as info:
        load_file(path)
    assert info.value.path == str(path)


def test_load_file_wraps_what_the_safetensors_library_refuses(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.ones(4)}, good)
    raw = good.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["w"]["dtype"] = "NOT_A_DTYPE"  # checked by the library, not by ckptguard: its refusal is wrapped
    from ckptguard.singlefile import _st_digest

    meta = header.pop("__metadata__")
    digest = _st_digest("xxh3-64", header, memoryview(raw[8 + n :]))
    header["__metadata__"] = {**meta, "ckptguard": f"1:xxh3-64:{digest}:{len(raw) - 8 - n}"}
    path = _safetensors(tmp_path / "m.safetensors", header, raw[8 + n :])
    with pytest.raises(CorruptCheckpointError, match="safetensors refused it"):
        load_file(path)


# -- import: paths, FIFOs, lengths and depths from the imported files -------------------------------


def _dcp_dir(path: Path, value: float = 0.0) -> Path:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    dcp_save({"w": torch.arange(4.0) + value}, storage_writer=FileSystemWriter(str(path)), no_dist=True)
    return path


def _rewrite_metadata(directory: Path, change: object) -> None:
    import pickle

    md = pickle.loads((directory / ".metadata").read_bytes())
    for info in md.storage_data.values():
        change(directory, info)  # type: ignore[operator]
    (directory / ".metadata").write_bytes(pickle.dumps(md))


def _import(source: Path, root: Path) -> tuple[int, str]:
    return cli("import", str(source), str(root), "--step", "1")


def test_import_refuses_a_relative_path_out_of_the_dcp_directory(tmp_path: Path) -> None:
    _dcp_dir(tmp_path / "other", 100.0)
    src = _dcp_dir(tmp_path / "src")
    _rewrite_metadata(src, lambda d, info: setattr(info, "relative_path", "../other/" + info.relative_path))
    code, out = _import(src, tmp_path / "root")
    assert code == 1 and "not a plain file name" in out and not (tmp_path / "root" / "step-00000001").exists()


def test_import_refuses_a_device_file_with_a_huge_length(tmp_path: Path) -> None:
    src = _dcp_dir(tmp_path / "src")

    def to_device(d: Path, info: object) -> None:
        data = d / info.relative_path  # type: ignore[attr-defined]
        data.unlink(missing_ok=True)
        os.symlink("/dev/zero", data)
        info.length = 1 << 40  # type: ignore[attr-defined]

    _rewrite_metadata(src, to_device)
    code, out = _import(src, tmp_path / "root")
    assert code == 1 and "not a regular file" in out


def test_import_refuses_a_tensor_larger_than_its_data(tmp_path: Path) -> None:
    import pickle

    src = _dcp_dir(tmp_path / "src")
    md = pickle.loads((src / ".metadata").read_bytes())
    md.state_dict_metadata["w"].size = torch.Size([1 << 40])
    (src / ".metadata").write_bytes(pickle.dumps(md))
    code, out = _import(src, tmp_path / "root")
    assert code == 1 and "larger than every data file" in out


@pytest.mark.parametrize("path", [("w", 10**9), ("w", -1), (), "w"])
def test_import_refuses_a_planner_path_out_of_bounds(tmp_path: Path, path: object) -> None:
    """DCP's planner_data rebuilds lists by index: an index from the imported file is bounded first."""
    import pickle

    src = _dcp_dir(tmp_path / "src")
    md = pickle.loads((src / ".metadata").read_bytes())
    md.planner_data = {"w": path}
    (src / ".metadata").write_bytes(pickle.dumps(md))
    code, out = _import(src, tmp_path / "root")  # before: MemoryError / IndexError / a state of chars
    assert code == 1 and "planner path" in out and not (tmp_path / "root" / "step-00000001").exists()


def _add_copies_of_w(src: Path, n: int, with_data: bool) -> None:
    """``n`` more tensors like ``w`` in DCP's .metadata; ``with_data``: each names w's bytes as its own."""
    import copy
    import dataclasses
    import pickle

    md = pickle.loads((src / ".metadata").read_bytes())
    ((index, info),) = [(i, v) for i, v in md.storage_data.items() if i.fqn == "w"]
    for i in range(n):
        md.state_dict_metadata[f"w{i}"] = copy.deepcopy(md.state_dict_metadata["w"])
        if with_data:
            md.storage_data[dataclasses.replace(index, fqn=f"w{i}")] = info
    (src / ".metadata").write_bytes(pickle.dumps(md))


def test_import_refuses_tensors_larger_together_than_their_data(tmp_path: Path) -> None:
    """Each tensor no larger than the data files is not enough: every tensor is allocated before any is read."""
    src = _dcp_dir(tmp_path / "src")
    stored = sum(f.stat().st_size for f in src.glob("*.distcp"))
    _add_copies_of_w(src, stored // 16 + 1, with_data=True)  # w: 4 floats, 16 bytes
    code, out = _import(src, tmp_path / "root")  # before: imported, every copy allocated
    assert code == 1 and "larger than every data file" in out and not (tmp_path / "root" / "step-00000001").exists()


def test_import_refuses_a_tensor_whose_chunk_has_no_data_entry(tmp_path: Path) -> None:
    src = _dcp_dir(tmp_path / "src")
    _add_copies_of_w(src, 1, with_data=False)
    code, out = _import(src, tmp_path / "root")  # before: a raw KeyError from DCP's reader
    assert code == 1 and "has no data file entry" in out and not (tmp_path / "root" / "step-00000001").exists()


def _save_deep(path: Path, depth: int, sealed: bool = False) -> None:
    """A torch.save file holding lists nested ``depth`` deep (sealed as save_file's, if asked)."""
    import sys

    from ckptguard.singlefile import save_local

    deep: list[object] = []
    cur = deep
    for _ in range(depth):
        nxt: list[object] = []
        cur.append(nxt)
        cur = nxt
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        if sealed:
            save_local({"a": deep}, str(path), "torch", "xxh3-64", loadable=False)
        else:
            torch.save({"a": deep}, path)
    finally:
        sys.setrecursionlimit(limit)


def test_import_refuses_a_deeply_nested_torch_save_file(tmp_path: Path) -> None:
    _save_deep(tmp_path / "deep.pt", 3000)
    code, out = _import(tmp_path / "deep.pt", tmp_path / "root")
    assert code == 1 and "nests more than" in out


def test_load_file_holds_unpickled_values_to_the_import_depth_bound(tmp_path: Path) -> None:
    from ckptguard.dcp.codec import MAX_VALUE_DEPTH

    _save_deep(tmp_path / "ok.pt", MAX_VALUE_DEPTH - 2, sealed=True)
    assert isinstance(load_file(tmp_path / "ok.pt")["a"], list)
    path = tmp_path / "deep.pt"
    _save_deep(path, 3000, sealed=True)
    with pytest.raises(CorruptCheckpointError, match="nests more than 100 deep") as info:
        load_file(path)
    assert info.value.path == str(path) and str(path) in str(info.value)


def test_import_refusal_of_a_hostile_dcp_metadata_pickle_names_the_file(tmp_path: Path) -> None:
    import pickle

    src = _dcp_dir(tmp_path / "src")
    ran = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return os.system, (f"touch {ran}",)

    (src / ".metadata").write_bytes(pickle.dumps(Evil()))
    code, out = _import(src, tmp_path / "root")
    assert code == 1 and str(src / ".metadata") in out and "refusing to unpickle" in out and not ran.exists()


@pytest.mark.parametrize("where", ["source", "metadata", "data"])
def test_import_never_blocks_on_a_fifo(tmp_path: Path, where: str) -> None:
    if where == "source":
        source = tmp_path / "model.pt"
        os.mkfifo(source)
    else:
        source = _dcp_dir(tmp_path / "src")
        victim = source / ".metadata" if where == "metadata" else next(source.glob("*.distcp"))
        victim.unlink()
        os.mkfifo(victim)
    code, out = _import(source, tmp_path / "root")  # before: blocked in open() forever
    assert code == 1 and "not a regular file" in out  # CorruptCheckpointError: exit 1


# -- read() and export of a sealed hostile manifest ----------------------------------------------


def _reseal_dcp(root: Path, change: object) -> None:
    import dataclasses

    from ckptguard.protocol.manifest import Manifest

    path = root / "step-00000001" / "MANIFEST.json"
    m = Manifest.from_json(path.read_bytes(), str(path))
    dcp = json.loads(json.dumps(m.dcp))
    change(dcp)  # type: ignore[operator]
    path.write_bytes(dataclasses.replace(m, dcp=dcp).to_json())


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda d: d["planner_data"].update({"w": ["w", 10**9]}), "bad planner path"),
        (lambda d: d["planner_data"].update({"w": ["w", -1]}), "bad planner path"),
        (lambda d: d["planner_data"].update({"w": []}), "bad planner path"),
        (lambda d: d["planner_data"].update({"v": ["w", "x"]}), "nests where another path does not"),
        (lambda d: d["planner_data"].update({"a": ["o", 0], "b": ["o", "k"]}), "nests where another path does not"),
        (lambda d: d["planner_data"].update({"a": ["o", "k", 0], "b": ["o", "k"]}), "nests where another"),
        (lambda d: d["state_dict"]["w"].update({"requires_grad": None}), "requires_grad is missing"),
        (lambda d: d["state_dict"]["w"].update({"chunks": [0]}), "not whole chunks"),
        # (refused since the manifest's parse compares DCP's chunks with the items: every command refuses it)
        (lambda d: d["state_dict"]["w"].update({"size": [1 << 40]}), "do not add up to its size"),
        (lambda d: d["state_dict"]["w"].update({"size": [-4]}), "integers >= 0"),
    ],
)
def test_read_and_export_of_a_hostile_manifest_are_corrupt_not_a_crash(
    root: Path, tmp_path: Path, change: object, says: str
) -> None:
    from ckptguard import export_checkpoint

    _reseal_dcp(root, change)
    with Checkpointer(root, read_only=True) as ck, pytest.raises(CorruptCheckpointError, match=says):
        ck.read(1)
    with pytest.raises(CorruptCheckpointError, match=says):
        export_checkpoint(root, tmp_path / "out.pt", "torch", step=1)
    code, out = cli("export", str(root), str(tmp_path / "out2.pt"), "--to", "torch")
    assert code != 0 and says in out


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda d: d["state_dict"]["w"].update({"dtype": "int8"}), "disagree on the dtype"),
        (
            lambda d: d["state_dict"]["w"].update({"size": [2, 4], "chunks": [0, 0, 2, 4]}),
            "disagree on the number of dim",
        ),
        (lambda d: d["state_dict"]["w"].update({"size": [4], "chunks": [0, 4]}), "disagree on the size"),
        (lambda d: d["state_dict"].update({"w": {"type": "bytes"}}), "tensor row for an object entry"),
        # DCP's chunk list, which a load plans its reads from, against the items (before: a load read nothing
        # or half of "w" and succeeded, read() gave back uninitialised memory, verify said intact)
        (lambda d: d["state_dict"]["w"].update({"chunks": []}), "do not add up to its size"),
        (lambda d: d["state_dict"]["w"].update({"chunks": [0, 4]}), "do not add up to its size"),
        (lambda d: d["state_dict"]["w"].update({"chunks": [4, 4]}), "do not add up to its size"),
        (lambda d: d["state_dict"]["w"].update({"chunks": [1 << 62, 8]}), "lies outside its size"),
        (lambda d: d["state_dict"]["w"].update({"chunks": [0, 4, 4, 4]}), "lists 2 chunk"),
        (lambda d: d["state_dict"]["w"].update({"chunks": [0, 6, 2, 6]}), "do not add up to its size"),
        (lambda d: d["state_dict"]["w"].update({"chunks": [0, 4, 2, 4]}), "lists 2 chunk"),  # overlap and gap
        (lambda d: d["state_dict"].update({"v": d["state_dict"].pop("w")}), "lists one chunk, the items store 0"),
    ],
)
def test_a_manifest_whose_dcp_metadata_disagrees_with_its_items_is_corrupt_everywhere(
    root: Path, change: object, says: str
) -> None:
    _reseal_dcp(root, change)
    manifest = str(root / "step-00000001" / "MANIFEST.json")
    code, out = cli("verify", str(root))
    assert code == 1 and says in out and "MANIFEST.json" in out
    with Checkpointer(root, read_only=True) as ck:
        with pytest.raises(CorruptCheckpointError, match=says) as info:
            ck.read(1)
        assert info.value.path == manifest
        state = {"w": torch.zeros(8)}
        with pytest.raises(CorruptCheckpointError, match=says), pytest.warns(UserWarning):
            ck.load(state)
        assert torch.equal(state["w"], torch.zeros(8))


def test_an_empty_tensor_whose_other_dimensions_overflow_is_corrupt_not_a_crash(tmp_path: Path) -> None:
    """0 elements, so every byte count holds, but torch cannot compute the strides of [0, 2**62, 2**62]
    (before: read() raised torch's RuntimeError, verify said intact)."""
    import dataclasses

    from ckptguard.protocol.itemtable import ItemTable
    from ckptguard.protocol.manifest import Manifest

    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(1, {"e": torch.zeros(0, 4), "w": torch.arange(4.0)})
    path = root / "step-00000001" / "MANIFEST.json"
    m = Manifest.from_json(path.read_bytes(), str(path))
    huge = [0, 1 << 62, 1 << 62]
    dcp = json.loads(json.dumps(m.dcp))
    dcp["state_dict"]["e"].update({"size": huge, "chunks": [0, 0, 0, *huge]})
    rows = [i._replace(shape=tuple(huge), offsets=(0, 0, 0)) if i.fqn == "e" else i for i in m.items]
    path.write_bytes(
        dataclasses.replace(m, dcp=dcp, items=ItemTable.from_items(rows, [f.path for f in m.files])).to_json()
    )
    code, out = cli("verify", str(root))
    assert code == 1 and "more elements than a tensor can address" in out
    with Checkpointer(root, read_only=True) as ck, pytest.raises(CorruptCheckpointError, match="can address"):
        ck.read(1)


def test_a_size_of_two_negative_dimensions_is_corrupt_for_verify_too(tmp_path: Path) -> None:
    """[-2, -3] multiplies to the items' 6 elements: a load refused it, verify said intact."""
    import dataclasses

    from ckptguard.protocol.manifest import Manifest

    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.arange(6.0).reshape(2, 3)})
    path = root / "step-00000001" / "MANIFEST.json"
    m = Manifest.from_json(path.read_bytes(), str(path))
    dcp = json.loads(json.dumps(m.dcp))
    dcp["state_dict"]["w"].update({"size": [-2, -3], "chunks": [0, 0, -2, -3]})
    path.write_bytes(dataclasses.replace(m, dcp=dcp).to_json())
    code, out = cli("verify", str(root))
    assert code == 1 and "integers >= 0" in out
    with Checkpointer(root, read_only=True) as ck, pytest.raises(CorruptCheckpointError, match="integers >= 0"):
        ck.read(1)


# -- the object store's control records ----------------------------------------------------------


def test_deep_json_in_the_s3_index_and_latest_is_a_typed_error_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("moto")
    from tests.support.beds.s3 import s3_bed

    with s3_bed(seed=5) as bed:
        for k, v in bed.env().items():
            monkeypatch.setenv(k, v)
        bucket = bed.make_bucket("hostile-records")
        root = f"s3://{bucket}/run"
        with Checkpointer(root) as ck:
            ck.save(1, {"w": torch.arange(8.0)})
        bed.client().put_object(Bucket=bucket, Key="run/latest", Body=DEEP.encode())
        assert cli("verify", root)[0] == 0  # an unreadable `latest` is a note
        bed.client().put_object(Bucket=bucket, Key="run/.ckptguard/index.json", Body=DEEP.encode())
        with pytest.raises(MalformedRecordError) as info:
            Checkpointer(root, read_only=True).steps()
        assert info.value.path is not None and info.value.path.endswith("index.json")
        for command in ("ls", "verify"):  # a damaged record of the root: not intact, not a usage error
            code, out = cli(command, root)
            assert code == 1 and "index.json" in out and "nested" in out and "NOT INTACT" in out, (command, out)
        bed.client().put_object(Bucket=bucket, Key="run/.ckptguard/index.json", Body=b"\xff\x00garbage")
        code, out = cli("verify", root, "--json")
        doc = json.loads(out[out.index("{") :])
        assert code == 1 and doc["intact"] is False and "index.json" in doc["error"]


@pytest.mark.parametrize("kind", ["fifo", "file"])
def test_a_control_entry_that_is_not_a_directory_is_skipped_beside_intact_roots(tmp_path: Path, kind: str) -> None:
    with Checkpointer(tmp_path / "run1") as ck:
        ck.save(1, {"w": torch.arange(4.0)})
    stray = tmp_path / "other" / ".ckptguard"
    stray.parent.mkdir()
    if kind == "fifo":
        os.mkfifo(stray)  # opened, it would block the command forever
    else:
        stray.write_text("not a directory\n")
    for command in ("verify", "ls"):
        code, out = cli(command, str(tmp_path))
        assert code == 0 and "run1" in out and f"skipped {stray}" in out, (command, out)


def test_a_root_whose_control_directory_is_a_file_is_not_intact_not_a_usage_error(root: Path) -> None:
    import shutil

    shutil.rmtree(root / ".ckptguard")
    (root / ".ckptguard").write_text("not a directory\n")
    for command in ("verify", "ls"):
        code, out = cli(command, str(root))
        assert code == 1 and "NOT INTACT" in out and ".ckptguard" in out, (command, out)


def test_a_lease_naming_an_impossible_pid_is_garbage_not_an_overflow(root: Path) -> None:
    import socket

    from ckptguard.protocol.lease import _boot_id, _pid_namespace

    lease = root / ".ckptguard" / "lease.json"
    now = time.time()
    lease.write_text(
        json.dumps(
            {
                "holder": "other",
                "job": None,
                "host": socket.gethostname(),
                "pid": 2**70,
                "boot_id": _boot_id(),
                "epoch": 3,
                "acquired_at": now,
                "renewed_at": now,
                "ttl_s": 3600.0,
                "pid_ns": _pid_namespace(),
            }
        )
    )
    os.utime(lease, (now - 7200, now - 7200))
    with Checkpointer(root) as ck:  # before: OverflowError from os.kill(pid, 0)
        ck.save(2, {"w": torch.ones(8)})


def test_a_manifest_attempt_that_is_not_hex_is_corrupt(root: Path) -> None:
    import dataclasses

    from ckptguard.protocol.manifest import Manifest

    path = root / "step-00000001" / "MANIFEST.json"
    m = Manifest.from_json(path.read_bytes(), str(path))
    path.write_bytes(dataclasses.replace(m, attempt="../../elsewhere").to_json())  # a path part on object stores
    with Checkpointer(root, read_only=True) as ck, pytest.raises(CorruptCheckpointError, match="hex digits"):
        ck.read(1)


# -- a `ckptguard run` log directory handed to diagnose ------------------------------------------


@pytest.mark.parametrize("kind", ["deep", "fifo"])
def test_diagnose_of_a_run_directory_with_a_hostile_run_json_is_no_crash_and_no_hang(tmp_path: Path, kind: str) -> None:
    run = tmp_path / "logs" / "host-run"
    run.mkdir(parents=True)
    (run / "rank0.log").write_text("[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered\n")
    if kind == "deep":
        (run / "run.json").write_text(DEEP)
    else:
        os.mkfifo(run / "run.json")
    cli("diagnose", str(run))  # before: RecursionError escaped; a FIFO blocked in open() forever
