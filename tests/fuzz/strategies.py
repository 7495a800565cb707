"""Hypothesis strategies for hostile manifests: edits of a real manifest's decoded fields (any field,
any value a hostile writer could put there) and structurally valid records (a tensor's chunk list and
item rows rewritten together, checksums recomputed: the checksum is not a signature).

An edit is plain data (``Edit``), so a shrunk counterexample is saved as JSON and replayed as a
regression test (tests/fuzz/regressions)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import strategies as st

from ckptguard.checksum import checksum
from ckptguard.protocol.manifest import Manifest

from tests.fuzz.mutate import join, manifest_path, split

#: Numbers at and across every bound a field of a manifest has (int64, uint64, 2**62 bytes, a C int,
#: a float's range).
EDGE_INTS = [
    0,
    1,
    -1,
    2,
    3,
    4,
    7,
    8,
    15,
    16,
    64,
    65,
    255,
    256,
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    2**62 - 1,
    2**62,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    10**400,
]
EDGE_STRINGS = [
    "",
    ".",
    "..",
    "../x",
    "/abs",
    "a//b",
    "a\\b",
    "x" * 5000,
    "\x00",
    "é",
    "\udcff"[:0] + "\u202e",
    "[bold]x[/]",
    "\x1b[31m",
    "float32",
    "int32",
    "bfloat16",
    "bytes",
    "tensor",
    "object",
    "xxh3-64",
    "crc32c",
    "file",
    "dir",
    "msgpack-columns",
    "ckptguard-checkpoint",
    "0" * 16,
    "f" * 15,
    "zz",
    "data/rank00000_0.bin",
    "files/rank00000/cfg/r1-cfg.yaml",
    "u1",
    "u8",
    "f8",
]

scalars = st.one_of(
    st.sampled_from(EDGE_INTS),
    st.integers(),
    st.sampled_from(EDGE_STRINGS),
    st.text(max_size=12),
    st.floats(),
    st.booleans(),
    st.none(),
    st.binary(max_size=40),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(EDGE_STRINGS[:8]) | st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@dataclass(frozen=True)
class Edit:
    """One change to a manifest's decoded ``{"body": ..., "tables": ...}``: ``op`` at ``path``."""

    op: str  # "set", "delete", "append" (a copy of the last element), "grow" (a copy of the element)
    path: tuple[str | int, ...]
    value: Any = None

    def to_json(self) -> Any:
        return {"op": self.op, "path": list(self.path), "value": _jsonable(self.value)}

    @staticmethod
    def from_json(obj: Any) -> Edit:
        return Edit(obj["op"], tuple(obj["path"]), _unjsonable(obj["value"]))


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"$bytes": v.hex()}
    if isinstance(v, float) and v != v:
        return {"$float": "nan"}
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return {"$float": str(v)}
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {"$dict": [[_jsonable(k), _jsonable(x)] for k, x in v.items()]}
    return v


def _unjsonable(v: Any) -> Any:
    if isinstance(v, dict) and "$bytes" in v:
        return bytes.fromhex(v["$bytes"])
    if isinstance(v, dict) and "$float" in v:
        return float(v["$float"])
    if isinstance(v, dict) and "$dict" in v:
        return {_unjsonable(k): _unjsonable(x) for k, x in v["$dict"]}
    if isinstance(v, list):
        return [_unjsonable(x) for x in v]
    return v


def paths(doc: Any, prefix: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """Every place in a decoded manifest: containers and leaves."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from paths(v, (*prefix, i))


def apply(doc: Any, edit: Edit) -> None:
    """``edit`` on ``doc`` in place; a path that no longer leads anywhere (an earlier edit removed it)
    changes nothing."""
    parent: Any = doc
    for step in edit.path[:-1]:
        try:
            parent = parent[step]
        except (KeyError, IndexError, TypeError):
            return
    if not edit.path:
        return
    key: Any = edit.path[-1]
    if not isinstance(parent, dict | list) or (
        isinstance(parent, list) and not (isinstance(key, int) and -len(parent) <= key < len(parent))
    ):
        if isinstance(parent, dict) and edit.op == "set":
            parent[key] = edit.value
        return
    if isinstance(parent, dict) and key not in parent and edit.op != "set":
        return
    if edit.op == "set":
        parent[key] = edit.value
    elif edit.op == "delete":
        del parent[key]
    elif edit.op == "grow" and isinstance(parent, list):
        parent.insert(int(key), json.loads(json.dumps(_jsonable(parent[key]))))
    elif edit.op == "append" and isinstance(parent[key], list) and parent[key]:
        parent[key].append(parent[key][-1])


def edits(doc: Any) -> st.SearchStrategy[list[Edit]]:
    """One to three edits of ``doc``'s fields: a hostile value, a removal, or an element repeated."""
    places = sorted((p for p in set(paths(doc)) if len(p) >= 2), key=repr)  # inside the body or the tables
    one = st.builds(
        Edit, st.sampled_from(["set", "set", "set", "delete", "grow", "append"]), st.sampled_from(places), values
    )
    return st.lists(one, min_size=1, max_size=3)


def rewrite_with_edits(root: Path, step: int, changes: list[Edit]) -> None:
    """Step's manifest with ``changes`` applied to its decoded fields, resealed."""
    path = manifest_path(root, step)
    body, tables = split(path.read_bytes())
    doc: dict[str, Any] = {"body": body, "tables": tables}
    for e in changes:
        apply(doc, e)
    body, tables = doc["body"], doc["tables"]
    try:
        text = json.dumps(body, separators=(",", ":"), default=_jsonable).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError):  # a key json cannot write: the edit stands as written by msgspec
        text = msgspec.json.encode(body)
    try:
        packed = msgspec.msgpack.encode(tables)
    except (TypeError, OverflowError):
        try:
            packed = msgspec.msgpack.encode(json.loads(json.dumps(_jsonable(tables))))
        except OverflowError:  # MessagePack has no integer beyond 64 bits: no writer can store the edit
            return
    rows = body.get("rows") if isinstance(body, dict) else None
    if isinstance(rows, dict) and "bytes" not in [e.path[-1] for e in changes if e.path[:2] == ("body", "rows")]:
        rows["bytes"] = len(packed)
        text = json.dumps(body, separators=(",", ":"), default=_jsonable).encode("utf-8", "surrogatepass")
    path.write_bytes(join_raw(text, packed))


def join_raw(text: bytes, packed: bytes) -> bytes:
    from ckptguard.protocol.manifest import seal

    return seal(text, packed)


# -- structurally valid hostile records: a tensor's chunks and items rewritten together -----------


@st.composite
def chunk_layouts(draw: st.DrawFn, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Chunks (offsets, sizes) of a tensor of ``shape``: a grid split (a real sharding), then maybe
    one chunk moved, resized, repeated or dropped (a hostile one)."""
    cuts = []
    for n in shape:
        inner = draw(st.lists(st.integers(1, max(1, n - 1)), max_size=2, unique=True)) if n > 1 else []
        cuts.append([0, *sorted(inner), n])
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), ())]
    for bounds in cuts:
        chunks = [((*o, a), (*s, b - a)) for o, s in chunks for a, b in itertools.pairwise(bounds)]
    how = draw(st.sampled_from(["as is", "as is", "move", "resize", "repeat", "drop", "swap"]))
    i = draw(st.integers(0, len(chunks) - 1))
    off, size = chunks[i]
    d = draw(st.integers(0, len(shape) - 1))
    delta = draw(st.sampled_from([-2, -1, 1, 2, 2**62, -(2**62)]))
    if how == "move":
        chunks[i] = ((*off[:d], off[d] + delta, *off[d + 1 :]), size)
    elif how == "resize":
        chunks[i] = (off, (*size[:d], size[d] + delta, *size[d + 1 :]))
    elif how == "repeat":
        chunks.append(chunks[i])
    elif how == "drop" and len(chunks) > 1:
        chunks.pop(i)
    elif how == "swap" and len(chunks) > 1:
        chunks[0], chunks[-1] = chunks[-1], chunks[0]
    return chunks


def rewrite_chunks(root: Path, step: int, fqn: str, chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """``fqn``'s DCP chunk list set to ``chunks`` and its item rows to one per chunk, each over the next
    bytes of its data file (as many as the chunk's elements take), checksums recomputed."""
    path = manifest_path(root, step)
    m = Manifest.from_json(path.read_bytes(), str(path))
    (one,) = [i for i in m.items if i.fqn == fqn]
    data = (root / f"step-{step:08d}" / one.file).read_bytes()
    itemsize = one.length // max(1, _prod(one.shape or ()))
    rows, pos = [], one.offset
    for off, size in chunks:
        n = max(0, _prod(size)) * itemsize
        n = n if n < 1 << 40 else 0
        rows.append(
            one._replace(
                offsets=off,
                shape=tuple(max(0, s) for s in size),
                offset=pos,
                length=n,
                checksum=checksum(m.checksum_algorithm, data[pos : pos + n]),
            )
        )
        pos += n
    items = [r for i in m.items for r in (rows if i.fqn == fqn else [i])]
    dcp = json.loads(json.dumps(m.dcp))
    dcp["state_dict"][fqn]["chunks"] = [v for off, size in chunks for v in (*off, *size)]
    try:
        out = dataclasses.replace(m, dcp=dcp, items=items).to_json()
    except (ValueError, OverflowError):  # a row the encoder cannot write (negative): not a manifest
        return
    path.write_bytes(out)


def _prod(xs: tuple[int, ...]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


__all__ = [
    "EDGE_INTS",
    "EDGE_STRINGS",
    "Edit",
    "apply",
    "chunk_layouts",
    "edits",
    "join",
    "paths",
    "rewrite_chunks",
    "rewrite_with_edits",
    "values",
]
