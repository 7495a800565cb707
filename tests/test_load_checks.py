"""The size check of every file before a load reads anything is shared by the ranks of a storage
domain (each looks up every n-th file): whichever rank's share holds the damaged file, every rank
refuses the load alike and nothing is read."""

from __future__ import annotations

from pathlib import Path

import torch

from ckptguard import CorruptCheckpointError
from ckptguard.comm import Comm
from ckptguard.protocol import load as load_protocol
from ckptguard.protocol import save as save_protocol
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.root import open_root
from ckptguard.protocol.session import Options, Session, open_session
from ckptguard.protocol.timing import PhaseTimer
from ckptguard.threadranks import run_ranks

WORLD = 4


def _session(comm: Comm, root: Path, read_only: bool) -> Session:
    return open_session(comm, open_root(str(root)), Options(None, None, 1, "xxh3-64", 10.0),
                        read_only=read_only, job_id="t", lease_ttl_s=30, lease_wait_s=1)


def test_a_damaged_file_in_any_ranks_share_of_the_size_check_stops_the_load_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "ck"

    def save(comm: Comm) -> None:
        session = _session(comm, root, read_only=False)
        try:
            state = {f"w{comm.rank}": torch.full((1000,), float(comm.rank))}
            save_protocol.save(session, save_protocol.SaveRequest(1, state, [], [], False, {}, None),
                               PhaseTimer())
        finally:
            if session.lease is not None:
                session.lease.release()

    assert run_ranks(WORLD, save) == [None] * WORLD
    files = sorted(p for p in (root / "step-00000001" / "data").rglob("*") if p.is_file())
    assert len(files) == WORLD  # one per rank: each rank's share of the check holds one

    def load(comm: Comm) -> object:
        session = _session(comm, root, read_only=True)
        dest = {f"w{comm.rank}": torch.full((1000,), -1.0)}
        request = load_protocol.LoadRequest(dest, None, True)
        load_protocol.load_one(session, CheckpointName(1), None, request, PhaseTimer())
        return dest[f"w{comm.rank}"][0].item()

    assert run_ranks(WORLD, load) == [0.0, 1.0, 2.0, 3.0]
    for damaged in files:
        saved = damaged.read_bytes()
        damaged.write_bytes(saved[:-1])
        try:
            out = run_ranks(WORLD, load)
            assert all(isinstance(e, CorruptCheckpointError) for e in out), (damaged, out)
            assert all(damaged.name in str(e) and "bytes, the manifest says" in str(e) for e in out), out
        finally:
            damaged.write_bytes(saved)
    assert run_ranks(WORLD, load) == [0.0, 1.0, 2.0, 3.0]
