"""DCP's chunk lists in the manifest, built from the ranks' item tables, are byte for byte the ones
read from DCP's own metadata: over DCP's real global planning (de-duplication, our per-domain
copies) and over a real save by ranks simulated as threads."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ckptguard.comm import Comm
from ckptguard.dcp.codec import metadata_to_json
from ckptguard.dcp.planners import DomainSavePlanner, forget_cached_plans
from ckptguard.dcp.records import FileEntry
from ckptguard.dcp.writer import _stored
from ckptguard.protocol import decisions
from ckptguard.protocol import save as save_protocol
from ckptguard.protocol.decisions import RankWrites, build_manifests
from ckptguard.protocol.itemtable import ItemTable, msgpack_uints
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.root import open_root
from ckptguard.protocol.session import Options, open_session
from ckptguard.protocol.timing import PhaseTimer
from ckptguard.protocol.topology import Topology
from ckptguard.state import prepare_state
from ckptguard.threadranks import run_ranks

WORLD = 128  # twice decisions._TABLE_CHUNKS_FROM: even the half-world "hsdp" can take the table path


def _shard(fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], size: tuple[int, ...]) -> WriteItem:
    """The write item DCP makes for one local shard of a DTensor / FSDP flat parameter."""
    return WriteItem(
        MetadataIndex(fqn, torch.Size(offsets)),
        WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
            TensorProperties(dtype=torch.float32),
            torch.Size(size),
        ),
    )


def _local_plans(
    world: int, domain_of_rank: list[int], key: str, mixed: bool
) -> tuple[list[SavePlan], DomainSavePlanner]:
    """Each rank's local plan: the shard items of sharded tensors (one chunk per rank; two chunks on
    some ranks; HSDP-style shards replicated on two ranks, i.e. in two storage domains), and where
    ``mixed``, 2-D ones and DCP's own items for plain tensors (replicated, zero-size, 0-dim) and objects
    (rows of other dimensions than 1: the tables' general path)."""
    plans, coordinator = [], None
    for r in range(world):
        planner = DomainSavePlanner(domain_of_rank, cache_key=key)
        state: dict[str, Any] = (
            {
                "bias": torch.ones(3),
                "empty": torch.zeros(0, 4),
                "scalar": torch.tensor(2.0),
                "opt": {"lr": 0.1, "betas": [0.9, 0.99]},
            }
            if mixed
            else {}
        )
        planner.set_up_planner(state, is_coordinator=r == 0)
        plan = planner.create_local_plan()
        extra = [
            _shard("flat", (r * 1000,), (1000 + (r == world - 1) * 7,), (world * 1000 + 7,)),
            _shard("hsdp", (r % (world // 2) * 10,), (10,), (world // 2 * 10,)),
        ]
        if mixed:
            extra += [
                _shard("grid", (r // 8 * 4, r % 8 * 300), (4, 300), (world // 8 * 4, 2400)),
                _shard("zero_rows", (r * 5, 0), (5, 0), (world * 5, 0)),
            ]
        if r % 3 == 0:  # two chunks of one tensor on one rank: the writer does not keep their order
            extra += [_shard("two", (r * 20 + o,), (10,), (world * 20,)) for o in (0, 10)]
        else:
            extra += [_shard("two", (r * 20,), (20,), (world * 20,))]
        plans.append(SavePlan([*plan.items, *extra], planner_data=plan.planner_data))
        coordinator = coordinator or planner
    assert coordinator is not None
    return plans, coordinator


def _writes(global_plan: list[SavePlan], seed: int, shuffle: bool = True) -> list[RankWrites]:
    """What each rank stores for its final plan (the writer's rows, in an order of its own unless not
    ``shuffle``)."""
    rng = random.Random(seed)
    writes = []
    for r, plan in enumerate(global_plan):
        rel = f"data/rank{r:05d}_0.bin"
        rows, offset = [], 0
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                rows.append(_stored(item, None, rel, offset, 7, f"{rng.getrandbits(64):016x}"))
                offset += 7
                continue
            assert item.tensor_data is not None
            owner = torch.empty(tuple(item.tensor_data.chunk.sizes))
            rows.append(_stored(item, owner, rel, offset, owner.nbytes, f"{rng.getrandbits(64):016x}"))
            offset += owner.nbytes
        if shuffle:
            rng.shuffle(rows)
        writes.append(RankWrites([FileEntry(rel, offset, r)], [], ItemTable.from_items(rows, [rel])))
    return writes


@pytest.mark.parametrize(("domains", "mixed"), [(1, True), (2, True), (4, True), (1, False), (2, False)])
def test_chunk_lists_from_the_tables_are_dcps_byte_for_byte(domains: int, mixed: bool) -> None:
    """One storage domain (every item stored once) and several (replicated items stored once per
    domain): each domain's manifest is the same bytes whichever way DCP's chunk lists were built, and
    the sharded tensors' lists did come from the tables."""
    per = WORLD // domains
    domain_of_rank = [r // per for r in range(WORLD)]
    key = f"test-chunks-{domains}-{mixed}"
    try:
        plans, coordinator = _local_plans(WORLD, domain_of_rank, key, mixed)
        global_plan, md = coordinator.create_global_plan(plans)
    finally:
        forget_cached_plans(key)
    writes = _writes(global_plan, domains)
    topo = Topology(
        0,
        WORLD,
        tuple(tuple(range(d * per, (d + 1) * per)) for d in range(domains)),
        tuple(f"h{r}" for r in range(WORLD)),
    )
    fast = build_manifests(topo, CheckpointName(1), "ab" * 16, "xxh3-64", writes, {}, md)
    walked = build_manifests(topo, CheckpointName(1), "ab" * 16, "xxh3-64", writes, {}, metadata_to_json(md))
    assert sorted(fast) == sorted(walked) == [d * per for d in range(domains)]
    for leader in fast:
        fast[leader].created_at = walked[leader].created_at = 0.0
        assert fast[leader].to_json() == walked[leader].to_json()
    from_tables = {k for k, v in fast[0].dcp["state_dict"].items() if isinstance(v.get("chunks"), msgspec.Raw)}
    # Sharded over every rank, one chunk per rank: from the tables; "two" (two chunks on a rank) and,
    # with several domains, "hsdp" (its shards stored once more per domain) from DCP's objects.
    want = {"flat"} | ({"grid", "zero_rows"} if mixed else set()) | ({"hsdp"} if domains == 1 else set())
    assert from_tables == want, from_tables
    assert len(md.state_dict_metadata["hsdp"].chunks) == WORLD // 2  # de-duplicated by DCP


def test_chunk_lists_of_ranks_holding_the_same_names_in_the_same_order_are_dcps_byte_for_byte() -> None:
    """A sharded model (every rank one chunk of each tensor, its rows in one order) takes the tables'
    grid path, without a sort: the manifest is still the bytes the walk of DCP's chunks gives."""
    key = "test-chunks-grid"
    try:
        coordinator = DomainSavePlanner([0] * WORLD, cache_key=key)
        coordinator.set_up_planner({}, is_coordinator=True)
        plans = [
            SavePlan(
                [
                    _shard("b", (r * 3,), (3,), (WORLD * 3,)),
                    _shard("grid", (r // 8 * 4, r % 8 * 300), (4, 300), (WORLD // 8 * 4, 2400)),
                    _shard("a", (r * 10,), (10,), (WORLD * 10,)),
                ],
                planner_data={},
            )
            for r in range(WORLD)
        ]
        global_plan, md = coordinator.create_global_plan(plans)
    finally:
        forget_cached_plans(key)
    writes = _writes(global_plan, 0, shuffle=False)
    joined = ItemTable.join([w.items for w in writes])
    assert joined._rank_grid([3] * WORLD) is not None  # the grid path is the one tested
    topo = Topology(0, WORLD, (tuple(range(WORLD)),), tuple(f"h{r}" for r in range(WORLD)))
    fast = build_manifests(topo, CheckpointName(1), "ab" * 16, "xxh3-64", writes, {}, md)[0]
    walked = build_manifests(topo, CheckpointName(1), "ab" * 16, "xxh3-64", writes, {}, metadata_to_json(md))[0]
    fast.created_at = walked.created_at = 0.0
    assert fast.to_json() == walked.to_json()
    assert {k for k, v in fast.dcp["state_dict"].items() if isinstance(v.get("chunks"), msgspec.Raw)} == {
        "a",
        "b",
        "grid",
    }


def test_msgpack_uints_is_msgspecs_encoding() -> None:
    """Every form of an integer (fixint, 8, 16, 32, 64 bits), at every boundary, in runs and mixed,
    and every array header (fix, 16-bit, 32-bit count)."""
    edges = [0, 1, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 63) - 1]
    rng = random.Random(7)
    for count in (0, 1, 7, 8, 9, 33_000):  # 66,000 values in two columns: a 32-bit count
        for cols in (1, 2):
            mixed = [[rng.choice(edges) for _ in range(cols)] for _ in range(count)]
            runs = sorted(mixed)
            for rows in (mixed, runs):
                values = torch.tensor(rows, dtype=torch.int64).reshape(count, cols).numpy()
                assert msgpack_uints(values) == msgspec.msgpack.encode([v for row in rows for v in row])
    with pytest.raises(ValueError):
        msgpack_uints(torch.tensor([[1, -1]]).numpy())


def test_a_real_save_writes_the_manifest_the_walk_of_dcps_chunks_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks as threads save plain, zero-size and 0-dim tensors and objects through the real planner
    and writer; the leader's manifest is the same bytes as the one built from DCP's own chunk list."""
    seen: list[tuple[bytes, bytes]] = []
    from_tables: set[str] = set()
    real = decisions.build_manifests
    monkeypatch.setattr(decisions, "_TABLE_CHUNKS_FROM", 1)  # every tensor the tables can give, from them

    def both(
        topo: Topology,
        name: CheckpointName,
        attempt: str,
        algorithm: str,
        writes: list[RankWrites],
        user_metadata: dict[str, Any],
        dcp: Any,
        seq: int | None = None,
    ) -> dict[int, Any]:
        fast = real(topo, name, attempt, algorithm, writes, user_metadata, dcp, seq)
        walked = real(topo, name, attempt, algorithm, writes, user_metadata, metadata_to_json(dcp), seq)
        for leader, m in fast.items():
            walked[leader].created_at = m.created_at
            seen.append((m.to_json(), walked[leader].to_json()))
            from_tables.update(k for k, v in m.dcp["state_dict"].items() if isinstance(v.get("chunks"), msgspec.Raw))
        return fast

    monkeypatch.setattr(save_protocol, "build_manifests", both)

    def body(comm: Comm) -> object:
        session = open_session(
            comm,
            open_root(str(tmp_path / "ck")),
            Options(None, None, 1, "xxh3-64", 10.0),
            read_only=False,
            job_id="test",
            lease_ttl_s=30,
            lease_wait_s=1,
        )
        try:
            state = prepare_state(
                {
                    "w": torch.ones(5, 3),
                    "empty": torch.zeros(0),
                    "scalar": torch.tensor(1.5),
                    "opt": {"step": 3, "names": ["a", "b"]},
                },
                comm.rank,
            ).state_dict
            request = save_protocol.SaveRequest(1, state, [], [], False, {}, None, options=session.options)
            return save_protocol.save(session, request, PhaseTimer())
        finally:
            if session.lease is not None:
                session.lease.release()

    out = run_ranks(3, body, timeout_s=60)
    assert all(isinstance(o, save_protocol.SaveOutcome) for o in out), out
    assert len(seen) == 1 and seen[0][0] == seen[0][1]
    assert from_tables == {"w", "empty", "scalar"}, from_tables
    # The leader writes the manifest in parts (head, tables): the file is to_json's bytes.
    assert (tmp_path / "ck" / CheckpointName(1).dirname / "MANIFEST.json").read_bytes() == seen[0][0]
