"""What frameworks need from the core: save_file without collectives, a rank-local
Checkpointer, delete, the path of a step, tags, the RNG-state helper, safetensors files."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import ckptguard
from ckptguard import Checkpointer, CheckpointError, PerRank, StepNotFoundError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_zero_only(rank: int, port: int, root: str, q: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=__import__("datetime").timedelta(seconds=60))
    try:
        if rank == 0:  # the usual DDP pattern: rank 0 alone saves; must not wait for rank 1
            ckptguard.save_file({"w": torch.ones(3)}, os.path.join(root, "model.pt"))
            with Checkpointer(os.path.join(root, "ck"), process_group="local") as ck:
                ck.save(1, {"w": torch.ones(3), "opt": {0: {"m": torch.zeros(2)}}})
                got = ck.read()
            q.put(("ok", rank, sorted(got["opt"])))
        else:
            q.put(("ok", rank, None))
        dist.barrier()
    except BaseException as e:  # pragma: no cover - reported to the test
        q.put(("error", rank, repr(e)))
    finally:
        dist.destroy_process_group()


def test_rank_zero_alone_saves_without_any_collective(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_zero_only, args=(r, port, str(tmp_path), q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    got = sorted(q.get(timeout=5) for _ in procs)
    assert got == [("ok", 0, [0]), ("ok", 1, None)]
    assert torch.equal(ckptguard.load_file(tmp_path / "model.pt")["w"], torch.ones(3))


def _hammer(path: str, value: float, count: int, q: mp.Queue) -> None:
    bad = 0
    for _ in range(count):
        ckptguard.save_file({"w": torch.full((64, 64), value)}, path)
        w = ckptguard.load_file(path)["w"]
        bad += not (bool((w == w[0, 0]).all()) and float(w[0, 0]) in (1.0, 2.0))
    q.put(bad)


def test_save_file_from_two_processes_takes_turns_through_its_lock(tmp_path: Path) -> None:
    path = str(tmp_path / "m.pt")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(path, float(v), 15, q)) for v in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [q.get(timeout=5) for _ in procs] == [0, 0]
    assert sorted(os.listdir(tmp_path)) == ["m.pt"]


def test_a_stale_lock_is_broken_and_a_live_one_waited_for(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    dead = mp.get_context("fork").Process(target=lambda: None)
    dead.start()
    dead.join()
    (tmp_path / "m.pt.lock").write_text(f"{socket.gethostname()} {dead.pid} 00")
    ckptguard.save_file({"a": 1}, path)  # the holder is dead: broken at once
    assert ckptguard.load_file(path) == {"a": 1} and not (tmp_path / "m.pt.lock").exists()
    (tmp_path / "m.pt.lock").write_text(f"{socket.gethostname()} {os.getpid()} 00")
    with pytest.raises(ckptguard.PathCollisionError, match="being written by another process"):
        ckptguard.save_file({"a": 2}, path, lock_timeout_s=0.2)
    assert ckptguard.load_file(path) == {"a": 1}


def test_safetensors_files_are_checksummed_and_readable_by_safetensors(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    sd = {"w": torch.randn(4, 5), "b": torch.arange(3, dtype=torch.int64)}
    path = tmp_path / "model.safetensors"
    ckptguard.save_file(sd, path)
    got = ckptguard.load_file(path)
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(f.get_tensor("w"), sd["w"])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ckptguard.CorruptCheckpointError, match="checksum mismatch"):
        ckptguard.load_file(path)
    with pytest.raises(ckptguard.UnsupportedValueError, match="flat dict"):
        ckptguard.save_file({"w": torch.ones(1), "step": 3}, path)
    ckptguard.save_file(sd, tmp_path / "x.bin", format="safetensors")
    assert torch.equal(ckptguard.load_file(tmp_path / "x.bin", format="safetensors")["w"], sd["w"])


def test_delete_path_and_latest(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck") as ck:
        for s in (1, 2, 3):
            ck.save(s, {"x": torch.tensor(float(s))})
        assert ck.path(2) == str(tmp_path / "ck" / "step-00000002")
        ck.delete(3)
        assert ck.steps() == [1, 2] and not os.path.exists(tmp_path / "ck" / "step-00000003")
        assert json.loads((tmp_path / "ck" / "latest").read_text())["step"] == 2
        assert float(ck.read()["x"]) == 2.0
        ck.delete(1)
        assert ck.steps() == [2]
        with pytest.raises(StepNotFoundError):
            ck.delete(1)
        with pytest.raises(StepNotFoundError):
            ck.path(3)
        ck.delete(2)
        assert ck.steps() == [] and not (tmp_path / "ck" / "latest").exists()
        assert ck.read() is None
    assert os.listdir(tmp_path / "ck" / ".ckptguard" / "trash") == []


def test_tags_name_steps_durably_survive_retention_and_move_by_compare_and_swap(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck", keep_last=2) as ck:
        ck.save(1, {"x": torch.tensor(1.0)})
        assert ck.tag("best", 1) is None
        for s in (2, 3, 4):
            ck.save(s, {"x": torch.tensor(float(s))})
        assert ck.steps() == [1, 3, 4]  # step 1 is tagged: kept
        assert float(ck.read(tag="best")["x"]) == 1.0
        holder = {"x": torch.tensor(0.0)}
        assert ck.load(holder, tag="best") == 1 and float(holder["x"]) == 1.0
        with pytest.raises(CheckpointError, match="tagged 'best'"):
            ck.delete(1)
        with pytest.raises(CheckpointError, match="another writer moved it"):
            ck.tag("best", 4, expect=3)
        assert ck.tag("best", 4, expect=1) == 1
        assert ck.tags() == {"best": 4}
        with pytest.raises(StepNotFoundError):
            ck.tag("best", 2)
        with pytest.raises(ValueError):
            ck.tag("../x", 4)
    with Checkpointer(tmp_path / "ck", read_only=True) as ro:  # durable: another job sees it
        assert ro.tags() == {"best": 4}
        assert float(ro.read(tag="best")["x"]) == 4.0
        with pytest.raises(StepNotFoundError, match="no tag 'worst'"):
            ro.read(tag="worst")
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.untag("best") == 4 and ck.tags() == {}
        ck.delete(1)


def test_rng_state_round_trips_per_rank(tmp_path: Path) -> None:
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"rng": PerRank(ckptguard.rng_state()), "stateful": PerRank(ckptguard.RNGState())})
        expected = (torch.rand(2), np.random.rand(2), random.random())
        ckptguard.set_rng_state(ck.read()["rng"])
        assert torch.equal(torch.rand(2), expected[0]) and np.array_equal(np.random.rand(2), expected[1])
        assert random.random() == expected[2]
        holder = PerRank(ckptguard.RNGState())
        assert ck.load({"rng": PerRank(ckptguard.rng_state()), "stateful": holder}) == 1
        assert torch.equal(torch.rand(2), expected[0])  # RNGState.load_state_dict restored the RNGs


def test_metadata_of_a_committed_step_is_the_one_its_save_was_given(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"x": torch.ones(1)}, metadata={"model_only": True, "loss": 0.5})
        ck.save(2, {"x": torch.ones(1)})
        assert ck.metadata(1) == {"model_only": True, "loss": 0.5}
        assert ck.metadata(2) == {}
        ck.save(1, {"x": torch.zeros(1)}, metadata={"model_only": False}, overwrite=True)
        assert ck.metadata(1) == {"model_only": False}  # the current version's
        with pytest.raises(StepNotFoundError):
            ck.metadata(3)
    with Checkpointer(tmp_path / "ck", read_only=True) as ck:
        assert ck.metadata(1) == {"model_only": False}
