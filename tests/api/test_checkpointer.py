"""Checkpointer behaviour in one process: round trips, overwrite, retention, corruption, safe loading, lease."""

from __future__ import annotations

import collections
import dataclasses
import errno
import json
import os
import pickle
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import ckptguard
import ckptguard.protocol.save
from ckptguard import Checkpointer, CheckpointError, CorruptCheckpointError, NotVisibleError
from ckptguard.protocol.manifest import Manifest
from ckptguard.storage.posix import PosixStorage

from tests.support.beds.diskfull import small_filesystem
from tests.support.beds.sshfs import BedUnavailable


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def data_files(root: Path, step_dir: str) -> list[Path]:
    return sorted((root / step_dir / "data").iterdir())


@pytest.fixture
def ck(tmp_path: Path) -> Checkpointer:
    c = Checkpointer(tmp_path / "ckpt")
    yield c
    c.close()


def test_round_trip_bitwise_with_optimizer_and_extra_values(ck: Checkpointer) -> None:
    model, optim = make()
    train(model, optim, 3)
    extra = {"step": 3, "name": "run-a", "rng": torch.get_rng_state(), "history": [1.5, 2.5]}
    ck.save(3, {"model": model, "optim": optim, "extra": extra}, metadata={"loss": 0.25})
    m2, o2 = make()
    extra2 = {"step": 0, "name": "", "rng": torch.zeros_like(extra["rng"]), "history": []}
    assert ck.load({"model": m2, "optim": o2, "extra": extra2}) == 3
    assert same(model, m2)
    assert extra2 == {**extra, "rng": extra2["rng"]} and torch.equal(extra2["rng"], extra["rng"])
    s1, s2 = optim.state_dict()["state"], o2.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg_sq"], s2[k]["exp_avg_sq"]) for k in s1)
    mpath = Path(ck.root) / "step-00000003" / "MANIFEST.json"
    assert Manifest.from_json(mpath.read_bytes(), str(mpath)).user_metadata == {"loss": 0.25}


def test_empty_root(ck: Checkpointer) -> None:
    model, _ = make()
    assert ck.steps() == [] and ck.latest() is None
    assert ck.load({"model": model}) is None


def test_top_level_plain_values_are_handed_back(ck: Checkpointer) -> None:
    ck.save(1, {"epoch": 7, "t": torch.arange(3)})
    state = {"epoch": 0, "t": torch.zeros(3, dtype=torch.long)}
    ck.load(state)
    assert state["epoch"] == 7 and torch.equal(state["t"], torch.arange(3))


def test_resave_refused_without_overwrite_and_atomic_with_it(ck: Checkpointer) -> None:
    model, optim = make()
    ck.save(5, {"model": model})
    before = sorted(os.listdir(ck.root))
    with pytest.raises(CheckpointError, match=r"already committed.*overwrite=True"):
        ck.save(5, {"model": model})
    assert sorted(os.listdir(ck.root)) == before  # nothing written
    train(model, optim)
    ck.save(5, {"model": model}, overwrite=True)
    assert ck.steps() == [5]
    names = sorted(n for n in os.listdir(ck.root) if n.startswith("step-"))
    assert names == ["step-00000005.v2"]  # the old version was invalidated after the new one committed
    m2, _ = make()
    ck.load({"model": m2})
    assert same(model, m2)
    assert json.loads((Path(ck.root) / "latest").read_text())["dir"] == "step-00000005.v2"


def test_keep_last_and_keep_every(tmp_path: Path) -> None:
    model, _ = make()
    with Checkpointer(tmp_path / "a", keep_last=2, keep_every=4) as ck:
        for s in range(1, 10):
            ck.save(s, {"model": model})
        assert ck.steps() == [4, 8, 9]
    with Checkpointer(tmp_path / "b", keep_last=1) as ck:
        for s in range(3):
            ck.save(s, {"model": model})
        assert ck.steps() == [2]


@pytest.mark.parametrize("damage", ["bitflip", "truncate", "zeros", "delete", "manifest_bitflip"])
def test_corrupt_newest_falls_back_with_warning(ck: Checkpointer, damage: str) -> None:
    root = Path(ck.root)
    model, optim = make()
    ck.save(1, {"model": model, "optim": optim})
    old = make()[0]
    old.load_state_dict(model.state_dict())
    train(model, optim)
    ck.save(2, {"model": model, "optim": optim})
    target = data_files(root, "step-00000002")[0]
    if damage == "bitflip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x10
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-7])
    elif damage == "zeros":
        data = bytearray(target.read_bytes())
        data[:64] = bytes(64)
        target.write_bytes(bytes(data))
    elif damage == "delete":
        target.unlink()
    else:
        target = root / "step-00000002" / "MANIFEST.json"
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    m2, o2 = make()
    with pytest.raises(CorruptCheckpointError) as info:
        ck.load({"model": m2, "optim": o2}, step=2)
    assert str(target) in str(info.value)
    with pytest.warns(UserWarning, match="step 2 .* is corrupt"):
        assert ck.load({"model": m2, "optim": o2}) == 1
    assert same(m2, old)


def test_every_checkpoint_corrupt_raises(ck: Checkpointer) -> None:
    model, _ = make()
    ck.save(1, {"model": model})
    for f in data_files(Path(ck.root), "step-00000001"):
        f.write_bytes(b"\0" * f.stat().st_size)
    with pytest.warns(UserWarning), pytest.raises(CorruptCheckpointError, match="every committed checkpoint"):
        ck.load({"model": make()[0]})


class _Payload:
    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {os.environ['CKPTGUARD_PWNED']}",))


def test_pickle_payload_in_stored_object_never_runs(
    ck: Checkpointer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attacker rewrites an object item with a malicious pickle and fixes up its checksum."""
    sentinel = tmp_path / "pwned"
    monkeypatch.setenv("CKPTGUARD_PWNED", str(sentinel))
    ck.save(1, {"extra": {"note": "hello"}})
    root = Path(ck.root) / "step-00000001"
    mpath = root / "MANIFEST.json"
    m = Manifest.from_json(mpath.read_bytes(), str(mpath))
    (row,) = [r for r in m.items if r.fqn == "extra.note"]
    payload = pickle.dumps(_Payload())
    fpath = root / row.file
    data = fpath.read_bytes()
    new = data[: row.offset] + payload + data[row.offset + row.length :]
    fpath.write_bytes(new)
    from ckptguard.checksum import checksum

    fixed = row._replace(length=len(payload), checksum=checksum(m.checksum_algorithm, payload))
    mpath.write_bytes(
        dataclasses.replace(
            m,
            items=[fixed if i is row else i for i in m.items],
            files=[f._replace(size=len(new)) if f.path == row.file else f for f in m.files],
        ).to_json()
    )
    with pytest.raises(CheckpointError, match=r"refusing to load object 'extra\.note'"):
        ck.load({"extra": {"note": ""}}, step=1)
    assert not sentinel.exists()


def test_dcp_pickle_metadata_is_never_read(ck: Checkpointer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DCP-style `.metadata` pickle dropped into checkpoints (committed or not) is never unpickled."""
    sentinel = tmp_path / "pwned"
    monkeypatch.setenv("CKPTGUARD_PWNED", str(sentinel))
    model, _ = make()
    ck.save(1, {"model": model})
    (Path(ck.root) / "step-00000001" / ".metadata").write_bytes(pickle.dumps(_Payload()))
    fake = Path(ck.root) / "step-00000002"
    fake.mkdir()
    (fake / ".metadata").write_bytes(pickle.dumps(_Payload()))  # looks like a DCP checkpoint, has no manifest
    assert ck.steps() == [1]
    assert ck.load({"model": make()[0]}) == 1
    assert not sentinel.exists()


def test_staging_garbage_is_removed_by_the_next_save(ck: Checkpointer) -> None:
    stale = Path(ck.root) / ".ckptguard" / "staging" / ("step-00000009." + "ab" * 16)
    (stale / "data").mkdir(parents=True)
    (stale / "data" / "rank00000_0.bin").write_bytes(b"partial")
    assert ck.steps() == []  # an attempt never counts as a checkpoint
    ck.save(1, {"x": torch.ones(2)})
    assert not stale.exists()
    assert os.listdir(Path(ck.root) / ".ckptguard" / "staging") == []


def test_second_job_on_same_root_gets_a_clear_error(tmp_path: Path) -> None:
    first = Checkpointer(tmp_path / "ckpt", lease_ttl_s=30)
    with pytest.raises(CheckpointError, match=r"in use by .*host .*pid"):
        Checkpointer(tmp_path / "ckpt", lease_wait_s=0.3)
    reader = Checkpointer(tmp_path / "ckpt", read_only=True)  # loading and listing need no lease
    assert reader.steps() == []
    with pytest.raises(CheckpointError, match="read_only"):
        reader.save(1, {"x": torch.ones(1)})
    first.close()
    second = Checkpointer(tmp_path / "ckpt", lease_wait_s=0.3)
    second.close()


def test_lost_lease_fences_the_publish(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ckpt", lease_ttl_s=30)
    ck.save(1, {"x": torch.ones(2)})
    lease = Path(ck.root) / ".ckptguard" / "lease.json"
    rec = json.loads(lease.read_text())
    rec.update(holder="someone-else", epoch=rec["epoch"] + 1)
    lease.write_text(json.dumps(rec))
    with pytest.raises(CheckpointError, match="no longer holds the lease"):
        ck.save(2, {"x": torch.ones(2)})
    assert ck.steps() == [1]
    ck.close()
    assert lease.exists()  # not ours any more: close() leaves the other holder's lease alone


def _manifest_write(path: str) -> bool:
    return os.path.basename(path) == "MANIFEST.json" and ".ckptguard" in path


def test_manifest_written_while_files_checked_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader writes the manifest while it checks the data files visible (both before the publish):
    a listing of the data files that waits for the manifest's write finds it done."""
    written = threading.Event()
    replace, sizes_in = PosixStorage.replace, PosixStorage.sizes_in

    def replace_noting(self: PosixStorage, path: str, data: bytes) -> None:
        replace(self, path, data)
        if _manifest_write(path):
            written.set()

    def sizes_in_after_write(self: PosixStorage, directory: str) -> dict[str, int]:
        if ".ckptguard" in directory and os.path.basename(directory) == "data":
            assert written.wait(10), "the manifest was not written while the files were checked visible"
        return sizes_in(self, directory)

    with Checkpointer(tmp_path / "ckpt") as ck:
        monkeypatch.setattr(PosixStorage, "replace", replace_noting)
        monkeypatch.setattr(PosixStorage, "sizes_in", sizes_in_after_write)
        ck.save(1, {"x": torch.ones(2)})
        assert ck.steps() == [1] and written.is_set()


@pytest.mark.parametrize("write_fails", [False, True])
def test_files_not_visible_publish_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write_fails: bool) -> None:
    """Data files that never show with their size stop the save before the publish, the manifest's
    write running meanwhile or not; where that write fails too, the error is still the visibility's."""
    with Checkpointer(tmp_path / "ckpt", visibility_timeout_s=0.2) as ck:
        ck.save(1, {"x": torch.ones(2)})
        sizes_in, replace = PosixStorage.sizes_in, PosixStorage.replace

        def data_unseen(self: PosixStorage, directory: str) -> dict[str, int]:
            return {} if ".ckptguard" in directory else sizes_in(self, directory)

        def replace_failing(self: PosixStorage, path: str, data: bytes) -> None:
            if _manifest_write(path):
                raise OSError(errno.EIO, "injected manifest write failure", path)
            replace(self, path, data)

        monkeypatch.setattr(PosixStorage, "sizes_in", data_unseen)
        if write_fails:
            monkeypatch.setattr(PosixStorage, "replace", replace_failing)
        with pytest.raises(NotVisibleError, match="not visible with the right size") as raised:
            ck.save(2, {"x": torch.full((2,), 2.0)})
        assert "Nothing was committed" in str(raised.value)
        monkeypatch.undo()
        assert ck.steps(refresh=True) == [1] and ck.latest(refresh=True) == 1
        assert not (Path(ck.root) / "step-00000002").exists()
        out = {"x": torch.zeros(2)}
        ck.load(out)
        assert torch.equal(out["x"], torch.ones(2))


def test_takeover_from_dead_holder_on_same_host(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    code = (
        f"import ckptguard, torch, os; ck = ckptguard.Checkpointer({str(root)!r}); "
        "ck.save(1, {'x': torch.ones(2)}); os._exit(0)"
    )  # dies holding the lease
    subprocess.run([os.sys.executable, "-c", code], check=True)
    assert (root / ".ckptguard" / "lease.json").exists()
    with Checkpointer(root, lease_wait_s=0.5) as ck:  # pid is dead: no need to wait for the TTL
        assert ck.steps() == [1]


def test_bad_arguments(ck: Checkpointer) -> None:
    model, optim = make()
    with pytest.raises(ValueError):
        ck.save(-1, {"model": model})
    with pytest.raises(ValueError):
        ck.save(True, {"model": model})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="JSON"):
        ck.save(1, {"model": model}, metadata={"bad": object()})
    with pytest.raises(CheckpointError, match="no module in the same state owns"):
        ck.save(1, {"optim": optim})
    with pytest.raises(CheckpointError, match="step 4 is not a committed checkpoint"):
        ck.load({"model": model}, step=4)
    with pytest.raises(ValueError):
        Checkpointer(ck.root, keep_last=0)


def test_files_collision_within_one_rank(ck: Checkpointer, tmp_path: Path) -> None:
    d = tmp_path / "off"
    (d / "inner").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="nested paths"):
        ck.save(1, {"x": torch.ones(1)}, files={"a": d, "b": d / "inner"})
    assert ck.steps() == []


def test_disk_full_names_root_and_bytes_and_keeps_previous(tmp_path: Path) -> None:
    try:
        with small_filesystem("6m") as mnt:
            ck = Checkpointer(mnt / "ckpt")
            ck.save(1, {"w": torch.ones(1000)})
            with pytest.raises(CheckpointError) as info:
                ck.save(2, {"w": torch.ones(4 << 20)})  # 16 MiB into a 6 MiB filesystem
            msg = str(info.value)
            assert "disk full on" in msg and str(mnt / "ckpt") in msg and "16,777,216 bytes" in msg
            assert "step 1, is intact" in msg
            assert ck.steps() == [1]
            w = {"w": torch.zeros(1000)}
            assert ck.load(w) == 1 and torch.equal(w["w"], torch.ones(1000))
            ck.save(3, {"w": torch.full((1000,), 3.0)})  # space is back: garbage of step 2 is gone
            assert os.listdir(mnt / "ckpt" / ".ckptguard" / "staging") == []
            ck.close()
    except BedUnavailable as e:
        pytest.skip(str(e))


def test_read_only_filesystem_error_names_path(tmp_path: Path) -> None:
    try:
        with small_filesystem("4m") as mnt:
            (mnt / "ckpt").mkdir()
            if subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True).returncode:
                pytest.skip("cannot remount read-only")
            with pytest.raises(CheckpointError, match=r"read-only: rank 0 .*cannot write .*ckpt"):
                Checkpointer(mnt / "ckpt")
            subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
    except BedUnavailable as e:
        pytest.skip(str(e))


# -- save_file / load_file ----------------------------------------------------------------


def test_save_file_round_trip_and_plain_torch_load(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "model.pt"
    obj = {"w": torch.randn(10, 10), "step": 3}
    ckptguard.save_file(obj, path)
    loaded = ckptguard.load_file(path)
    assert torch.equal(loaded["w"], obj["w"]) and loaded["step"] == 3
    assert torch.equal(torch.load(path, weights_only=True)["w"], obj["w"])  # still a normal torch file
    assert os.listdir(path.parent) == ["model.pt"]


class _Opaque:
    pass


_Pair = collections.namedtuple("_Pair", "a b")


@pytest.mark.parametrize(
    "value,words",
    [
        (Path("/x"), "pathlib"),
        (_Pair(1, 2), "namedtuple"),
        (_Opaque(), "_Opaque"),
        (np.ones(2), "numpy"),
        (frozenset({1}), "frozenset"),
    ],
)
def test_save_file_refuses_what_load_file_could_not_give_back(tmp_path: Path, value: object, words: str) -> None:
    path = tmp_path / "model.pt"
    with pytest.raises(ckptguard.UnsupportedValueError, match=rf"{path}: cannot save \['v'\]: .*{words}"):
        ckptguard.save_file({"v": value, "w": torch.ones(1)}, path)
    assert not path.exists()
    plain = {"v": {1: {3, 4}, (2, "b"): (torch.Size([2]), None)}, "w": torch.ones(1)}  # plain values still save
    ckptguard.save_file(plain, path)
    assert ckptguard.load_file(path)["v"] == plain["v"]


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "append"])
def test_load_file_refuses_damaged_files(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "model.pt"
    ckptguard.save_file({"w": torch.randn(100)}, path)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "bitflip":
        data[200] ^= 0x04
        path.write_bytes(bytes(data))
    elif damage == "append":
        path.write_bytes(bytes(data) + b"junk")
    with pytest.raises(CorruptCheckpointError, match=str(path)):
        ckptguard.load_file(path)


def test_load_file_says_what_a_plain_torch_save_file_or_a_directory_is(tmp_path: Path) -> None:
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.randn(100)}, path)
    with pytest.raises(
        CheckpointError,
        match=rf"{path} is a torch.save file without ckptguard's checksum .*"
        r"torch.load\(path, weights_only=True\)",
    ) as err:
        ckptguard.load_file(path)
    assert not isinstance(err.value, CorruptCheckpointError)
    with pytest.raises(CheckpointError, match=rf"{tmp_path} is a directory: .*Checkpointer\(") as err:
        ckptguard.load_file(tmp_path)
    assert not isinstance(err.value, CorruptCheckpointError)


@pytest.mark.parametrize("path", [None, 3, b"/tmp/x.pt"])
def test_save_file_and_load_file_name_a_path_of_the_wrong_type(tmp_path: Path, path: object) -> None:
    for function in (ckptguard.save_file, ckptguard.load_file):
        args = ({"w": torch.ones(1)}, path) if function is ckptguard.save_file else (path,)
        with pytest.raises(TypeError, match=rf"{function.__name__}: path must be a local path or an s3:// URL"):
            function(*args)  # type: ignore[operator]


def test_save_file_on_a_full_disk_keeps_the_old_file_and_leaves_no_temporary_file() -> None:
    try:
        with small_filesystem("2m") as mnt:
            path = mnt / "model.pt"
            ckptguard.save_file({"w": torch.ones(10)}, path)
            with pytest.raises(CheckpointError, match=r"disk full on .*model\.pt"):
                ckptguard.save_file({"w": torch.ones(1 << 20)}, path)  # 4 MiB into a 2 MiB filesystem
            assert os.listdir(mnt) == ["model.pt"]
            assert torch.equal(ckptguard.load_file(path)["w"], torch.ones(10))
    except BedUnavailable as e:
        pytest.skip(str(e))


def test_retry_stale_handles() -> None:
    import errno

    from ckptguard.storage.fileio import retry_stale

    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise OSError(errno.ESTALE, "Stale file handle")
        return "ok"

    assert retry_stale(flaky, "read", "/x") == "ok" and len(calls) == 3

    def always() -> None:
        raise OSError(errno.ESTALE, "Stale file handle")

    with pytest.raises(CheckpointError, match=r"stale file handle \(ESTALE\) on /x"):
        retry_stale(always, "read", "/x", attempts=3)


# -- saves that return before they are written (blocking=False) ------------------------------


def test_background_save_snapshots_state_at_call_time(ck: Checkpointer) -> None:
    state = {"w": torch.arange(1000, dtype=torch.float32), "meta": {"lr": 0.5}}
    ck.save(1, state, blocking=False)
    state["w"].add_(1000)  # training goes on while the save is written
    state["meta"]["lr"] = 0.1
    ck.wait()
    assert ck.steps() == [1]
    out = {"w": torch.zeros(1000), "meta": {"lr": 0.0}}
    ck.load(out)
    assert torch.equal(out["w"], torch.arange(1000, dtype=torch.float32)) and out["meta"]["lr"] == 0.5
    stats = ck.last_save_stats
    assert stats is not None and stats.blocked < stats.total


def test_background_save_reuses_one_set_of_host_buffers(ck: Checkpointer) -> None:
    state = {"w": torch.randn(256, 256)}
    for step in range(5):
        ck.save(step, state, blocking=False)
    ck.wait()
    assert ck._saves.host_stager.allocations == 1
    assert ck._saves.host_stager.buffer_bytes == 256 * 256 * 4


@pytest.mark.parametrize(
    "state",
    [{"x": 1}, {}, {"x": {}}, {"s": "abc", "l": [1, 2]}, {"r": ckptguard.PerRank(1)}],
    ids=["int", "empty", "empty-dict", "plain", "per-rank"],
)
def test_background_save_of_a_state_without_tensors(ck: Checkpointer, state: dict[str, object]) -> None:
    """A state without a tensor saves in the background: torch's bulk copy refuses an empty list, and
    that RuntimeError must not reach the caller."""
    ck.save(1, state, blocking=False)
    ck.wait()
    assert ck.steps() == [1]
    expect = {k: (v.value if isinstance(v, ckptguard.PerRank) else v) for k, v in state.items()}
    assert ck.read(step=1) == expect


@pytest.mark.parametrize("context", ["inference_mode", "meta_default_device"])
def test_background_saves_after_one_made_under_a_torch_mode(ck: Checkpointer, context: str) -> None:
    """The host buffers a first async save allocates serve every later save: made under
    torch.inference_mode() they must not be inference tensors (every later copy outside it is refused), nor
    meta tensors under torch.device("meta") (every save would fail)."""
    mode = torch.inference_mode() if context == "inference_mode" else torch.device("meta")
    state = {"w": torch.arange(64, dtype=torch.float32)}
    with mode:
        ck.save(1, state, blocking=False)
    ck.wait()
    for step in (2, 3):
        state["w"].add_(1)
        ck.save(step, state, blocking=False)
        ck.wait()
    for step in (1, 2, 3):
        out = {"w": torch.zeros(64)}
        ck.load(out, step=step)
        assert torch.equal(out["w"], torch.arange(64, dtype=torch.float32) + (step - 1))


@pytest.mark.parametrize("blocking", [True, False])
def test_files_that_name_a_fifo_or_hold_one_are_refused_and_nothing_hangs(tmp_path: Path, blocking: bool) -> None:
    """A FIFO named by files= must not make save() wait forever for a writer (open, then read); one inside a
    files= directory, a link to a directory or to nothing is refused, never skipped without a word."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.bin").write_bytes(b"a")
    with Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(CheckpointError, match=r"files\['p'\] = .*pipe is a FIFO"):
            ck.save(1, {"w": torch.ones(2)}, files={"p": fifo}, blocking=blocking)
            ck.wait()
        for odd, what in [("pipe", "a FIFO"), ("sub", "a symlink to a directory"), ("gone", "a symlink to nothing")]:
            link = data / odd
            if odd == "pipe":
                os.mkfifo(link)
            else:
                link.symlink_to(tmp_path if odd == "sub" else tmp_path / "missing")
            with pytest.raises(CheckpointError, match=rf"files= directory .*data holds .*{odd} \({what}\)"):
                ck.save(2, {"w": torch.ones(2)}, files={"d": data}, blocking=blocking)
                ck.wait()
            link.unlink()
        ck.save(3, {"w": torch.ones(2)}, files={"d": data}, blocking=blocking)
        ck.wait()
        assert ck.steps() == [3]


def test_background_save_does_not_wait_for_the_last_saves_retention(tmp_path: Path) -> None:
    """save(blocking=False) returns once the host copy is taken, also while the previous save's removal
    of the steps it retired is still running (it blocked on it before); the background save waits for
    that removal before it touches storage, so retention and the next save never overlap."""
    with Checkpointer(tmp_path / "ckpt", keep_last=1) as ck:
        root = ck._session.root
        remove = root.remove_retired
        gate = threading.Event()
        removing: list[str] = []
        order: list[str] = []

        def slow_remove(path: str) -> None:
            removing.append(path)
            gate.wait(60)
            remove(path)
            order.append("removed")

        save = ckptguard.protocol.save.save

        def recording_save(*args: object, **kwargs: object) -> object:
            order.append("save")
            return save(*args, **kwargs)  # type: ignore[arg-type]

        root.remove_retired = slow_remove  # type: ignore[method-assign]
        ck.save(1, {"w": torch.ones(4)})
        ck.save(2, {"w": torch.full((4,), 2.0)})  # retires step 1: its removal now waits for the gate
        order.clear()
        opened = threading.Timer(15, gate.set)  # lets a save() that waits for the removal finish
        opened.start()
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(ckptguard.protocol.save, "save", recording_save)
                ck.save(3, {"w": torch.full((4,), 3.0)}, blocking=False)
                assert not gate.is_set(), "save(blocking=False) waited for the previous save's retention"
                assert removing and order == []  # the removal runs; the background save has not started
                gate.set()
                ck.wait()
        finally:
            opened.cancel()
            gate.set()
        assert order[:2] == ["removed", "save"]  # (then the removal of step 2, which save 3 retired)
        assert ck.steps() == [3]
        out = {"w": torch.zeros(4)}
        assert ck.load(out) == 3 and torch.equal(out["w"], torch.full((4,), 3.0))
    assert not (tmp_path / "ckpt" / "step-00000001").exists() and not (tmp_path / "ckpt" / "step-00000002").exists()


def test_background_saves_follow_every_change_of_the_state_between_them(ck: Checkpointer) -> None:
    """The host buffers are reused only while every tensor still fits its buffer: a new shape, dtype,
    key or nesting between saves reallocates them, and each step loads back what it held at its call."""
    saved: dict[int, dict[str, object]] = {}
    f64 = torch.float64
    states = [
        {"w": torch.arange(6.0), "opt": [torch.ones(2, 3), 7], "t": (torch.zeros(4, dtype=torch.int64), "a")},
        {"w": torch.arange(6.0) + 1, "opt": [torch.ones(2, 3) * 2, 8], "t": (torch.ones(4, dtype=torch.int64), "b")},
        {"w": torch.arange(8.0), "opt": [torch.ones(2, 3) * 3, 9], "t": (torch.ones(4, dtype=torch.int64), "c")},
        {"w": torch.arange(8.0, dtype=f64), "opt": [torch.ones(2, 3), 1], "t": (torch.ones(4, dtype=torch.int64), "d")},
        {"w": torch.arange(8.0, dtype=f64), "opt": [torch.ones(3, 2).t(), 2], "x": torch.ones(1)},
        {"w": torch.arange(8.0, dtype=f64), "opt": [torch.ones(3, 2).t(), 2, torch.ones(1)], "x": torch.ones(1)},
    ]
    for step, state in enumerate(states):
        saved[step] = {
            k: (
                v.clone()
                if isinstance(v, torch.Tensor)
                else type(v)(e.clone() if isinstance(e, torch.Tensor) else e for e in v)
            )
            for k, v in state.items()
        }
        ck.save(step, state, blocking=False)
        for v in state.values():  # training changes every tensor and value right after save() returns
            for t in v if isinstance(v, list | tuple) else [v]:
                if isinstance(t, torch.Tensor):
                    t.add_(100)
        state["opt"][1] = -1
    ck.wait()
    assert ck._saves.host_stager.allocations == 5  # steps 0 and 1 share one set of buffers
    for step, expected in saved.items():
        out = {
            k: (
                torch.zeros_like(v)
                if isinstance(v, torch.Tensor)
                else type(v)(torch.zeros_like(e) if isinstance(e, torch.Tensor) else None for e in v)
            )
            for k, v in expected.items()
        }
        ck.load(out, step=step)
        for k, v in expected.items():
            got = out[k]
            if isinstance(v, torch.Tensor):
                assert torch.equal(got, v) and got.dtype == v.dtype, (step, k)
            else:
                assert len(got) == len(v), (step, k)
                for g, e in zip(got, v, strict=True):
                    assert torch.equal(g, e) if isinstance(e, torch.Tensor) else g == e, (step, k)


def test_background_failure_surfaces_at_wait_and_next_save(ck: Checkpointer) -> None:
    from ckptguard import _faults

    ck.save(1, {"w": torch.ones(10)})
    _faults.arm("before_publish:0:raise")
    try:
        ck.save(2, {"w": torch.full((10,), 2.0)}, blocking=False)
        with pytest.raises(CheckpointError, match="injected fault at before_publish"):
            ck.wait()
        _faults.arm("")
        ck.wait()  # reported once
        ck.save(3, {"w": torch.full((10,), 3.0)}, blocking=False)
        ck.wait()
        _faults.arm("after_write:0:raise")
        ck.save(4, {"w": torch.full((10,), 4.0)}, blocking=False)
        with pytest.raises(CheckpointError, match="injected fault at after_write"):
            ck.save(5, {"w": torch.full((10,), 5.0)}, blocking=False)  # the next save reports it
    finally:
        _faults.arm("")
    assert ck.steps(refresh=True) == [1, 3]
    assert os.listdir(Path(ck.root) / ".ckptguard" / "staging") == []


def test_background_save_over_budget_falls_back_to_blocking(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ckpt", async_budget_bytes=1000) as ck:
        with pytest.warns(UserWarning, match="exceeds async_budget_bytes=1,000; saving synchronously"):
            ck.save(1, {"w": torch.ones(1000)}, blocking=False)
        assert ck.pending_save() is None and ck.steps() == [1]
        assert ck._saves.host_stager.allocations == 0


def test_background_save_with_files(ck: Checkpointer, tmp_path: Path) -> None:
    d = tmp_path / "offload"
    d.mkdir()
    (d / "a.bin").write_bytes(b"v1" * 100)
    ck.save(1, {"w": torch.ones(3)}, files={"off": d}, blocking=False)
    (d / "a.bin").write_bytes(b"v2" * 100)  # changed right after save() returned
    ck.wait()
    (d / "a.bin").unlink()
    ck.load({"w": torch.zeros(3)}, files={"off": d})
    assert (d / "a.bin").read_bytes() == b"v1" * 100


@pytest.mark.parametrize("kind", ["list", "dict-with-tensor", "tuple"])
def test_a_state_nested_deeper_than_a_load_takes_is_refused_at_save(tmp_path: Path, kind: str) -> None:
    """A state nested past the depth a load takes must not be committed (every load would call it
    corrupt and fall back to the step before). The deepest state a save takes loads back; one level
    more is refused at the save, and nothing is committed."""

    def nested(depth: int) -> object:
        leaf: object = torch.ones(2) if kind == "dict-with-tensor" else 1
        for _ in range(depth):
            leaf = {"k": leaf} if kind == "dict-with-tensor" else [leaf] if kind == "list" else (leaf, 0)
        return leaf

    def deepest_taken(ck: Checkpointer) -> int:
        for depth in range(120, 0, -1):
            try:
                ck.save(depth, {"x": nested(depth)})
            except ckptguard.UnsupportedValueError as e:
                assert "nests more than 100 deep" in str(e)
                continue
            return depth
        raise AssertionError("no depth was taken")

    with Checkpointer(tmp_path / "ck") as ck:
        depth = deepest_taken(ck)
        assert depth >= (49 if kind == "tuple" else 98)  # a tuple is stored as a tagged dict of a list
        assert ck.steps() == [depth]
        got = ck.read(step=depth)["x"]
        want = nested(depth)
        if kind == "dict-with-tensor":
            for _ in range(depth):
                got, want = got["k"], want["k"]  # type: ignore[index]
            assert torch.equal(got, want)  # type: ignore[arg-type]
        else:
            assert got == want
        out = {"x": nested(depth)}
        assert ck.load(out) == depth


def test_a_background_save_keeps_the_settings_of_its_call_and_metadata_waits_for_it(tmp_path: Path) -> None:
    """Settings assigned once save(blocking=False) returned apply from the next save, not to the one in
    flight (keep_last=1 must not retire steps the save would have kept); metadata(N) of the step in
    flight waits for it, as read(step=N) does."""
    with Checkpointer(tmp_path / "ck") as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((4,), float(step))})
        ck.save(4, {"w": torch.full((1 << 20,), 4.0)}, blocking=False, metadata={"loss": 0.25})
        ck.keep_last = 1
        assert ck.metadata(4) == {"loss": 0.25}
        ck.wait()
        assert ck.steps() == [1, 2, 3, 4]
        ck.save(5, {"w": torch.ones(4)})
        assert ck.steps() == [5]


@pytest.mark.parametrize("blocking", [True, False])
def test_files_whose_names_no_manifest_can_hold_are_refused_at_the_save(tmp_path: Path, blocking: bool) -> None:
    """A name with a backslash (every load would call the manifest invalid and fall back to the step
    before) and a name that is not UTF-8 (a raw UnicodeEncodeError once the data is written) are refused
    before anything is written."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "ok.txt").write_bytes(b"ok")
    single = tmp_path / "a\\b.bin"
    single.write_bytes(b"x")
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"w": torch.ones(2)}, files={"d": data})
        for name, why in [("run\\notes.txt", "a name with a backslash"), (os.fsdecode(b"latin1-\xe9"), "not UTF-8")]:
            bad = data / name
            bad.write_bytes(b"data")
            with pytest.raises(CheckpointError, match=why):
                ck.save(2, {"w": torch.ones(2)}, files={"d": data}, blocking=blocking)
                ck.wait()
            bad.unlink()
        with pytest.raises(CheckpointError, match="a name with a backslash"):
            ck.save(2, {"w": torch.ones(2)}, files={"f": single}, blocking=blocking)
            ck.wait()
        assert ck.steps() == [1]
        ck.save(2, {"w": torch.ones(2)}, files={"d": data}, blocking=blocking)
        ck.wait()
        assert ck.load({"w": torch.zeros(2)}, files={"d": tmp_path / "restored"}) == 2
        assert (tmp_path / "restored" / "ok.txt").read_bytes() == b"ok"


@pytest.mark.parametrize(
    "key", [b"k" * 2100, ("s" * 4100,), "nest"], ids=["long-bytes", "long-str-in-tuple", "deep-tuple"]
)
def test_a_dict_key_a_load_could_not_read_is_refused_at_the_save(tmp_path: Path, key: object) -> None:
    """Keys over the size a load takes are refused at the save: committed, every read and load of the
    step would fail, without falling back."""
    if key == "nest":
        for _ in range(17):
            key = (key, 1)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"x": {b"small": 1}})
        with pytest.raises(ckptguard.UnsupportedValueError, match="more than a load takes"):
            ck.save(2, {"x": {key: 1}})
        assert ck.steps() == [1] and ck.read(step=1) == {"x": {b"small": 1}}
