"""What every Root must do, whatever the storage under it: one set of tests, run for each root.

A root is the control plane of one checkpoint root (protocol/root.py). These tests drive it the way the
protocol does (stage, commit, move `latest`, retire, take the root over) and check only what the
protocol relies on, so a new backend passes them or is not done (docs/architecture.md, "Adding a
backend"). POSIX runs on a temporary directory, S3 on moto behind the loopback fault proxy.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckptguard.errors import CheckpointError, CorruptCheckpointError, LeaseHeldError, LeaseLostError
from ckptguard.protocol import layout
from ckptguard.protocol.cas import Put, swap
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.lease import Lease
from ckptguard.protocol.manifest import FileEntry
from ckptguard.protocol.root import Root, open_root

from tests.support.beds.s3 import S3Bed, s3_bed_in_env
from tests.support.manifests import one_rank_manifest


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Bed]:
    with s3_bed_in_env(seed=7) as bed:
        yield bed


def _posix_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(tmp_path / "root")


def _s3_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    bed: S3Bed = request.getfixturevalue("s3")
    bed.reset_faults()
    return f"s3://{bed.make_bucket(f'conf-{uuid.uuid4().hex[:12]}')}/root"


#: Every root under test: name -> a fresh, empty root's URL (its bed started through ``request``).
#: A new backend is one entry here.
ROOTS: dict[str, Callable[[pytest.FixtureRequest, Path], str]] = {"posix": _posix_root, "s3": _s3_root}


@pytest.fixture(params=list(ROOTS))
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty root of each kind."""
    return ROOTS[request.param](request, tmp_path)


class Job:
    """One writing job's view of the root: its Root, fenced by a lease the test can take away."""

    def __init__(self, url: str) -> None:
        self.root: Root = open_root(url)
        self.root.storage.makedirs(self.root.storage.path(layout.CONTROL))
        self.lost = False
        self.root.fence_staging()
        self.root.set_fence(self._check)
        self.root.after_lease()

    def _check(self, acting: str) -> None:
        if self.lost:
            raise LeaseLostError(f"refusing to {acting}: the lease was taken over")

    def stage(self, step: int, payload: bytes = b"x" * 100) -> tuple[str, str, list[FileEntry]]:
        """An attempt with one data file written: (attempt, staging dir, its files)."""
        attempt = uuid.uuid4().hex
        staging = self.root.make_staging(step, attempt)
        rel = layout.data_file(0, 0)
        stream = self.root.storage.open_new(f"{staging}/{rel}")
        stream.write([memoryview(payload)])
        stream.sync()
        stream.close()
        return attempt, staging, [FileEntry(rel, len(payload), 0)]

    def save(
        self, step: int, seq: int, version: int = 1, last_check: Callable[[], None] | None = None
    ) -> CheckpointName:
        attempt, staging, files = self.stage(step)
        self.root.wait_files_visible(staging, files, 30)
        manifest = one_rank_manifest(step, version, attempt, files, seq)
        return self.root.commit(staging, manifest, last_check or (lambda: self.root.guard("commit")))


def test_a_commit_makes_the_attempt_a_checkpoint_every_reader_finds(url: str) -> None:
    job = Job(url)
    assert job.root.committed() == [] and job.root.listing() == {}
    name = job.save(5, seq=1)
    assert name == CheckpointName(5)
    reader = open_root(url)  # a reader that never held the lease
    assert reader.committed() == [name] and reader.current() == {5: name}
    assert reader.listing() == {5: {1: 1}}
    manifest = reader.read_manifest(name)
    reader.check_files(name, manifest)
    assert [rel for rel, _ in reader.walk(reader.data_dir(name, manifest)) if rel.startswith("data/")] == [
        layout.data_file(0, 0)
    ]
    assert reader.still_committed(name, 1) and not reader.still_committed(name, 2)


def test_an_error_before_the_commit_point_commits_nothing_and_a_new_attempt_commits(url: str) -> None:
    job = Job(url)

    def crash() -> None:
        raise RuntimeError("killed between the manifest and the commit point")

    attempt, staging, files = job.stage(3)
    with pytest.raises(RuntimeError, match="killed"):
        job.root.commit(staging, one_rank_manifest(3, 1, attempt, files, 1), crash)
    assert job.root.committed() == []
    job.root.discard_attempt(staging, CheckpointName(3), attempt)
    assert job.root.committed() == []
    # the next save of step 3 uses a version neither listed nor taken by the failed attempt
    taken = set(job.root.listing().get(3, {})) | set(job.root.taken_versions(3))
    version = max(taken, default=0) + 1
    name = job.save(3, seq=2, version=version)
    assert open_root(url).committed() == [name]


def test_a_commit_that_passed_its_commit_point_is_found_by_the_next_job(url: str) -> None:
    first = Job(url)
    name = first.save(8, seq=1)
    first.lost = True  # the job dies right after its commit point
    second = Job(url)
    assert second.root.committed() == [name] and second.root.listing() == {8: {1: 1}}


def test_latest_moves_by_commit_order_never_backwards(url: str) -> None:
    job = Job(url)
    high = job.save(300, seq=1)
    low = job.save(100, seq=2)  # committed after 300 (a rollback): the newer one
    assert job.root.move_latest(high, 1)
    assert job.root.move_latest(low, 2)
    assert not job.root.move_latest(high, 1)  # a stalled writer's older commit does not move it back
    pointer = open_root(url).read_latest()
    assert pointer is not None and pointer.dir == low.dirname and pointer.seq == 2
    assert job.root.latest_seq() >= 2 and job.root.latest_problem() is None


def test_racing_pointer_moves_end_at_the_commit_made_last(url: str) -> None:
    job = Job(url)
    names = [job.save(step, seq=step) for step in range(1, 7)]
    newest_first = names[::-1]
    _, errors = _race(len(names), lambda i: open_root(url).move_latest(newest_first[i], newest_first[i].step))
    assert not errors
    pointer = job.root.read_latest()
    assert pointer is not None and pointer.dir == names[-1].dirname


def test_deleting_the_step_latest_names_moves_it_back_and_keeps_its_number(url: str) -> None:
    job = Job(url)
    first, second = job.save(1, seq=1), job.save(2, seq=2)
    job.root.move_latest(second, 2)
    retired = job.root.retire(job.root.dir(second))
    assert retired is not None
    job.root.remove_retired(retired)
    assert job.root.committed() == [first] and not job.root.still_committed(second, 2)
    job.root.latest_after_delete(2, job.root.listing())
    pointer = job.root.read_latest()
    assert pointer is not None and pointer.dir == first.dirname
    assert job.root.latest_seq() >= 2  # step 2's number is never handed out again
    again = job.save(2, seq=3)
    assert job.root.still_committed(again, 3) and not job.root.still_committed(again, 2)


def test_garbage_is_what_no_commit_needs(url: str) -> None:
    job = Job(url)
    kept = job.save(1, seq=1)
    _, abandoned_dir, _ = job.stage(2)
    in_flight, in_flight_dir, _ = job.stage(3)
    garbage = job.root.garbage(keep_attempts=frozenset({in_flight}))
    assert abandoned_dir in garbage.staging and in_flight_dir not in garbage.staging
    manifest = job.root.read_manifest(kept)
    assert job.root.data_dir(kept, manifest) not in garbage.staging  # a commit's data is never garbage
    for path in garbage.staging:
        retired = job.root.retire(path)
        if retired is not None:
            job.root.remove_retired(retired)
    job.root.check_files(kept, job.root.read_manifest(kept))
    assert job.root.garbage(keep_attempts=frozenset({in_flight})).staging == []


def test_a_job_that_lost_the_root_changes_nothing(url: str) -> None:
    old = Job(url)
    kept = old.save(1, seq=1)
    old.root.move_latest(kept, 1)
    attempt, staging, files = old.stage(2)  # in flight when the lease is taken over
    old.lost = True
    new = Job(url)
    # Refused by the fence; or, where the takeover moved the attempt away (POSIX), by finding no source
    # (the session reports that as the lease lost).
    with pytest.raises((LeaseLostError, FileNotFoundError)):
        old.root.commit(staging, one_rank_manifest(2, 1, attempt, files, 2), lambda: old.root.guard("commit"))
    with pytest.raises(LeaseLostError):
        old.root.move_latest(CheckpointName(1), 5)
    with pytest.raises(LeaseLostError):
        old.root.retire(old.root.dir(kept))
    with pytest.raises(LeaseLostError):
        old.root.remove_retired(old.root.dir(kept))
    assert new.root.committed() == [kept]
    pointer = new.root.read_latest()
    assert pointer is not None and pointer.seq == 1
    new.root.check_files(kept, new.root.read_manifest(kept))


def test_a_manifest_that_does_not_match_its_place_or_its_files_is_corrupt(url: str) -> None:
    job = Job(url)
    name = job.save(4, seq=1)
    data = job.root.read_manifest_bytes(name)
    with pytest.raises(CorruptCheckpointError, match="describes step 4"):
        job.root.parse_manifest(CheckpointName(9), data)
    with pytest.raises(CorruptCheckpointError, match="commit sequence number"):
        job.root.parse_manifest(name, data, seq=7)
    manifest = job.root.read_manifest(name)
    job.root.storage.delete(f"{job.root.data_dir(name, manifest)}/{manifest.files[0].path}")
    with pytest.raises(CorruptCheckpointError, match="missing"):
        job.root.check_files(name, manifest)


# -- the primitives under races: what a store that does not honour its conditions gets wrong ------------


def _race(n: int, fn: Callable[[int], object]) -> tuple[list[object], list[BaseException]]:
    """``fn(0..n-1)`` in ``n`` threads released at once: (results, errors)."""
    ready = threading.Barrier(n)
    out: list[object] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            ready.wait()
            out[i] = fn(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out, errors


def test_of_many_exclusive_creates_of_one_key_exactly_one_wins(url: str) -> None:
    storages = [open_root(url).storage for _ in range(6)]  # one client each, as separate jobs
    storages[0].makedirs(storages[0].path(layout.CONTROL))
    for k in range(3):
        path = storages[0].path(layout.CONTROL, f"race-{k}")
        won, errors = _race(6, lambda i, path=path: storages[i].create_exclusive(path, f"writer {i}".encode()))
        assert not errors, errors
        winners = [i for i, w in enumerate(won) if w]
        assert len(winners) == 1, f"{len(winners)} creates of {path} all reported success"
        assert storages[0].read_bytes(path) == f"writer {winners[0]}".encode()


def test_concurrent_compare_and_swaps_of_one_pointer_lose_no_update(url: str) -> None:
    """Every pointer (`latest`, tags, the object-store index, the lease) moves by ``cas.swap``: writers
    racing on one record each see their update applied exactly once."""
    storages = [open_root(url).storage for _ in range(4)]
    storages[0].makedirs(storages[0].path(layout.CONTROL))
    path = storages[0].path(layout.CONTROL, "counter")

    def bump(i: int) -> None:
        for _ in range(5):
            # each write distinct (a store may count a conditional write whose answer was lost as landed when
            # the record holds what it wrote; two writers of equal bytes are not a lost update)
            swap(
                storages[i],
                path,
                decode=lambda b: int(b.split()[0]),
                encode=lambda n: f"{n} {uuid.uuid4()}".encode(),
                decide=lambda n: Put((n or 0) + 1, None),
                fence=None,
                what="count",
                rounds=400,
                pause_s=0.002,
            )

    _, errors = _race(4, bump)
    assert not errors, errors
    assert int(storages[0].read_bytes(path).split()[0]) == 20, "a compare-and-swap overwrote a concurrent one"


def test_of_jobs_taking_one_lease_at_once_exactly_one_holds_it_each_time_with_a_new_epoch(url: str) -> None:
    storage = open_root(url).storage
    storage.makedirs(storage.path(layout.CONTROL))
    leases = [Lease(open_root(url).storage, uuid.uuid4().hex, uuid.uuid4().hex, 0.5) for _ in range(4)]
    epochs: list[int] = []
    try:
        for _ in range(2):  # an absent lease, then the holder's expired one
            waiting = [lease for lease in leases if lease.epoch == 0]
            _, errors = _race(len(waiting), lambda i, waiting=waiting: waiting[i].acquire(0.2))
            won = [lease for lease in waiting if lease.epoch]
            assert len(won) == 1, f"{len(won)} jobs hold the lease at once"
            assert all(isinstance(e, LeaseHeldError) for e in errors), errors
            epochs.append(won[0].epoch)
            won[0]._stop.set()  # the holder stalls: its lease expires
            time.sleep(0.7)
    finally:
        for lease in leases:
            lease._stop.set()
    assert epochs[1] > epochs[0], epochs


def test_a_holder_renewing_its_lease_from_several_threads_at_once_keeps_it(url: str) -> None:
    """The renewal thread and every save's check renew one lease concurrently; a renewal whose
    compare-and-swap rounds all lose to those of its own job still holds the lease (it was found
    by the model-based long run as "another storage-domain leader of this same job took it")."""
    storage = open_root(url).storage
    storage.makedirs(storage.path(layout.CONTROL))
    lease = Lease(storage, uuid.uuid4().hex, uuid.uuid4().hex, 30.0)
    lease.acquire(1.0)
    try:
        deadline = time.monotonic() + 3.0

        def renew_until_deadline(i: int) -> None:
            while time.monotonic() < deadline:
                lease.renew()

        _, errors = _race(8, renew_until_deadline)
        assert not errors, errors
        lease.check(acting="save")  # raises LeaseLostError if a lost round was taken for a takeover
        assert lease.read() is not None and lease.read().holder == lease.holder  # type: ignore[union-attr]
    finally:
        lease.release()


def test_a_commit_stalled_past_a_takeover_is_refused_or_listed_never_lost(url: str) -> None:
    """The stalled job passed its last check, then another job took the root over before its commit point:
    its commit must fail, or be one the new job lists; never reported committed yet not there."""
    old = Job(url)
    attempt, staging, files = old.stage(1)
    jobs: list[Job] = []

    def stall_then_take_over() -> None:
        old.root.guard("commit")  # passes: the takeover happens after it
        old.lost = True
        jobs.append(Job(url))

    try:
        old.root.commit(staging, one_rank_manifest(1, 1, attempt, files, 1), stall_then_take_over)
        told = "committed"
    except (LeaseLostError, FileNotFoundError, CheckpointError) as e:
        told = str(e)
    listed = open_root(url).committed()
    claimed = told == "committed" or "is committed" in told
    assert (CheckpointName(1) in listed) == claimed, f"the old job was told {told!r}; the root lists {listed}"
    jobs[0].root.guard("commit")  # the new job still holds the root


def test_a_job_that_lost_the_lease_does_not_take_the_root_back(url: str) -> None:
    old = Job(url)
    old.lost = True
    new = Job(url)
    with contextlib.suppress(LeaseLostError):
        old.root.after_lease()  # refused, or a no-op: never a second takeover under a lost lease
    new.root.guard("commit")
    assert new.save(2, seq=1) in open_root(url).committed()


def test_data_reads_back_through_open_read_and_replace_is_atomic(url: str) -> None:
    job = Job(url)
    storage = job.root.storage
    payload = bytes(range(256)) * 4096  # 1 MiB
    _, staging, files = job.stage(1, payload)
    handle = storage.open_read(f"{staging}/{files[0].path}")
    try:
        assert handle.size() == len(payload)
        buf = bytearray(1000)
        handle.read_into([memoryview(buf)[:400], memoryview(buf)[400:]], 123_456)
        assert bytes(buf) == payload[123_456:124_456]
    finally:
        handle.close()
    path = storage.path(layout.CONTROL, "replaced")
    storage.replace(path, b"one")
    storage.replace(path, b"two")
    assert storage.read_bytes(path) == b"two"
    seen: set[bytes] = set()

    def replace_or_read(i: int) -> None:
        for k in range(10):
            if i == 0:
                storage.replace(path, b"A" * 5000 if k % 2 else b"B" * 3000)
            else:
                seen.add(storage.read_bytes(path))

    _, errors = _race(2, replace_or_read)
    assert not errors, errors
    assert seen <= {b"two", b"A" * 5000, b"B" * 3000}, "a reader saw a torn replace"
