"""The manifest's item columns: what ranks send and the leader joins comes back row for row."""

from __future__ import annotations

import pickle

from ckptguard.dcp.records import FileEntry, StoredItem
from ckptguard.protocol.decisions import RankWrites, build_manifests
from ckptguard.protocol.itemtable import ItemTable
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import Manifest
from ckptguard.protocol.topology import Topology


def _rank_rows(rank: int) -> tuple[list[FileEntry], list[StoredItem]]:
    paths = [f"data/rank{rank:05d}_{i}.bin" for i in range(2)]
    rows = [
        StoredItem(f"layer{rank % 3}.w", (rank * 4, 0), paths[rank % 2], 0, 64, f"{rank:016x}", "float32", (4, 4)),
        StoredItem(f"only{rank}", None, paths[0], 0, 5, f"{rank + 1:016x}"),
        StoredItem("shared", (), paths[1], 0, 2, f"{rank + 2:016x}", "bfloat16" if rank % 2 else "int16", ()),
    ]
    return _tiled(paths, rank, rows)


def _tiled(paths: list[str], rank: int, rows: list[StoredItem]) -> tuple[list[FileEntry], list[StoredItem]]:
    """Each row placed right after the ones before it in its file, and each file exactly as long as its
    rows: the items of a data file tile it, as a save writes them (a manifest's parse checks it)."""
    end = dict.fromkeys(paths, 0)
    placed = []
    for row in rows:
        placed.append(row._replace(offset=end[row.file]))
        end[row.file] += row.length
    return [FileEntry(p, end[p], rank) for p in paths], placed


def test_tables_of_ranks_with_different_names_and_dtypes_join_row_for_row() -> None:
    """Ranks whose name and dtype tables differ (the leader remaps them) and whose file indices are
    their own: the joined manifest lists every rank's rows, in rank order, on the right files."""
    n = 5
    writes, expected, files = [], [], []
    for r in range(n):
        f, rows = _rank_rows(r)
        table = pickle.loads(pickle.dumps(ItemTable.from_items(rows, [x.path for x in f])))  # as a rank sends it
        writes.append(RankWrites(f, [], table))
        expected += rows
        files += f
    topo = Topology(0, n, (tuple(range(n)),), tuple(f"h{r}" for r in range(n)))
    m = build_manifests(topo, CheckpointName(1), "ab" * 16, "xxh3-64", writes, {}, {})[0]
    assert list(m.items) == expected and m.files == files
    again = Manifest.from_json(m.to_json(), "MANIFEST.json")
    assert list(again.items) == expected and again.files == files


def test_rows_of_every_kind_a_rank_may_send_come_back_from_the_manifest_row_for_row() -> None:
    """Rows sent as plain lists beside tables, a table whose file list is not its rank's, and
    checksums of other widths, in uppercase and of odd width (stored as text, not as bytes): the
    manifest lists each row as it was sent, and parses back to the same rows."""
    n = 6
    writes, expected, files = [], [], []
    for r in range(n):
        f, rows = _rank_rows(r)
        if r == 2:
            rows = [x._replace(checksum=x.checksum.upper().replace("0", "A")) for x in rows]
        if r == 3:
            rows = [x._replace(checksum=x.checksum[:8]) for x in rows]
        if r == 4:
            rows = [x._replace(checksum=x.checksum[:15]) for x in rows]  # odd width
        paths = [x.path for x in f]
        sent: object = rows if r == 0 else pickle.loads(pickle.dumps(ItemTable.from_items(rows, paths)))
        if r == 5:  # a table over more files than the rank reports: its rows are taken one by one
            sent = ItemTable.from_items(rows, [*paths, "data/elsewhere.bin"])
        writes.append(RankWrites(f, [], sent))  # type: ignore[arg-type]
        expected += rows
        files += f
    topo = Topology(0, n, (tuple(range(n)),), tuple(f"h{r}" for r in range(n)))
    for subset in (range(n), range(1, 3), range(3, 5)):
        m = build_manifests(
            Topology(0, n, (tuple(subset),), topo.hosts), CheckpointName(1), "ab" * 16, "xxh3-64", writes, {}, {}
        )[subset[0]]
        want = [row for r in subset for row in _sent_rows(writes[r])]
        assert list(m.items) == want
        assert list(Manifest.from_json(m.to_json(), "MANIFEST.json").items) == want
    assert [row for w in writes for row in _sent_rows(w)] == expected


def _sent_rows(w: RankWrites) -> list[StoredItem]:
    return list(w.items)


def test_the_rows_taken_from_a_table_are_those_rows() -> None:
    """``take`` (a load's rows of its own names) gives back exactly the rows asked for, in that order,
    through every kind of row (offsets or none, shapes of any rank, objects), also after the wire."""
    import numpy as np

    rows, paths = [], []
    for r in range(4):
        f, rs = _rank_rows(r)
        rows += rs
        paths += [x.path for x in f]
    table = ItemTable.from_items(rows, paths)
    wire = pickle.loads(pickle.dumps(table))
    for t in (table, wire):
        for pick in ([], [0], [11, 1, 5], list(range(len(rows))), [3, 3, 7]):
            assert list(t.take(np.array(pick, dtype=np.int64))) == [rows[i] for i in pick]
