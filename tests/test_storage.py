"""The storage seam: URL schemes without a backend are refused; POSIX primitives keep their promises."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ckptguard
from ckptguard import Checkpointer, CorruptCheckpointError, UnsupportedStorageError
from ckptguard.comm import Comm
from ckptguard.protocol import layout
from ckptguard.protocol.lease import Lease
from ckptguard.protocol.topology import probe_storage_domains
from ckptguard.storage import PosixStorage, open_storage
from ckptguard.threadranks import run_ranks


@pytest.mark.parametrize("url", ["gs://bucket/run", "hf://org/model", "GS://B/x"])
def test_a_url_without_a_backend_is_refused_and_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedStorageError, match="no storage backend") as info:
        Checkpointer(url)
    assert "file://" in str(info.value) and "s3://" in str(info.value)  # names what is supported
    with pytest.raises(UnsupportedStorageError):
        ckptguard.save_file({"w": torch.ones(2)}, f"{url}/model.pt")
    with pytest.raises(UnsupportedStorageError):
        ckptguard.load_file(f"{url}/model.pt")
    assert list(tmp_path.iterdir()) == []  # no local directory named 's3:' or 'gs:'


def test_file_urls_are_local_paths(tmp_path: Path) -> None:
    with Checkpointer(f"file://{tmp_path}/ck") as ck:
        ck.save(1, {"w": torch.arange(4.0)})
    assert (tmp_path / "ck" / "step-00000001" / "MANIFEST.json").is_file()


def test_cli_refuses_unknown_scheme() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", "ls", "gs://bucket/run"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "no storage backend" in proc.stderr


def test_a_backend_is_one_entry_in_the_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The typo check, the refusals, which root runs on it and its options all come from its entry."""
    from ckptguard.protocol.objstore import ObjectStoreRoot
    from ckptguard.protocol.root import open_root
    from ckptguard.storage import BACKENDS, Backend, filesystem_path, local_path

    opened: list[str] = []

    def open_memo(text: str, options: object) -> PosixStorage:
        opened.append(text)
        return PosixStorage(str(tmp_path / "store"))

    memo = Backend("memo", "memo:// URLs (a test store)", open_memo, filesystem=False, option_names=frozenset({"k"}))
    monkeypatch.setitem(BACKENDS, "memo", memo)  # type: ignore[index]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedStorageError, match="did you mean memo://bucket"):
        open_storage("memo:/bucket")  # its slashes lost: refused, not a local directory
    with pytest.raises(UnsupportedStorageError, match="memo:// object store URL"):
        local_path("memo://bucket/run")
    assert filesystem_path("memo://bucket/m.pt") is None
    with pytest.raises(ValueError, match="unknown storage_options for memo:// \\['x'\\]; known: \\['k'\\]"):
        open_storage("memo://bucket", {"x": 1})
    assert opened == []
    open_storage("memo://bucket", {"k": 1})
    assert opened == ["memo://bucket"]
    with pytest.raises(UnsupportedStorageError, match="memo:// URLs"):
        open_storage("gs://bucket")  # the refusal names what is supported, the new one too
    assert list(tmp_path.iterdir()) == []
    from ckptguard.storage.base import StorageBackend

    class Store(PosixStorage):
        pass

    store: StorageBackend = Store(str(tmp_path / "s"))
    store.root = "memo://bucket"  # type: ignore[misc]
    assert isinstance(open_root(store), ObjectStoreRoot)


def test_the_s3_entry_names_every_s3_option_and_refuses_options_elsewhere(tmp_path: Path) -> None:
    import dataclasses

    from ckptguard.storage import BACKENDS
    from ckptguard.storage.s3 import S3Options

    assert BACKENDS["s3"].option_names == {f.name for f in dataclasses.fields(S3Options)}
    with pytest.raises(ValueError, match="do not apply to"):
        open_storage(str(tmp_path), {"endpoint_url": "http://x"})


def test_small_reads_refuse_fifos_symlinks_and_oversized_files(tmp_path: Path) -> None:
    storage = PosixStorage(str(tmp_path))
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "real").write_bytes(b"x" * 100)
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        storage.read_bytes(str(tmp_path / "fifo"))  # must not block
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        storage.read_bytes(str(tmp_path / "link"))  # O_NOFOLLOW
    with pytest.raises(CorruptCheckpointError, match="more than"):
        storage.read_bytes(str(tmp_path / "real"), limit=10)
    assert storage.size(str(tmp_path / "fifo")) is None


def test_a_directory_is_one_only_when_it_is_one_and_a_link_to_one_only_when_links_are_followed(tmp_path: Path) -> None:
    storage = PosixStorage(str(tmp_path))
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "d", tmp_path / "to-d")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "f").write_bytes(b"x")
    assert storage.is_dir(storage.join(storage.root, "d"), follow_links=False)
    assert storage.is_dir(str(tmp_path / "to-d")) and not storage.is_dir(str(tmp_path / "to-d"), follow_links=False)
    assert not any(storage.is_dir(str(tmp_path / n)) for n in ("fifo", "f", "missing"))
    assert storage.parent(str(tmp_path / "d") + "/") == str(tmp_path)


def test_compare_and_swap_lets_exactly_one_of_many_writers_win(tmp_path: Path) -> None:
    storage = open_storage(tmp_path)
    path = storage.path("pointer")
    # not any writer's "v{i}" (a content token would not see that ABA)
    assert storage.compare_and_swap(path, b"initial", None)
    assert not storage.compare_and_swap(path, b"again", None)  # None: only if absent
    _, token = storage.read_versioned(path) or (b"", "")
    wins: list[int] = []
    barrier = threading.Barrier(8)

    def writer(i: int) -> None:
        barrier.wait()
        if storage.compare_and_swap(path, f"v{i}".encode(), token):
            wins.append(i)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and storage.read_bytes(path) == f"v{wins[0]}".encode()
    assert sorted(os.listdir(tmp_path)) == [".ckptguard", "pointer"]  # the lock file stays out of the listing


def test_probe_finds_shared_and_separate_storage_with_thread_ranks(tmp_path: Path) -> None:
    def shared(comm: Comm) -> object:
        return probe_storage_domains(comm, PosixStorage(str(tmp_path / "shared"))).domains

    assert run_ranks(4, shared) == [((0, 1, 2, 3),)] * 4

    def separate(comm: Comm) -> object:
        node = comm.rank // 2  # ranks 0,1 on one "disk", 2,3 on another (same host name: probed, not assumed)
        return probe_storage_domains(comm, PosixStorage(str(tmp_path / f"node{node}"))).domains

    assert run_ranks(4, separate) == [((0, 1), (2, 3))] * 4


def test_of_two_jobs_taking_over_an_expired_lease_one_wins(tmp_path: Path) -> None:
    storage = PosixStorage(str(tmp_path))
    storage.makedirs(storage.path(".ckptguard"))
    old = Lease(storage, "old", None, ttl_s=0.2)
    old.acquire(wait_s=1)
    old._stop.set()  # the old holder stalls: no more renewals
    threading.Event().wait(0.5)
    takers = [Lease(storage, f"new{i}", None, ttl_s=30) for i in range(2)]
    results: list[str] = []
    barrier = threading.Barrier(2)

    def take(lease: Lease) -> None:
        barrier.wait()
        try:
            lease.acquire(wait_s=0.5)
            results.append(lease.holder)
        except ckptguard.LeaseHeldError:
            results.append("refused")

    threads = [threading.Thread(target=take, args=(t,)) for t in takers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert sorted(results)[1] == "refused" and results.count("refused") == 1, results
        with pytest.raises(ckptguard.LeaseLostError):
            old.check()
        old.renew()  # a stalled holder that wakes up must not overwrite the new record
        assert Lease(storage, "probe", None, 30).read().holder in ("new0", "new1")
    finally:
        for t in takers:
            t.release()


def test_a_takeover_whose_reply_is_lost_while_another_job_takes_the_root_names_that_job(tmp_path: Path) -> None:
    """The takeover's swap fails with an I/O error (a timeout) after another job's takeover landed: the
    lease is read back and judged again, so the job is refused naming the live holder, not with the
    OSError of a request whose outcome is in fact known."""

    class LosesTheReply(PosixStorage):
        def compare_and_swap(
            self, path: str, data: bytes, token: str | None, fence: Callable[[], None] | None = None
        ) -> bool:
            if token is not None and path == self.path(layout.LEASE) and b'"late"' in data:
                quick.acquire(wait_s=0)  # the other job wins meanwhile
                raise TimeoutError("no reply")
            return super().compare_and_swap(path, data, token, fence)

    storage = LosesTheReply(str(tmp_path))
    storage.makedirs(storage.path(".ckptguard"))
    old = Lease(PosixStorage(str(tmp_path)), "old", None, ttl_s=0.2)
    old.acquire(wait_s=1)
    old._stop.set()  # the old holder stalls: no more renewals
    threading.Event().wait(0.5)
    quick = Lease(PosixStorage(str(tmp_path)), "quick", "quick-job", ttl_s=30)
    late = Lease(storage, "late", None, ttl_s=30)
    try:
        with pytest.raises(ckptguard.LeaseHeldError, match="job quick-job"):
            late.acquire(wait_s=0)
    finally:
        quick.release()


def test_a_lease_taken_by_another_leader_of_the_same_job_says_so(tmp_path: Path) -> None:
    """A probe that wrongly split one shared root into two domains makes two leaders of one job take
    the lease: the loser is told it is its own job, not 'another job'."""
    storage = PosixStorage(str(tmp_path))
    storage.makedirs(storage.path(".ckptguard"))
    first, second = Lease(storage, "job-a", None, ttl_s=30), Lease(storage, "job-a", None, ttl_s=30)
    first.acquire(wait_s=1)
    second.acquire(wait_s=1)  # "it is ours": takes over with the next epoch
    try:
        with pytest.raises(ckptguard.LeaseLostError, match="same job") as info:
            first.check()
        assert "another job" not in str(info.value)
    finally:
        first.release()
        second.release()


def test_a_holder_frozen_inside_compare_and_swap_does_not_block_others_for_ever(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process stopped (SIGSTOP) while it holds the lock of a compare-and-swap: after the timeout
    the lock is broken and others proceed (a lease takeover must not wait for ever)."""
    import fcntl

    from ckptguard.storage import posix

    monkeypatch.setattr(posix, "CAS_LOCK_TIMEOUT_S", 0.5)
    storage = PosixStorage(str(tmp_path))
    path = storage.path("lease")
    assert storage.compare_and_swap(path, b"v1", None)
    frozen = os.open(storage._lock_path(path), os.O_RDWR | os.O_CREAT)
    fcntl.flock(frozen, fcntl.LOCK_EX)  # the frozen holder
    try:
        _, token = storage.read_versioned(path) or (b"", "")
        assert storage.compare_and_swap(path, b"v2", token)
        assert storage.read_bytes(path) == b"v2"
    finally:
        os.close(frozen)


@pytest.mark.parametrize("frozen_at", ["after its read", "in the fsync of its new content"])
def test_a_holder_frozen_inside_compare_and_swap_cannot_overwrite_the_swap_that_broke_its_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, frozen_at: str
) -> None:
    """A job SIGSTOPped in its lease renewal, inside the compare-and-swap (its own record read, the lock
    held), while another job breaks the lock after the timeout and takes the lease over: woken, it must
    not finish its swap (writing its record over the new holder's, carrying on as the holder and
    retiring the new holder's committed checkpoint). A swap whose lock was broken while it waited does
    not write, also when the freeze comes while the new content's temp file is fsynced (an NFS fsync
    hanging in a server failover): the lock is looked at after the temp file is written."""
    import threading

    from ckptguard.storage import posix

    monkeypatch.setattr(posix, "CAS_LOCK_TIMEOUT_S", 0.5)
    path = PosixStorage(str(tmp_path)).path("lease")
    frozen, thawed = PosixStorage(str(tmp_path)), PosixStorage(str(tmp_path))
    assert frozen.compare_and_swap(path, b"holder A", None)
    _, token_a = frozen.read_versioned(path) or (b"", "")
    inside, wake = threading.Event(), threading.Event()
    original = PosixStorage.read_versioned

    def freeze() -> None:
        if threading.current_thread() is not threading.main_thread() and not inside.is_set():
            inside.set()  # under the lock, the token matched
            wake.wait(30)

    def read_then_freeze(self: PosixStorage, p: str) -> tuple[bytes, str] | None:
        out = original(self, p)
        if self is frozen:
            freeze()
        return out

    if frozen_at == "after its read":
        monkeypatch.setattr(PosixStorage, "read_versioned", read_then_freeze)
    else:
        write_new_file = posix.write_new_file

        def write_then_freeze(p: str, data: bytes) -> None:
            write_new_file(p, data)
            freeze()

        monkeypatch.setattr(posix, "write_new_file", write_then_freeze)
        monkeypatch.setattr(
            posix, "replace_file", lambda p, d: (write_then_freeze(p + ".t", d), os.replace(p + ".t", p))
        )
    outcome: list[bool] = []
    a = threading.Thread(target=lambda: outcome.append(frozen.compare_and_swap(path, b"holder A renewed", token_a)))
    a.start()
    assert inside.wait(30)
    assert thawed.compare_and_swap(path, b"holder B", token_a)  # breaks the frozen lock after the timeout
    wake.set()
    a.join(30)
    assert outcome == [False]  # was: True, and the file said "holder A renewed"
    assert frozen.read_bytes(path) == b"holder B"


def test_an_object_store_that_ignores_its_conditions_is_refused_before_a_job_writes(tmp_path: Path) -> None:
    """The generic probe (for object stores that do not check their own conditional writes)."""
    from ckptguard.protocol.objstore import ObjectStoreRoot

    class IgnoresIfNoneMatch(PosixStorage):
        def create_exclusive(self, path: str, data: bytes) -> bool:
            self.replace(path, data)
            return True

    class IgnoresIfMatch(PosixStorage):
        def compare_and_swap(
            self, path: str, data: bytes, token: str | None, fence: Callable[[], None] | None = None
        ) -> bool:
            self.replace(path, data)
            return True

    for broken, condition in ((IgnoresIfNoneMatch, "If-None-Match"), (IgnoresIfMatch, "If-Match")):
        root = ObjectStoreRoot(broken(str(tmp_path / condition)))
        with pytest.raises(UnsupportedStorageError, match=f"{condition} ignored"):
            root.fence_staging()
        assert os.listdir(tmp_path / condition / layout.PROBE) == []  # the probe object is removed
    ObjectStoreRoot(PosixStorage(str(tmp_path / "honest"))).fence_staging()


def test_posix_replace_writes_parts_one_after_another(tmp_path: Path) -> None:
    """A content given in parts (a manifest's head and tables) is written as their concatenation."""
    storage = PosixStorage(str(tmp_path))
    target = str(tmp_path / "f")
    storage.replace(target, b"old")
    storage.replace(target, [b"head\n", b"", b"tables" * 1000])
    assert (tmp_path / "f").read_bytes() == b"head\n" + b"tables" * 1000
    assert os.listdir(tmp_path) == ["f"]  # no temp file left


def _read_ahead_reads(directory: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """How many blocking reads the load's read-ahead of ``directory`` made (its thread waited for)."""
    from ckptguard.storage import fileio

    blocking = []
    preadv, readv = os.preadv, os.readv

    def counted_preadv(fd: int, buffers: list[bytearray], offset: int, flags: int = 0) -> int:
        if not flags:
            blocking.append(offset)
        return preadv(fd, buffers, offset, flags)

    def counted_readv(fd: int, buffers: list[bytearray]) -> int:
        blocking.append(-1)
        return readv(fd, buffers)

    monkeypatch.setattr(os, "preadv", counted_preadv)
    monkeypatch.setattr(os, "readv", counted_readv)
    before = set(threading.enumerate())
    fileio.read_ahead(str(directory), "data")
    for t in set(threading.enumerate()) - before:
        t.join(timeout=30)
    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "readv", readv)
    return len(blocking)


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="preadv2(RWF_NOWAIT) is Linux's")
def test_the_loads_read_ahead_reads_what_is_not_cached_and_skips_what_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "data_0"
    path.write_bytes(os.urandom(20 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # evicted: a cold load
        try:
            os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)
            pytest.skip("this filesystem keeps the file cached after POSIX_FADV_DONTNEED")
        except BlockingIOError:
            pass
        except OSError:
            pytest.skip("this filesystem does not support RWF_NOWAIT")
        # 8 MiB at a time, but not what the kernel's own read-ahead brought in meanwhile.
        assert 1 <= _read_ahead_reads(tmp_path, monkeypatch) <= 3
        for at in (0, 12 << 20, (20 << 20) - 4096):
            assert os.preadv(fd, [bytearray(4096)], at, os.RWF_NOWAIT) == 4096  # now cached
        # Warm (a checkpoint just written, or read moments ago): nothing copied for nothing.
        assert _read_ahead_reads(tmp_path, monkeypatch) == 0
    finally:
        os.close(fd)
