"""The issue's parser escapes and verify/load disagreements, each on a real checkpoint whose manifest was
rewritten and resealed: every command refuses it with a CheckpointError naming the manifest, verify
says NOT INTACT, and ``load(step=None)`` falls back to the older step."""

from __future__ import annotations

import dataclasses
import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptguard import Checkpointer, CheckpointError, export_checkpoint
from ckptguard.checksum import checksum
from ckptguard.protocol.manifest import Manifest

from tests.fuzz.mutate import manifest_path, rewrite
from tests.fuzz.support import cli, import_dir, save_two_steps


def _raw(replace: bytes) -> Callable[[dict[str, Any], list[Any]], bytes]:
    """A body whose ``created_at`` is ``replace`` verbatim (a number json.dumps cannot write)."""

    def change(body: dict[str, Any], tables: list[Any]) -> bytes:
        body["created_at"] = 0
        return json.dumps(body, separators=(",", ":")).encode().replace(b'"created_at":0', b'"created_at":' + replace)

    return change


def _text_checksums(body: dict[str, Any], tables: list[Any]) -> None:
    items = tables[1]
    items[9], items[10] = False, b"\xff" * (items[8] * items[0])  # stored as text, not hex


def _artifact_elsewhere(body: dict[str, Any], tables: list[Any]) -> None:
    body["artifacts"][0]["files"][0][1] = "files/rank00000/cfg/not-listed.py"


def _two_domains(body: dict[str, Any], tables: list[Any]) -> None:
    """One rank's manifest claims a second storage domain: then a tensor's size is bounded only by its
    chunk list, which it declares itself."""
    body["domain"]["count"] = 2
    tables[2]["state_dict"]["w"].update(size=[1 << 33], chunks=[0, 8, 8, (1 << 33) - 8])


SCENARIOS: dict[str, Callable[[dict[str, Any], list[Any]], Any]] = {
    "created_at beyond a float": _raw(b"1" + b"0" * 400),
    "created_at infinite": _raw(b"1e999"),
    "checksum column not ASCII": _text_checksums,
    "artifact row not in the file list": _artifact_elsewhere,
    "second domain bounds a tensor by its own chunks": _two_domains,
}


def assert_refused_everywhere(root: Path, tmp_path: Path) -> None:
    manifest = str(manifest_path(root, 2))
    code, out = cli("verify", str(root))
    assert code == 1 and "MANIFEST.json" in out, out
    with Checkpointer(root, read_only=True) as ck, pytest.raises(CheckpointError) as info:
        ck.read(2)
    assert info.value.path == manifest
    with pytest.raises(CheckpointError):
        export_checkpoint(root, tmp_path / "out.pt", "torch", step=2)
    state = {"w": torch.zeros(8)}
    with Checkpointer(root) as ck, pytest.warns(UserWarning):
        assert ck.load(state, files={"cfg": str(tmp_path / "cfg.out")}) == 1
    assert torch.equal(state["w"], torch.arange(8.0))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_hostile_resealed_manifest_is_refused_by_every_command(tmp_path: Path, name: str) -> None:
    root = save_two_steps(tmp_path / "ck", tmp_path / "cfg.py")
    rewrite(root, 2, SCENARIOS[name])
    assert_refused_everywhere(root, tmp_path)


def _path(new: Callable[[str], str]) -> Callable[[dict[str, Any], list[Any]], None]:
    """The data file's row renamed by ``new`` (the file on disk keeps its name)."""

    def change(body: dict[str, Any], tables: list[Any]) -> None:
        paths = tables[0][0]
        paths[paths.index("data/rank00000_0.bin")] = new("data/rank00000_0.bin")

    return change


def _listed_twice(body: dict[str, Any], tables: list[Any]) -> None:
    for column in tables[0]:
        column.append(column[0])
    body["rows"]["files"] += 1


def _count(field: str, by: int) -> Callable[[dict[str, Any], list[Any]], None]:
    def change(body: dict[str, Any], tables: list[Any]) -> None:
        body["rows"][field] += by

    return change


#: A manifest that names a file in a second spelling, or whose head and rows disagree: verify compared
#: names with the files on disk (a step NOT INTACT, "extra") while load opened the row's name (and
#: loaded it), so the two disagreed on the step to resume from. Each change, and what the refusal names.
ROWS = {
    "a './' part": (_path(lambda p: "./" + p), "must be a plain relative path"),
    "a '.' part inside": (_path(lambda p: p.replace("/", "/./")), "must be a plain relative path"),
    "an empty part": (_path(lambda p: p.replace("/", "//")), "must be a plain relative path"),
    "a trailing '/'": (_path(lambda p: p + "/"), "must be a plain relative path"),
    "a NUL": (_path(lambda p: p + "\0"), "must be a plain relative path"),
    "a file listed twice": (_listed_twice, "is listed twice"),
    "rows.files more than the rows": (_count("files", 1), "rows.files is 3, the row section has 2"),
    "rows.items fewer than the rows": (_count("items", -1), "rows.items is"),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_a_row_in_a_second_spelling_or_a_head_that_miscounts_is_refused_alike(tmp_path: Path, name: str) -> None:
    root = save_two_steps(tmp_path / "ck", tmp_path / "cfg.py")
    change, says = ROWS[name]
    rewrite(root, 2, change)
    code, out = cli("verify", str(root), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["safe_to_resume"] == 1, out
    ((problem,),) = [c["problems"] for c in doc["checked"] if c["step"] == 2]
    assert problem["kind"] == "manifest" and says in problem["detail"], problem
    assert_refused_everywhere(root, tmp_path)
    with Checkpointer(root, read_only=True) as ck, pytest.warns(UserWarning):
        assert ck.load({"w": torch.zeros(8)}) == 1  # what verify names safe to resume from


def _split_w(m: Manifest, data: bytes, chunks: list[tuple[int, int]]) -> Manifest:
    """``w`` (8 floats) stored as the chunks (offset, size), each item over the next bytes of its file."""
    one = m.items[0]
    items, pos = [], 0
    for off, size in chunks:
        n = 4 * size
        items.append(
            one._replace(
                offsets=(off,),
                shape=(size,),
                offset=pos,
                length=n,
                checksum=checksum(m.checksum_algorithm, data[pos : pos + n]),
            )
        )
        pos += n
    dcp = json.loads(json.dumps(m.dcp))
    dcp["state_dict"]["w"]["chunks"] = [v for c in chunks for v in c]
    return dataclasses.replace(m, dcp=dcp, items=items)


@pytest.mark.parametrize(
    "chunks",
    [[(0, 4), (2, 4)], [(0, 4), (0, 4)], [(0, 2), (1, 2), (4, 4)]],
    ids=["overlap", "twice", "overlap-and-gap"],
)
def test_chunks_that_do_not_cover_a_tensor_exactly_once_fail_verify_as_load(
    tmp_path: Path, chunks: list[tuple[int, int]]
) -> None:
    root = save_two_steps(tmp_path / "ck", tmp_path / "cfg.py")
    path = manifest_path(root, 2)
    m = Manifest.from_json(path.read_bytes(), str(path))
    data = (root / "step-00000002" / m.items[0].file).read_bytes()
    path.write_bytes(_split_w(m, data, chunks).to_json())
    code, out = cli("verify", str(root))  # before: intact, and a load refused it
    assert code == 1 and "exactly once" in out
    assert_refused_everywhere(root, tmp_path)


@pytest.mark.parametrize("chunks", [[0], [0, 2]], ids=["gap", "overlap"])
def test_import_of_dcp_chunks_that_do_not_cover_a_tensor_is_refused(tmp_path: Path, chunks: list[int]) -> None:
    """``w`` of 8 elements whose chunks are the saved 4-element tensors ``a`` and ``b`` at ``chunks``.
    Before: the uncovered elements were the importing process's heap, committed as a checkpoint that
    verified intact."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    src = tmp_path / "src"
    dcp_save(
        {"a": torch.arange(4.0), "b": torch.arange(4.0) + 4}, storage_writer=FileSystemWriter(str(src)), no_dist=True
    )
    md = pickle.loads((src / ".metadata").read_bytes())
    entry = md.state_dict_metadata.pop("a")
    md.state_dict_metadata.pop("b")
    md.planner_data = {"w": ("w",)}
    infos = [md.storage_data.pop(MetadataIndex(n, torch.Size([0]))) for n in ("a", "b")]
    entry.size = torch.Size([8])
    entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([o]), sizes=torch.Size([4])) for o in chunks]
    for o, info in zip(chunks, infos, strict=False):
        md.storage_data[MetadataIndex("w", torch.Size([o]))] = info
    md.state_dict_metadata["w"] = entry
    (src / ".metadata").write_bytes(pickle.dumps(md))
    code, out = import_dir(src, tmp_path / "root")
    assert code == 1 and "exactly once" in out, out
    assert not (tmp_path / "root" / "step-00000001").exists()


def test_read_and_export_of_a_tensor_stored_in_another_domain_refuse_before_allocating(tmp_path: Path) -> None:
    """A manifest of one storage domain of two declares ``w`` as 2**33 elements, 8 of them stored here:
    its size is bounded only by its own chunk list (before: read() and export allocated 32 GiB)."""
    root = save_two_steps(tmp_path / "ck", tmp_path / "cfg.py")

    def change(body: dict[str, Any], tables: list[Any]) -> None:
        body["world_size"] = 2
        _two_domains(body, tables)

    rewrite(root, 2, change)
    with Checkpointer(root, read_only=True) as ck, pytest.raises(CheckpointError, match="declares 34359738368 bytes"):
        ck.read(2)
    with pytest.raises(CheckpointError, match="declares"):
        export_checkpoint(root, tmp_path / "out.pt", "torch", step=2)


@pytest.mark.parametrize("where", ["past the items", "a gap between them"])
def test_a_data_file_its_items_do_not_tile_fails_load_as_verify(tmp_path: Path, where: str) -> None:
    """Bytes no item covers, past the last item or between two (the file list's size updated, resealed):
    verify reported the file NOT INTACT, a load read the items and succeeded."""
    root = save_two_steps(tmp_path / "ck", tmp_path / "cfg.py")
    path = manifest_path(root, 2)
    m = Manifest.from_json(path.read_bytes(), str(path))
    first = min((i for i in m.items if i.file == m.items[0].file), key=lambda i: i.offset)
    data = root / "step-00000002" / first.file
    raw = data.read_bytes()
    if where == "past the items":
        data.write_bytes(raw + b"tail")
        items = list(m.items)
    else:  # four bytes after the first item; every later item of the file moved along
        cut = first.offset + first.length
        data.write_bytes(raw[:cut] + b"tail" + raw[cut:])
        items = [i._replace(offset=i.offset + 4) if i.file == first.file and i.offset >= cut else i for i in m.items]
    files = [f._replace(size=f.size + 4) if f.path == first.file else f for f in m.files]
    path.write_bytes(dataclasses.replace(m, files=files, items=items).to_json())
    assert_refused_everywhere(root, tmp_path)
