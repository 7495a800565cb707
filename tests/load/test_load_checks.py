"""The size check of every file before a load reads anything is shared by the ranks of a storage
domain (each looks up every n-th file): whichever rank's share holds the damaged file, every rank
refuses the load alike and nothing is read."""

from __future__ import annotations

from collections.abc import Callable
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
    return open_session(
        comm,
        open_root(str(root)),
        Options(None, None, 1, "xxh3-64", 10.0),
        read_only=read_only,
        job_id="t",
        lease_ttl_s=30,
        lease_wait_s=1,
    )


def _save_a_tensor_per_rank(root: Path) -> None:
    """Step 1 of ``root``: rank r saves "w<r>", 1,000 elements of value r (one data file per rank)."""

    def save(comm: Comm) -> None:
        session = _session(comm, root, read_only=False)
        try:
            state = {f"w{comm.rank}": torch.full((1000,), float(comm.rank))}
            save_protocol.save(
                session,
                save_protocol.SaveRequest(1, state, [], [], False, {}, None, options=session.options),
                PhaseTimer(),
            )
        finally:
            if session.lease is not None:
                session.lease.release()

    assert run_ranks(WORLD, save) == [None] * WORLD


def _load_own_tensor(root: Path) -> Callable[[Comm], object]:
    """A rank's load of its own "w<r>" of step 1; the value it loaded."""

    def load(comm: Comm) -> object:
        session = _session(comm, root, read_only=True)
        dest = {f"w{comm.rank}": torch.full((1000,), -1.0)}
        request = load_protocol.LoadRequest(dest, None, True)
        load_protocol.load_one(session, CheckpointName(1), None, request, PhaseTimer())
        return dest[f"w{comm.rank}"][0].item()

    return load


def test_a_damaged_file_in_any_ranks_share_of_the_size_check_stops_the_load_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _save_a_tensor_per_rank(root)
    files = sorted(p for p in (root / "step-00000001" / "data").rglob("*") if p.is_file())
    assert len(files) == WORLD  # one per rank: each rank's share of the check holds one
    load = _load_own_tensor(root)
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


def test_a_manifest_that_contradicts_itself_in_any_ranks_share_of_its_checks_stops_the_load_on_every_rank(
    tmp_path: Path,
) -> None:
    """The checks that relate the manifest's DCP entries to its item rows are shared too (each rank
    checks every n-th name): a contradiction in any one name is refused by every rank, nothing read."""
    import dataclasses
    import json

    from ckptguard.protocol.manifest import Manifest

    root = tmp_path / "ck"
    _save_a_tensor_per_rank(root)
    load = _load_own_tensor(root)
    path = root / "step-00000001" / "MANIFEST.json"
    sealed = path.read_bytes()
    manifest = Manifest.from_json(sealed, str(path))
    changes = {
        "disagree on the dtype": lambda e: e.update(dtype="int32"),
        "do not add up to its size": lambda e: e.update(chunks=[0, 500]),
    }
    for name in (f"w{r}" for r in range(WORLD)):
        for says, change in changes.items():
            dcp = json.loads(json.dumps(manifest.dcp))
            change(dcp["state_dict"][name])
            path.write_bytes(dataclasses.replace(manifest, dcp=dcp).to_json())
            try:
                out = run_ranks(WORLD, load)
                assert all(isinstance(e, CorruptCheckpointError) and says in str(e) for e in out), (name, out)
            finally:
                path.write_bytes(sealed)
    assert run_ranks(WORLD, load) == [0.0, 1.0, 2.0, 3.0]
