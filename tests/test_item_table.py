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
    files = [FileEntry(f"data/rank{rank:05d}_{i}.bin", 4096, rank) for i in range(2)]
    rows = [StoredItem(f"layer{rank % 3}.w", (rank * 4, 0), files[rank % 2].path, 0, 64, f"{rank:016x}",
                       "float32", (4, 4)),
            StoredItem(f"only{rank}", None, files[0].path, 64, 5, f"{rank + 1:016x}"),
            StoredItem("shared", (), files[1].path, 64, 2, f"{rank + 2:016x}", "bfloat16" if rank % 2 else "int16",
                       ())]
    return files, rows


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
