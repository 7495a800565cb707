"""Fuzzing what ckptguard reads from outside a root: a DCP directory's ``.metadata`` (fields of its
unpickled records rewritten: sizes, chunks, storage ranges, dtypes, planner paths) and torch.save and
safetensors files (their bytes and headers). Properties: ``import``/``load_file`` raise nothing but
CheckpointError subclasses, nothing hangs or allocates beyond a few GiB, and what ``import`` commits
verifies intact, reads back, and is the same bytes when imported twice (no memory nobody wrote)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from ckptguard import Checkpointer, CheckpointError, load_file, save_file
from ckptguard.interop import import_checkpoint
from ckptguard.protocol.layout import CheckpointName
from ckptguard.verify import verify_checkpoint

from tests.fuzz.harness import bounded, kept_until_exit, scratch
from tests.fuzz.strategies import EDGE_INTS

CI_EXAMPLES = int(os.environ.get("CKPTGUARD_FUZZ_CI_EXAMPLES", "60"))
LONG_EXAMPLES = int(os.environ.get("CKPTGUARD_FUZZ_EXAMPLES", "100000"))
LONG_SEED = int(os.environ.get("CKPTGUARD_FUZZ_SEED", "0"))
_COMMON: dict[str, Any] = {
    "deadline": None,
    "database": None,
    "print_blob": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
CI = settings(max_examples=CI_EXAMPLES, derandomize=True, **_COMMON)
LONG = settings(max_examples=LONG_EXAMPLES, **_COMMON)


def _state() -> dict[str, Any]:
    return {"a": torch.arange(8.0), "m": torch.arange(16, dtype=torch.int32).reshape(4, 4), "n": 3}


@functools.cache
def _dcp_base() -> Path:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    path = kept_until_exit("ckptguard-fuzz-dcp-") / "src"
    dcp_save(_state(), storage_writer=FileSystemWriter(str(path)), no_dist=True)
    return path


@functools.cache
def _files_base() -> tuple[bytes, bytes]:
    where = kept_until_exit("ckptguard-fuzz-files-")
    torch.save(_state(), where / "s.pt")
    save_file({k: v for k, v in _state().items() if isinstance(v, torch.Tensor)}, where / "s.safetensors")
    return (where / "s.pt").read_bytes(), (where / "s.safetensors").read_bytes()


# -- DCP .metadata -------------------------------------------------------------------------------

numbers = st.sampled_from(EDGE_INTS) | st.integers(-3, 20)


@st.composite
def metadata_edits(draw: st.DrawFn) -> list[tuple[str, str, Any]]:
    """(what, name, value): a tensor's size or a chunk's offsets/sizes, a storage entry's offset, length
    or file, a dtype, a planner path, or a chunk added or dropped."""
    out = []
    for _ in range(draw(st.integers(1, 3))):
        what = draw(
            st.sampled_from(
                [
                    "size",
                    "chunk offsets",
                    "chunk sizes",
                    "add chunk",
                    "drop chunk",
                    "storage offset",
                    "storage length",
                    "storage file",
                    "dtype",
                    "planner",
                ]
            )
        )
        name = draw(st.sampled_from(["a", "m", "n"]))
        if what in ("size", "chunk offsets", "chunk sizes", "add chunk"):
            value: Any = draw(st.lists(numbers, min_size=1, max_size=3))
        elif what == "storage file":
            value = draw(st.sampled_from(["", "..", "../src/.metadata", "/etc/passwd", "__0_0.distcp", "x.distcp"]))
        elif what == "dtype":
            value = draw(st.sampled_from(["float64", "int8", "bool", "complex128", "float16"]))
        elif what == "planner":
            value = draw(st.lists(numbers | st.text(max_size=3), max_size=3))
        else:
            value = draw(numbers)
        out.append((what, name, value))
    return out


def _apply_metadata(md: Any, what: str, name: str, value: Any) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

    entry = md.state_dict_metadata.get(name)
    tensor = isinstance(entry, TensorStorageMetadata)
    infos = [(k, v) for k, v in md.storage_data.items() if k.fqn == name]
    if what == "size" and tensor:
        entry.size = torch.Size(value)
    elif what in ("chunk offsets", "chunk sizes", "add chunk", "drop chunk") and tensor and entry.chunks:
        c = entry.chunks[0]
        if what == "chunk offsets":
            entry.chunks[0] = ChunkStorageMetadata(offsets=torch.Size(value), sizes=c.sizes)
        elif what == "chunk sizes":
            entry.chunks[0] = ChunkStorageMetadata(offsets=c.offsets, sizes=torch.Size(value))
        elif what == "add chunk":
            entry.chunks.append(ChunkStorageMetadata(offsets=torch.Size(value), sizes=c.sizes))
            if infos:
                md.storage_data[MetadataIndex(name, torch.Size(value))] = infos[0][1]
        else:
            entry.chunks.pop()
        if what == "chunk offsets" and infos:  # the storage entry follows its chunk
            md.storage_data[MetadataIndex(name, torch.Size(value))] = md.storage_data.pop(infos[0][0])
    elif what.startswith("storage") and infos:
        key, info = infos[0]
        field = {"storage offset": "offset", "storage length": "length", "storage file": "relative_path"}[what]
        md.storage_data[key] = dataclasses.replace(info, **{field: value})
    elif what == "dtype" and tensor:
        entry.properties = dataclasses.replace(entry.properties, dtype=getattr(torch, value))
    elif what == "planner":
        md.planner_data = {**(md.planner_data or {}), name: tuple(value)}


def check_dcp_import(changes: list[tuple[str, str, Any]]) -> None:
    with scratch("ckptguard-fuzz-imp-") as work:
        _check_dcp_import(work, changes)


def _check_dcp_import(work: Path, changes: list[tuple[str, str, Any]]) -> None:
    import shutil

    src = work / "src"
    shutil.copytree(_dcp_base(), src)
    md = pickle.loads((src / ".metadata").read_bytes())
    md = copy.deepcopy(md)
    for change in changes:
        try:
            _apply_metadata(md, *change)
        except (ValueError, TypeError, OverflowError, RuntimeError):
            continue  # a value torch's own records refuse to hold: not writable to a .metadata
    try:
        (src / ".metadata").write_bytes(pickle.dumps(md))
    except (ValueError, TypeError, OverflowError, pickle.PicklingError):
        return
    with bounded():
        roots = []
        for i in range(2):
            try:
                import_checkpoint(src, work / f"root{i}", 1)
            except CheckpointError:
                assert i == 0, "imported once, refused the second time"
                return
            roots.append(work / f"root{i}")
        for root in roots:
            assert verify_checkpoint(str(root), CheckpointName(1), threads=1).intact
            with Checkpointer(root, read_only=True) as ck:
                ck.read(1)
        data = [
            sorted(
                (p.relative_to(r / "step-00000001").as_posix(), p.read_bytes())
                for p in (r / "step-00000001" / "data").rglob("*")
                if p.is_file()
            )
            for r in roots
        ]
        assert data[0] == data[1], "two imports of the same directory stored different bytes"


@CI
@given(metadata_edits())
def test_import_of_hostile_dcp_metadata_ci(changes: list[tuple[str, str, Any]]) -> None:
    check_dcp_import(changes)


# -- torch.save and safetensors files --------------------------------------------------------------


@st.composite
def byte_edits(draw: st.DrawFn, size: int) -> list[tuple[int, int]]:
    """(position, byte) overwrites, or a cut (byte -1: the file ends at position)."""
    n = draw(st.integers(1, 4))
    return [(draw(st.integers(0, size - 1)), draw(st.integers(-1, 255))) for _ in range(n)]


def _edited(raw: bytes, edits: list[tuple[int, int]]) -> bytes:
    data = bytearray(raw)
    for pos, b in edits:
        if b < 0:
            del data[pos:]
        elif pos < len(data):
            data[pos] = b
    return bytes(data)


def check_torch_file(edits: list[tuple[int, int]]) -> None:
    with scratch("ckptguard-fuzz-pt-") as work, bounded():
        (work / "s.pt").write_bytes(_edited(_files_base()[0], edits))
        try:
            import_checkpoint(work / "s.pt", work / "root", 1)
        except CheckpointError:
            return
        assert verify_checkpoint(str(work / "root"), CheckpointName(1), threads=1).intact


@st.composite
def safetensors_headers(draw: st.DrawFn) -> bytes:
    """The saved file with a field of one tensor's header entry set to a hostile value."""
    raw = _files_base()[1]
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
    value = draw(
        st.sampled_from(["F32", "I32", "F64", "BOOL", "F8_E4M3", "X"])
        if field == "dtype"
        else st.lists(numbers, max_size=3)
    )
    header[name][field] = value
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + raw[8 + n :]


def check_safetensors(data: bytes) -> None:
    with scratch("ckptguard-fuzz-st-") as work, bounded():
        (work / "s.safetensors").write_bytes(data)
        try:
            load_file(work / "s.safetensors")
        except CheckpointError:
            return


@CI
@given(st.deferred(lambda: byte_edits(len(_files_base()[0]))))
def test_import_of_a_damaged_torch_save_file_ci(edits: list[tuple[int, int]]) -> None:
    check_torch_file(edits)


@CI
@given(
    st.one_of(
        safetensors_headers(),
        st.deferred(lambda: byte_edits(len(_files_base()[1]))).map(lambda e: _edited(_files_base()[1], e)),
    )
)
def test_load_file_of_a_hostile_safetensors_file_ci(data: bytes) -> None:
    check_safetensors(data)


@pytest.mark.long
@seed(LONG_SEED)
@LONG
@given(
    st.one_of(
        metadata_edits().map(lambda c: ("dcp", c)),
        st.deferred(lambda: byte_edits(len(_files_base()[0]))).map(lambda e: ("pt", e)),
        safetensors_headers().map(lambda d: ("st", d)),
    )
)
def test_imports_long(case: tuple[str, Any]) -> None:
    kind, value = case
    if kind == "dcp":
        check_dcp_import(value)
    elif kind == "pt":
        check_torch_file(value)
    else:
        check_safetensors(value)


_REGRESSIONS = Path(__file__).parent / "regressions" / "import_cases.json"


@pytest.mark.parametrize("case", json.loads(_REGRESSIONS.read_text()), ids=lambda c: c["name"])
def test_import_regressions_found_by_the_fuzzer(case: dict[str, Any]) -> None:
    """Shrunk counterexamples of earlier runs (each failed before its fix)."""
    if case["kind"] == "pt":
        check_torch_file([(p, b) for p, b in case["edits"]])
    else:
        check_dcp_import([(w, n, v) for w, n, v in case["changes"]])
