"""files= restores give back exactly what was saved, never touch user files before the load succeeded,
and refuse two hosts restoring into one shared path."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest
import torch

from ckptguard import Checkpointer, CorruptCheckpointError, PathCollisionError, _faults
from ckptguard._faults import FaultPhase
from ckptguard.comm import Comm
from ckptguard.protocol import artifacts
from ckptguard.protocol import load as load_protocol
from ckptguard.protocol import save as save_protocol
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.root import open_root
from ckptguard.protocol.session import Options, open_session
from ckptguard.protocol.timing import PhaseTimer
from ckptguard.threadranks import run_ranks


def listing(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_restored_directory_equals_the_saved_one(tmp_path: Path) -> None:
    off = tmp_path / "offload"
    off.mkdir()
    (off / "shard-a").write_bytes(b"a at 100")
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(100, {"w": torch.ones(4)}, files={"off": off})
        (off / "shard-a").write_bytes(b"a at 150")
        (off / "shard-b").write_bytes(b"b at 150")
        ck.save(150, {"w": torch.ones(4)}, files={"off": off})
        ck.load({"w": torch.zeros(4)}, step=100, files={"off": off})
    assert listing(off) == {"shard-a": b"a at 100"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staged or displaced copy


def test_a_failed_restore_leaves_the_users_files_as_they_were(tmp_path: Path) -> None:
    off = tmp_path / "offload"
    off.mkdir()
    (off / "shard-a").write_bytes(b"saved")
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"w": torch.ones(4)}, files={"off": off})
        stored = next((tmp_path / "ck" / "step-00000001" / "files").rglob("shard-a"))
        stored.write_bytes(b"SAVED")  # same size, flipped bytes
        (off / "shard-a").write_bytes(b"user's own")
        (off / "mine").write_bytes(b"keep me")
        before = listing(off)
        with pytest.raises(CorruptCheckpointError):
            ck.load({"w": torch.zeros(4)}, step=1, files={"off": off})
    assert listing(off) == before


def test_two_hosts_restoring_into_one_shared_path_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two "hosts" (thread ranks with host names of their own) each saved their own directory, and
    # then both name one path, on storage both see, to restore into.
    monkeypatch.setattr(load_protocol, "hostname", lambda: f"host-{threading.current_thread().name}")
    shared = tmp_path / "shared-offload"

    def body(comm: Comm) -> object:
        session = open_session(
            comm,
            open_root(str(tmp_path / "ck")),
            Options(None, None, 1, "xxh3-64", 10.0),
            read_only=False,
            job_id="t",
            lease_ttl_s=30,
            lease_wait_s=1,
        )
        try:
            own = tmp_path / f"src{comm.rank}"
            own.mkdir()
            (own / "shard").write_bytes(b"x")
            targets = artifacts.normalize(
                {"off": own}, comm.rank, f"host-rank{comm.rank}", True, session.root.local_dir()
            )
            save_protocol.save(
                session,
                save_protocol.SaveRequest(
                    1, {"w": torch.ones(4)}, targets, targets, False, {}, None, options=session.options
                ),
                PhaseTimer(),
            )
            request = load_protocol.LoadRequest({"w": torch.zeros(4)}, {"off": shared}, True)
            return load_protocol.load_one(session, CheckpointName(1), None, request, PhaseTimer())
        finally:
            if session.lease is not None:
                session.lease.release()

    out = run_ranks(2, body)
    assert all(isinstance(e, PathCollisionError) for e in out), out
    assert "storage both hosts share" in str(out[0])
    assert not shared.exists()


def test_files_that_are_contain_or_lie_inside_the_root_are_refused_at_save_and_at_load(tmp_path: Path) -> None:
    run = tmp_path / "run"
    root = run / "ckpts"
    off = tmp_path / "offload"
    off.mkdir()
    (off / "state.bin").write_bytes(b"v1")
    (tmp_path / "link").symlink_to(run)
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.ones(2)}, files={"x": off})
        ck.save(2, {"w": torch.ones(2)})
        before = listing(root)
        for bad, how in (
            (root, "is the checkpoint root"),
            (run, "contains the checkpoint root"),
            (tmp_path / "link", "contains the checkpoint root"),
            (root / "step-00000001", "lies inside the checkpoint root"),
        ):
            with pytest.raises(
                PathCollisionError, match=f"rank 0: files\\['x'\\] = {run if 'link' in str(bad) else bad} {how}"
            ) as err:
                ck.save(3, {"w": torch.ones(2)}, files={"x": bad})
            assert err.value.rank == 0
            with pytest.raises(PathCollisionError, match=how):
                ck.load({"w": torch.zeros(2)}, step=1, files={"x": bad})
        assert ck.steps(refresh=True) == [1, 2] and listing(root) == before


def _trained(seed: float) -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=seed, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(seed)
    return model, opt


def test_a_ctrl_c_right_after_the_bytes_are_placed_leaves_the_whole_step(tmp_path: Path) -> None:
    """A Ctrl-C once this rank's bytes are in place, before its objects, optimizer and files= follow:
    the load ends with the whole step (the interrupt raised after), never tensors new and the rest
    old (every step of the placing holds the signal back, not only the reader's own)."""
    off = tmp_path / "offload"
    off.mkdir()
    (off / "shard").write_bytes(b"saved")
    model, opt = _trained(0.5)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": model, "opt": opt, "obj": {"k": 1}}, files={"off": off})
    (off / "shard").write_bytes(b"user's own")
    model2, opt2 = _trained(0.25)
    state = {"model": model2, "opt": opt2, "obj": {"k": -1}}
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    _faults.arm(f"{FaultPhase.AFTER_PLACE}:0:interrupt")
    try:
        with Checkpointer(tmp_path / "ck", read_only=True) as ck, pytest.raises(KeyboardInterrupt):
            ck.load(state, step=1, files={"off": off})
    finally:
        _faults.arm("")
        signal.signal(signal.SIGINT, previous)
    assert all(bool((p == 0.5).all()) for p in model2.parameters())
    assert state["obj"] == {"k": 1} and opt2.param_groups[0]["lr"] == 0.5
    assert listing(off) == {"shard": b"saved"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_rank_that_cannot_move_its_files_into_place_leaves_every_state_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """files= are moved into place before any tensor changes: one rank's failed rename moves every
    rank's files back and no tensor holds a byte of the step (before: the tensors were placed first,
    so such a failure left them new and the files old)."""
    real_swap_in = artifacts.swap_in

    def swap_in_failing_on_rank1(swaps: list[artifacts.RestoreSwap]) -> None:
        real_swap_in(swaps[:1])  # the first moved in, then the next rename fails
        if threading.current_thread().name == "rank1":
            raise OSError(28, "No space left on device")
        real_swap_in(swaps[1:])

    def body(comm: Comm) -> object:
        own = tmp_path / f"off{comm.rank}"
        own.mkdir()
        for name in ("a", "b"):
            (own / name).write_bytes(f"saved {name} {comm.rank}".encode())
        session = open_session(
            comm,
            open_root(str(tmp_path / "ck")),
            Options(None, None, 1, "xxh3-64", 10.0),
            read_only=False,
            job_id="t",
            lease_ttl_s=30,
            lease_wait_s=1,
        )
        try:
            targets = artifacts.normalize(
                {"a": own / "a", "b": own / "b"}, comm.rank, "host", True, session.root.local_dir()
            )
            save_protocol.save(
                session,
                save_protocol.SaveRequest(
                    1, {"w": torch.ones(4)}, targets, targets, False, {}, None, options=session.options
                ),
                PhaseTimer(),
            )
            for name in ("a", "b"):
                (own / name).write_bytes(b"user's own")
            state = {"w": torch.zeros(4)}
            try:
                load_protocol.load_one(
                    session,
                    CheckpointName(1),
                    None,
                    load_protocol.LoadRequest(state, {"a": own / "a", "b": own / "b"}, True),
                    PhaseTimer(),
                )
            except Exception as e:
                return e, state["w"], listing(own)
            return None, state["w"], listing(own)
        finally:
            if session.lease is not None:
                session.lease.release()

    monkeypatch.setattr(artifacts, "swap_in", swap_in_failing_on_rank1)
    out = run_ranks(2, body)
    for rank, (error, w, files) in enumerate(out):  # type: ignore[misc]
        assert error is not None, f"rank {rank}: the load succeeded"
        assert torch.equal(w, torch.zeros(4)), f"rank {rank}: tensors changed by a failed load: {w}"
        assert files == {"a": b"user's own", "b": b"user's own"}, f"rank {rank}: {files}"
    assert not [p for p in tmp_path.rglob("*") if ".displaced" in p.name or ".restore" in p.name]
