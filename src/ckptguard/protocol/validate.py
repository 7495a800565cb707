"""Every invariant of a manifest that relates one field to another, checked in one function.

``check_manifest`` is what every reader of a checkpoint runs on the manifest it parsed
(``Manifest.from_json``: load, read, export, import, verify, ``ls`` and ``run --checkpoints``
all get their manifest from it), so "verify says intact" and "load succeeds" judge the same
manifest by the same rules. The fields' types and bounds are the schema's
(protocol/schema.py, checked in C while decoding); here: the head (format, version, encoding,
algorithm, attempt, storage domain); files and artifact rows;
items (hex checksums, inside their file, shapes of their bytes, tiling each data file:
protocol/validate_items.py); DCP's metadata (whole records, planner paths one tree, agreeing with the
items, chunks covering each tensor exactly once: protocol/validate_dcp.py).

A failure raises ``CheckpointError`` naming the field (``Manifest.from_json`` makes it a
``CorruptCheckpointError`` naming the file).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from itertools import pairwise, repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptguard.checksum import ALGORITHMS
from ckptguard.dcp.records import MAX_VALUE_DEPTH
from ckptguard.errors import CorruptCheckpointError
from ckptguard.protocol.itemtable import ItemTable
from ckptguard.protocol.layout import is_plain_relpath
from ckptguard.protocol.records import ATTEMPT_PATTERN
from ckptguard.protocol.schema import DcpBody, ManifestBody
from ckptguard.protocol.validate_dcp import check_chunks_agree, check_dcp_agrees, dcp_entries
from ckptguard.protocol.validate_items import expect, invalid, item_checksums, items, tiling

if TYPE_CHECKING:
    from ckptguard.protocol.manifest import Manifest

FORMAT = "ckptguard-checkpoint"
FORMAT_VERSION = 2
#: How the binary section after the JSON head is encoded (``rows.encoding`` in the head).
ROWS_ENCODING = "msgpack-columns"


def check_head(body: ManifestBody, rows_bytes: int) -> None:
    """What the head says about itself and its row section (before the row section is decoded)."""
    expect(body.format == FORMAT, "wrong format tag")
    expect(
        body.format_version == FORMAT_VERSION,
        f"format_version {body.format_version!r} is not supported by this ckptguard "
        f"(expects {FORMAT_VERSION}); upgrade ckptguard",
    )
    expect(body.rows.encoding == ROWS_ENCODING, f"rows.encoding {body.rows.encoding[:40]!r} is not {ROWS_ENCODING!r}")
    expect(
        body.rows.bytes == rows_bytes,
        f"the row section has {rows_bytes} bytes, the head says {body.rows.bytes} (truncated or appended to)",
    )


def check_manifest(m: Manifest, dcp: DcpBody, part: tuple[int, int] = (0, 1)) -> None:
    """Every cross-field invariant of a parsed manifest (module docstring); ``dcp``: DCP's metadata as
    the schema decoded it. ``part`` (k, n): the checks relating DCP entries and item rows
    of the names k, k + n, ... only (the ranks of a storage domain share that work).

    Raises:
        CheckpointError: naming the field that breaks an invariant.
    """
    expect(m.checksum_algorithm in ALGORITHMS, f"unknown checksum algorithm {m.checksum_algorithm[:40]!r}")
    _attempt(m.attempt)
    _domain(m)
    for f in m.files:
        _relpath(f.path, "file path")
    _artifacts(m)
    table = m.items
    if not isinstance(table, ItemTable):
        table = ItemTable.from_items(table, [f.path for f in m.files])
    item_checksums(table)
    items(table, m.files)
    tiling(table, m.files)
    entries = dcp.state_dict
    dcp_entries(entries, part)
    _planner_paths(dcp.planner_data)
    check_dcp_agrees(m.dcp, entries, table, part)
    check_chunks_agree(entries, table, whole=m.domain_count == 1, part=part)


def check_whole_reads(m: Manifest, declared: Mapping[str, int], path: str) -> None:
    """Before a template-free read (``read``, ``export``) allocates each tensor of ``declared`` (name:
    bytes) whole: the bytes of each are stored in this manifest. Where the manifest is the only storage
    domain's, its parse already bounded every tensor so; a manifest of one domain of several bounds a
    tensor only by its own chunk list, and the chunks another domain stores cannot be read here anyway.

    Raises:
        CorruptCheckpointError: naming ``path`` and the first tensor larger than what is stored for it.
    """
    table = m.items
    if isinstance(table, ItemTable):
        per_name = np.bincount(table.name, weights=table.length.astype(np.float64), minlength=len(table.names))
        stored = dict(zip(table.names, per_name.tolist(), strict=True))
    else:
        stored = {}
        for item in table:
            stored[item.fqn] = stored.get(item.fqn, 0) + item.length
    for fqn, nbytes in declared.items():
        if nbytes > stored.get(fqn, 0):
            raise CorruptCheckpointError(
                f"{path}: dcp.state_dict[{fqn[:100]!r}] declares {nbytes} bytes, this manifest stores "
                f"{int(stored.get(fqn, 0))} for it (storage domain {m.domain_index} of {m.domain_count}): "
                "a read would allocate what it cannot fill; read it where every byte is stored",
                path=path,
            )


def _planner_paths(planner: dict[str, list[str | int]]) -> None:
    """Lists and dicts are rebuilt from planner_data (values.unflatten): each path non-empty, no deeper
    than a stored value may nest, starting with a key, each index below the number of entries, and the
    paths one tree (what follows a prefix is always an index, always a key, or the value itself).

    Paths are grouped by their signature (the type of each part): every check above holds within a
    group by its signature alone, so a checkpoint of many tensors pays a few C-level passes per group,
    not a Python loop per path part; a manifest that fails, or has too many groups to compare, is walked
    path by path (``_walk_planner_paths``), which names the first bad path."""
    if not _planner_paths_hold(planner):
        _walk_planner_paths(planner)


#: Beyond this many path signatures, the groups are not compared pairwise: the paths are walked.
_MAX_SIGNATURES = 32


def _planner_paths_hold(planner: dict[str, list[str | int]]) -> bool:
    """True only where every path passes ``_walk_planner_paths`` (False: walk them to find out)."""
    entries = len(planner)
    paths = list(planner.values())
    signatures = list(map(tuple, map(map, repeat(type), paths)))
    distinct = list(dict.fromkeys(signatures))
    if len(distinct) > _MAX_SIGNATURES:
        return False
    groups: dict[tuple[type, ...], list[list[str | int]]]
    if len(distinct) == 1:
        groups = {distinct[0]: paths}
    else:
        groups = {sig: [] for sig in distinct}
        for sig, path in zip(signatures, paths, strict=True):
            groups[sig].append(path)
    for sig, group in groups.items():
        if not (0 < len(sig) <= MAX_VALUE_DEPTH and sig[0] is str and set(sig) <= _PATH_PART_TYPES):
            return False
        for j, kind in enumerate(sig):  # (bool is not int here: type() is compared exactly)
            if kind is int:
                column = list(map(itemgetter(j), group))
                if min(column) < 0 or max(column) >= entries:
                    return False
    # Two paths of one signature agree on what follows any prefix they share; two of different
    # signatures can disagree only at the first part where their signatures differ (the value's end
    # counted as a part): there, no prefix of one may be a prefix of the other.
    sigs = list(groups)
    for a, sig_a in enumerate(sigs):
        for sig_b in sigs[a + 1 :]:
            j = next(
                (i for i, (x, y) in enumerate(zip(sig_a, sig_b, strict=False)) if x is not y),
                min(len(sig_a), len(sig_b)),
            )
            cut = itemgetter(slice(0, j))
            if not set(map(tuple, map(cut, groups[sig_a]))).isdisjoint(map(tuple, map(cut, groups[sig_b]))):
                return False
    return True


_PATH_PART_TYPES = frozenset({str, int})


def _walk_planner_paths(planner: dict[str, list[str | int]]) -> None:
    """``_planner_paths`` path by path: raises naming the first bad path (messages made on failure only)."""
    entries = len(planner)
    kinds: dict[tuple[str | int, ...], str] = {}
    for k, path in planner.items():
        if not (
            0 < len(path) <= MAX_VALUE_DEPTH
            and type(path[0]) is str
            and all(type(p) is str or (type(p) is int and 0 <= p < entries) for p in path)
        ):
            invalid(f"planner_data[{k[:100]!r}]: bad planner path {str(path)[:100]}")
        for i, p in enumerate([*path, None]):
            kind = "value" if p is None else type(p).__name__
            if kinds.setdefault(tuple(path[:i]), kind) != kind:
                invalid(
                    f"planner_data[{k[:100]!r}]: bad planner path {str(path)[:100]}: "
                    "it nests where another path does not"
                )


def _domain(m: Manifest) -> None:
    """The storage domain: one of ``count`` (at most one per rank), its ranks distinct, ascending and of
    the world (a reader bounds a tensor by what this manifest stores only where it is the one domain)."""
    expect(m.domain_count <= m.world_size, f"domain.count {m.domain_count} is more than world_size {m.world_size}")
    expect(m.domain_index < m.domain_count, f"domain.index {m.domain_index} is not below domain.count {m.domain_count}")
    ranks = m.domain_ranks
    expect(
        bool(ranks) and all(a < b for a, b in pairwise(ranks)) and ranks[-1] < m.world_size,
        f"domain.ranks {ranks[:8]} must be distinct ranks below world_size {m.world_size}, ascending",
    )


def _artifacts(m: Manifest) -> None:
    """Each artifact row names a listed file of its rank, which carries its own checksum."""
    files = {f.path: f for f in m.files}
    seen: set[tuple[int, str]] = set()
    named: set[str] = set()
    for a in m.artifacts:
        where = f"artifacts[rank {a.rank}, {a.key[:100]!r}]"
        expect(a.kind in ("file", "dir"), f"{where}: kind must be file or dir")
        expect((a.rank, a.key) not in seen, f"{where} is listed twice")
        seen.add((a.rank, a.key))
        expect(a.kind == "dir" or len(a.files) == 1, f"{where}: a file artifact has one file row, not {len(a.files)}")
        expect(a.rank < m.world_size, f"{where}: rank {a.rank} is not below world_size {m.world_size}")
        for rel, stored in a.files:
            _relpath(rel, f"{where} relative path")
            _relpath(stored, f"{where} stored path")
            f = files.get(stored)
            expect(f is not None, f"{where}: its file {stored[:200]!r} is not in the manifest's file list")
            assert f is not None
            expect(
                f.checksum is not None and f.rank == a.rank,
                f"{where}: its file {stored[:200]!r} is not a file of rank {a.rank} with a checksum",
            )
            named.add(stored)
    # A file with its own checksum is an artifact's (data files are covered by their items): one that no
    # artifact row names was not written by a save.
    orphans = [f.path for f in m.files if f.checksum is not None and f.path not in named]
    expect(
        not orphans,
        f"files: {orphans[0][:200]!r} has a checksum of its own, and no artifact names it" if orphans else "",
    )


def _str(v: Any, what: str) -> str:
    expect(isinstance(v, str), f"{what} must be a string")
    return str(v)


def _attempt(v: Any) -> str:
    # Object stores read a checkpoint's data under staging/step-N.<attempt>: a path part, so hex only.
    expect(
        isinstance(v, str) and re.fullmatch(ATTEMPT_PATTERN, v) is not None,
        f"attempt {str(v)[:100]!r} must be 16-64 hex digits",
    )
    return str(v)


def _relpath(v: Any, what: str) -> str:
    p = _str(v, what)
    expect(is_plain_relpath(p), f"{what} {p[:200]!r} must be a plain relative path inside the checkpoint")
    return p


__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ROWS_ENCODING",
    "check_head",
    "check_manifest",
    "check_whole_reads",
]
