"""s3:// roots against a real S3 HTTP endpoint on loopback: moto's server behind a fault-injecting proxy.

Nothing here leaves 127.0.0.1: the bed sets AWS_ENDPOINT_URL to the proxy and
dummy credentials, and turns off the instance-metadata lookup.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.support.jobs import REPO

pytest.importorskip("boto3")
pytest.importorskip("moto")

import ckptguard
from ckptguard import (
    BucketNotFoundError,
    Checkpointer,
    CheckpointError,
    CommitOutcomeUnknownError,
    LeaseLostError,
    StoragePermissionError,
    UnsupportedStorageError,
    WrongRegionError,
)
from ckptguard.protocol.layout import INDEX, CheckpointName
from ckptguard.protocol.manifest import Manifest
from ckptguard.protocol.objstore import ObjectStoreRoot
from ckptguard.storage import open_storage
from ckptguard.storage.s3 import S3Storage, _Clients

from tests.support.beds.s3 import (
    FaultProxy,
    Request,
    S3Bed,
    canned_denied,
    canned_wrong_region,
    s3_bed_in_env,
)
from tests.support.jobs import JobResult, free_port, process_state, run_job
from tests.support.manifests import one_rank_manifest
from tests.support.results import job_results, parse_results

WORKER = REPO / "tests" / "workers" / "s3_job.py"
SMALL = {"part_size": 5 << 20}


@pytest.fixture(scope="module")
def bed() -> Iterator[S3Bed]:
    with s3_bed_in_env(seed=13) as b:
        yield b


@pytest.fixture
def bucket(bed: S3Bed) -> Iterator[str]:
    bed.reset_faults()
    name = bed.make_bucket(f"ckpt-{uuid.uuid4().hex[:12]}")
    yield name
    bed.reset_faults()


def _state(step: int, n: int = 1_500_000) -> dict[str, object]:
    return {"w": torch.arange(n, dtype=torch.float32) + step, "b": torch.full((10,), float(step)), "step": step}


def _empty(n: int = 1_500_000) -> dict[str, object]:
    return {"w": torch.zeros(n), "b": torch.zeros(10), "step": -1}


def _cli(bed: S3Bed, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **bed.env(), "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


# -- the bed itself ---------------------------------------------------------------------------


def test_moto_honours_conditional_writes_including_multipart_completion(bed: S3Bed, bucket: str) -> None:
    """What the tests rely on: moto refuses If-None-Match over an existing key (PUT and completion)
    and a stale If-Match; the proxy refuses a body whose CRC32C header does not match."""
    from botocore.exceptions import ClientError

    c = bed.client(direct=False)
    etag = c.put_object(Bucket=bucket, Key="k", Body=b"a", IfNoneMatch="*")["ETag"]
    for kwargs in ({"IfNoneMatch": "*"}, {"IfMatch": '"0123"'}):
        with pytest.raises(ClientError, match="PreconditionFailed"):
            c.put_object(Bucket=bucket, Key="k", Body=b"b", **kwargs)
    c.put_object(Bucket=bucket, Key="k", Body=b"c", IfMatch=etag)
    up = c.create_multipart_upload(Bucket=bucket, Key="k")["UploadId"]
    part = c.upload_part(Bucket=bucket, Key="k", UploadId=up, PartNumber=1, Body=b"d")
    with pytest.raises(ClientError, match="PreconditionFailed"):
        c.complete_multipart_upload(
            Bucket=bucket,
            Key="k",
            UploadId=up,
            IfNoneMatch="*",
            MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
        )
    c.abort_multipart_upload(Bucket=bucket, Key="k", UploadId=up)
    with pytest.raises(ClientError, match="BadDigest"):
        c.put_object(Bucket=bucket, Key="k2", Body=b"hello", ChecksumCRC32C="AAAAAA==")


# -- storage primitives ---------------------------------------------------------------------


def test_primitives_exclusive_create_cas_streams_and_ranged_reads(bed: S3Bed, bucket: str) -> None:
    s = S3Storage(f"s3://{bucket}/root", SMALL)
    p = s.path("ctl", "pointer")
    assert s.create_exclusive(p, b"initial") and not s.create_exclusive(p, b"other")
    data, token = s.read_versioned(p) or (b"", "")
    assert data == b"initial"
    # An ETag is the MD5 of the bytes: a write of identical bytes keeps it, so compare-and-swap on it is
    # sound only where every write changes the bytes (the index, lease and `latest` always do).
    wins: list[int] = []
    barrier = threading.Barrier(6)

    def cas(i: int) -> None:
        barrier.wait()
        if s.compare_and_swap(p, f"v{i}".encode(), token):
            wins.append(i)

    threads = [threading.Thread(target=cas, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and s.read_bytes(p) == f"v{wins[0]}".encode()
    # a 13 MiB stream: three parts, each with its CRC32C checked by the proxy on arrival
    blob = os.urandom(13 << 20)
    before, bad = bed.proxy.stats.checksummed_puts, bed.proxy.stats.bad_digest
    stream = s.open_new(s.path("data", "blob"))
    view = memoryview(blob)
    for i in range(0, len(blob), 3 << 20):
        stream.write([view[i : i + (3 << 20)]])
    stream.sync()
    stream.close()
    assert bed.proxy.stats.checksummed_puts - before >= 3 and bed.proxy.stats.bad_digest == bad
    with pytest.raises(FileExistsError):  # one writer per path
        again = s.open_new(s.path("data", "blob"))
        again.write([memoryview(b"x")])
        again.sync()
    handle = s.open_read(s.path("data", "blob"))
    out = [bytearray(7 << 20), bytearray(4 << 20)]  # a read across part boundaries, into two buffers
    handle.read_into([memoryview(b) for b in out], 1 << 20)
    assert bytes(out[0]) + bytes(out[1]) == blob[1 << 20 : 12 << 20]
    with pytest.raises(ckptguard.CorruptCheckpointError, match="truncated"):
        handle.read_into([memoryview(bytearray(10))], len(blob) - 5)
    assert s.sizes_in(s.path("data")) == {"blob": len(blob)}
    assert bed.open_uploads(bucket) == []


def test_a_conditional_write_retried_after_a_5xx_that_landed_counts_as_ours(bed: S3Bed, bucket: str) -> None:
    """The proxy applies requests but answers 500: botocore retries, the retry gets 412 from its own first
    try, and the backend reads back and finds its own bytes (small objects) or its token (streams)."""
    s = S3Storage(f"s3://{bucket}/r", SMALL)
    s.ensure_ready()
    bed.proxy.fail_rate = 0.3
    bed.proxy.kinds = ["500-after"]
    injected = bed.proxy.stats.injected
    for i in range(6):
        assert s.create_exclusive(s.path(f"small-{i}"), f"body {i}".encode())
        stream = s.open_new(s.path(f"big-{i}"))
        stream.write([memoryview(os.urandom(6 << 20))])
        stream.sync()
        stream.close()
    bed.proxy.fail_rate = 0.0
    assert bed.proxy.stats.injected - injected >= 3
    assert not s.create_exclusive(s.path("small-0"), b"someone else")


# -- Checkpointer on s3:// -------------------------------------------------------------------


def test_root_identity_on_s3_is_one_object_created_once(bed: S3Bed, bucket: str) -> None:
    """The root's identity (what integrations bind pointers to) lives in the bucket, created by a
    conditional create: eight creators at once end with one, and every later job reads it."""
    from ckptguard.protocol import rootid
    from ckptguard.verify import read_root_id

    root = f"s3://{bucket}/run"
    with Checkpointer(root) as ck:
        start, got = threading.Barrier(8), []

        def create() -> None:
            storage = open_storage(root)
            start.wait()
            got.append(rootid.create(storage, fence=lambda: None))

        threads = [threading.Thread(target=create) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(got) == 8 and len(set(got)) == 1
        assert ck.root_id() == got[0]
    assert (
        bed.client().get_object(Bucket=bucket, Key="run/.ckptguard/root-id")["Body"].read() == got[0].encode() + b"\n"
    )
    with Checkpointer(root) as ck:
        assert ck.root_id() == got[0] == read_root_id(root)


def test_save_load_retention_ls_and_verify_on_s3(bed: S3Bed, bucket: str) -> None:
    root = f"s3://{bucket}/run"
    with Checkpointer(root, keep_last=2, storage_options=SMALL) as ck:
        for step in range(4):
            ck.save(step, _state(step))
        assert ck.steps() == [2, 3] and ck.latest() == 3
        out = _empty()
        assert ck.load(out) == 3 and torch.equal(out["w"], _state(3)["w"]) and out["step"] == 3  # type: ignore[arg-type]
        with pytest.raises(ckptguard.StepExistsError):
            ck.save(3, _state(3))
        ck.save(3, _state(30), overwrite=True)  # a new version of the step, committed atomically
        assert ck.load(out) == 3 and out["step"] == 30
    keys = bed.keys(bucket, "run/")
    assert "run/step-00000003.v2/MANIFEST.json" in keys and "run/step-00000000/MANIFEST.json" not in keys
    assert not [k for k in keys if "step-00000000." in k]  # retired data removed too
    index = json.loads(bed.client().get_object(Bucket=bucket, Key=f"run/{INDEX}")["Body"].read())
    committed = [(e["step"], e["version"], e["seq"]) for e in index["entries"] if e["state"] == "committed"]
    assert [c[:2] for c in committed] == [(2, 1), (3, 2)] and committed[0][2] < committed[1][2]
    assert bed.open_uploads(bucket) == []
    ls = _cli(bed, "ls", root, "--json")
    assert ls.returncode == 0, ls.stderr
    listing = json.loads(ls.stdout)
    assert [(c["step"], c["version"], c["latest"]) for c in listing["checkpoints"]] == [(2, 1, False), (3, 2, True)]
    assert listing["attempts"] == []
    ver = _cli(bed, "verify", root, "--json")
    assert ver.returncode == 0, ver.stdout + ver.stderr
    assert json.loads(ver.stdout)["safe_to_resume"] == 3
    # bit rot in the newest checkpoint: verify says so, load falls back to step 2
    m = Manifest.from_json(
        bed.client().get_object(Bucket=bucket, Key="run/step-00000003.v2/MANIFEST.json")["Body"].read(), "m"
    )
    victim = f"run/.ckptguard/staging/step-00000003.{m.attempt}/{m.files[0].path}"
    blob = bytearray(bed.client().get_object(Bucket=bucket, Key=victim)["Body"].read())
    blob[100] ^= 0xFF
    bed.client().put_object(Bucket=bucket, Key=victim, Body=bytes(blob))
    ver = _cli(bed, "verify", root, "--json")
    assert ver.returncode == 1 and json.loads(ver.stdout)["safe_to_resume"] == 2
    with Checkpointer(root, read_only=True) as ck, pytest.warns(UserWarning, match="corrupt"):
        assert ck.load(out) == 2 and out["step"] == 2


def _many_tensors(seed: int) -> dict[str, torch.Tensor]:
    """One tensor larger than a part and many small ones: parts start and end inside tensors and span
    several of them."""
    g = torch.Generator().manual_seed(seed)
    state = {"big": torch.randn(3_000_001, generator=g)}
    state.update({f"small{i}": torch.randn(1000 + 7919 * i, generator=g) for i in range(60)})
    return state


def test_parts_retried_after_5xx_resend_the_same_bytes_and_load_bitwise_equal(bed: S3Bed, bucket: str) -> None:
    """Parts are sent from the tensors' memory: an UploadPart answered 500 (before or after moto applied
    it) is sent again from the start of the same bytes, with the checksum the proxy checks."""
    is_part = lambda r: r.method == "PUT" and "partNumber=" in r.query  # noqa: E731
    failed = bed.proxy.add_rule(is_part, "fail", times=3)
    failed_after = bed.proxy.add_rule(is_part, "fail-after", times=2)
    checked, bad = bed.proxy.stats.checksummed_puts, bed.proxy.stats.bad_digest  # the bed is the module's
    state = _many_tensors(1)
    with Checkpointer(f"s3://{bucket}/retried", storage_options=SMALL) as ck:
        ck.save(1, state)
        assert failed.hits == 3 and failed_after.hits == 2
        assert bed.proxy.stats.bad_digest == bad and bed.proxy.stats.checksummed_puts - checked >= 8
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ck.load(out) == 1
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert bed.open_uploads(bucket) == []


def test_s3_save_keeps_no_copy_of_the_state_and_load_no_second_copy(bed: S3Bed, bucket: str) -> None:
    """Resident memory above the state during a save: no part buffers (parts are the tensors' memory);
    during a load: the all-or-nothing copy of the old bytes (within the verified-bytes budget), and no
    buffer per range in flight."""
    env = {**os.environ, **bed.env(), "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "workers" / "s3_memory_job.py"), f"s3://{bucket}/memory", "24", "5"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (res,) = parse_results(proc.stdout)
    assert res["equal"]
    state = res["state_bytes"]
    assert res["save_above"] < state // 8, res
    assert res["load_above"] < state + state // 8, res


def test_background_saves_and_files_artifacts_on_s3(bed: S3Bed, bucket: str, tmp_path: Path) -> None:
    offload = tmp_path / "offload"
    (offload / "sub").mkdir(parents=True)
    (offload / "state.bin").write_bytes(os.urandom(70_000))
    (offload / "sub" / "meta.txt").write_text("rank 0\n")
    want = {p.relative_to(offload): p.read_bytes() for p in offload.rglob("*") if p.is_file()}
    with Checkpointer(f"s3://{bucket}/bg", keep_last=2, storage_options=SMALL) as ck:
        for step in range(3):
            ck.save(step, _state(step, 200_000), files={"offload": offload}, blocking=False)
        ck.wait()
        assert ck.steps() == [1, 2]
        for p in offload.rglob("*"):
            if p.is_file():
                p.unlink()
        out = _empty(200_000)
        assert ck.load(out, files={"offload": offload}) == 2 and out["step"] == 2
    assert {p.relative_to(offload): p.read_bytes() for p in offload.rglob("*") if p.is_file()} == want


def test_retention_deletes_the_commit_object_before_the_data(bed: S3Bed, bucket: str) -> None:
    root = f"s3://{bucket}/ret"
    with Checkpointer(root, keep_last=1, storage_options=SMALL) as ck:
        ck.save(1, _state(1, 1000))
        start = len(bed.proxy.stats.log)
        ck.save(2, _state(2, 1000))
    log = bed.proxy.stats.log[start:]
    commit_delete = next(
        i for i, (m, p, q, _) in enumerate(log) if m == "DELETE" and p.endswith("ret/step-00000001/MANIFEST.json")
    )
    data_delete = next(i for i, (m, p, q, _) in enumerate(log) if m == "POST" and q.startswith("delete"))
    index_puts = [i for i, (m, p, q, _) in enumerate(log) if m == "PUT" and p.endswith(INDEX)]
    assert max(i for i in index_puts if i < commit_delete) < commit_delete < data_delete


def test_a_stale_listing_changes_no_load_or_commit_decision(bed: S3Bed, bucket: str) -> None:
    """Listings hide every key written in the last hour: saves, loads, steps, latest and retention are
    unchanged (they go through the index and GETs); only garbage collection finds less."""
    root = f"s3://{bucket}/stale"
    bed.proxy.hide_listing_s = 3600
    with Checkpointer(root, keep_last=2, storage_options=SMALL) as ck:
        for step in range(4):
            ck.save(step, _state(step, 100_000))
        assert ck.steps() == [2, 3] and ck.steps(refresh=True) == [2, 3]
        out = _empty(100_000)
        assert ck.load(out) == 3 and out["step"] == 3
    with Checkpointer(root, read_only=True) as ck:
        assert ck.steps() == [2, 3]
        assert ck.load(out) == 3
    bed.proxy.hide_listing_s = 0
    for step in (2, 3):  # committed data intact
        assert [k for k in bed.keys(bucket, "stale/.ckptguard/staging/") if f"step-0000000{step}." in k]


def test_a_lost_index_with_commit_objects_left_is_a_damaged_root_and_nothing_is_deleted(
    bed: S3Bed, bucket: str
) -> None:
    root = f"s3://{bucket}/noindex"
    with Checkpointer(root, storage_options=SMALL) as ck:
        ck.save(1, _state(1, 1000))
        ck.save(2, _state(2, 1000))
    bed.client().delete_object(Bucket=bucket, Key=f"noindex/{INDEX}")
    data = sorted(bed.keys(bucket, "noindex/.ckptguard/staging/"))
    with pytest.raises(ckptguard.CorruptCheckpointError, match=r"index\.json"):
        Checkpointer(root, keep_last=1, storage_options=SMALL)
    with (
        pytest.raises(ckptguard.CorruptCheckpointError, match=r"index\.json"),
        Checkpointer(root, read_only=True) as reader,
    ):
        reader.load(_empty(1000))
    assert sorted(bed.keys(bucket, "noindex/.ckptguard/staging/")) == data
    verify = _cli(bed, "verify", root)
    assert verify.returncode == 1 and "index.json" in verify.stdout + verify.stderr, verify


def test_an_indexed_step_whose_commit_object_is_missing_is_corrupt_not_retired(bed: S3Bed, bucket: str) -> None:
    root = f"s3://{bucket}/nocommit"
    with Checkpointer(root, storage_options=SMALL) as ck:
        ck.save(1, _state(1, 1000))
        ck.save(2, _state(2, 1000))
    bed.client().delete_object(Bucket=bucket, Key="nocommit/step-00000002/MANIFEST.json")
    with Checkpointer(root, read_only=True) as ck:
        out = _empty(1000)
        with pytest.warns(UserWarning, match="falling back"):
            assert ck.load(out) == 1
        assert out["step"] == 1
        with pytest.raises(ckptguard.CorruptCheckpointError, match=r"MANIFEST\.json") as err:
            ck.load(_empty(1000), step=2)
        assert not isinstance(err.value, ckptguard.StepRetiredError)


def test_a_commit_object_the_index_does_not_list_is_reported_and_its_data_never_garbage(
    bed: S3Bed, bucket: str, tmp_path: Path
) -> None:
    from ckptguard.protocol.objindex import Index
    from ckptguard.protocol.root import open_root

    root = f"s3://{bucket}/unlisted"
    with Checkpointer(root, storage_options=SMALL) as ck:
        ck.save(1, _state(1, 1000))
        ck.save(2, _state(2, 1000))
    client = bed.client()
    index = Index.from_bytes(client.get_object(Bucket=bucket, Key=f"unlisted/{INDEX}")["Body"].read(), INDEX)
    (entry,) = [e for e in index.entries if e.step == 2]
    index.entries.remove(entry)
    client.put_object(Bucket=bucket, Key=f"unlisted/{INDEX}", Body=index.to_bytes())
    garbage = open_root(root).garbage().staging
    assert not any(entry.attempt in g for g in garbage), garbage
    listed = json.loads(_cli(bed, "ls", root, "--json").stdout)
    assert listed["unlisted"] == [f"{root}/step-00000002/MANIFEST.json"]
    assert not any(a["attempt"] == entry.attempt for a in listed["attempts"])
    shown = _cli(bed, "ls", root)
    assert "step-00000002/MANIFEST.json is not listed by the root's index" in " ".join(shown.stdout.split()), shown
    res = _cli(bed, "export", f"{root}/step-00000002", str(tmp_path / "s2.pt"))
    assert res.returncode == 0, res.stderr
    assert torch.load(tmp_path / "s2.pt", weights_only=False)["step"] == 2


def test_a_store_that_ignores_conditional_writes_is_refused(bed: S3Bed, bucket: str) -> None:
    bed.proxy.strip_conditions = True
    _Clients.ready.clear()
    try:
        with pytest.raises(UnsupportedStorageError, match="ignores conditional writes"):
            Checkpointer(f"s3://{bucket}/unsafe")
        assert not [k for k in bed.keys(bucket) if "step-" in k]
    finally:
        _Clients.ready.clear()


def test_the_probe_of_conditional_writes_survives_each_of_its_requests_failing_once(bed: S3Bed, bucket: str) -> None:
    # CI saw it: the probe's first PUT (If-None-Match: *) landed, was answered 500, botocore retried it
    # and got 412 from its own first try; the job refused to open the root. Every request of the probe
    # is made to fail once (before, and after landing): a store that honours conditions still passes.
    def first_try_of_each_probe_request() -> Callable[[Request], bool]:
        seen: set[tuple[str, str, bytes]] = set()

        def match(r: Request) -> bool:
            if "/.ckptguard/probe/" not in r.path:
                return False
            what = (r.method, r.query.split("uploadId=")[0], r.body)
            if what in seen:
                return False
            seen.add(what)
            return True

        return match

    for action in ("fail-after", "fail", "drop"):
        _Clients.ready.clear()
        bed.reset_faults()
        rule = bed.proxy.add_rule(first_try_of_each_probe_request(), action)
        try:
            with Checkpointer(f"s3://{bucket}/probe-{action}", storage_options=SMALL) as ck:
                ck.save(1, _state(1, n=10))
                assert ck.steps() == [1]
        finally:
            _Clients.ready.clear()
        assert rule.hits >= 6, (action, rule.hits)  # 3 PUTs, create, part, complete (abort, delete)
    bed.reset_faults()
    bed.proxy.strip_conditions = True  # and one that ignores them is still refused under the same faults
    bed.proxy.add_rule(first_try_of_each_probe_request(), "fail-after")
    try:
        with pytest.raises(UnsupportedStorageError, match="ignores conditional writes"):
            Checkpointer(f"s3://{bucket}/unsafe")
    finally:
        _Clients.ready.clear()


def test_a_process_that_points_aws_endpoint_url_elsewhere_reaches_the_new_endpoint(
    bed: S3Bed, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A client made while AWS_ENDPOINT_URL named a dead port must not be reused once it names the store.
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(CheckpointError):
        Checkpointer(f"s3://{bucket}/moved", storage_options={"control_max_attempts": 1, "max_attempts": 1})
    monkeypatch.setenv("AWS_ENDPOINT_URL", bed.endpoint)
    with Checkpointer(f"s3://{bucket}/moved", storage_options={"control_max_attempts": 1, "max_attempts": 1}) as ck:
        ck.save(1, _state(1, n=10))
        assert ck.steps() == [1]


def test_missing_bucket_access_denied_and_wrong_region_are_typed(bed: S3Bed, bucket: str) -> None:
    with pytest.raises(BucketNotFoundError, match="does not exist"):
        Checkpointer(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x")
    bed.proxy.canned["denied-bucket"] = canned_denied()
    bed.proxy.canned["far-bucket"] = canned_wrong_region("eu-west-3")
    with pytest.raises(StoragePermissionError, match="access denied"):
        Checkpointer("s3://denied-bucket/x")
    with pytest.raises(WrongRegionError, match="eu-west-3"):
        Checkpointer("s3://far-bucket/x")
    for bad in ("gs://bucket/run", "hf://org/model"):
        with pytest.raises(UnsupportedStorageError, match="s3://"):
            Checkpointer(bad)
    ls = _cli(bed, "ls", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x")
    assert ls.returncode == 2 and "does not exist" in ls.stderr


def test_save_file_and_load_file_accept_s3_paths(bed: S3Bed, bucket: str) -> None:
    obj = {"w": torch.randn(300, 300), "n": 3}
    ckptguard.save_file(obj, f"s3://{bucket}/files/model.pt")
    got = ckptguard.load_file(f"s3://{bucket}/files/model.pt")
    assert torch.equal(got["w"], obj["w"]) and got["n"] == 3
    raw = bytearray(bed.client().get_object(Bucket=bucket, Key="files/model.pt")["Body"].read())
    raw[200] ^= 1
    bed.client().put_object(Bucket=bucket, Key="files/model.pt", Body=bytes(raw))
    with pytest.raises(ckptguard.CorruptCheckpointError):
        ckptguard.load_file(f"s3://{bucket}/files/model.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        ckptguard.load_file(f"s3://{bucket}/files/nothing.pt")


def test_export_and_dcp_reader_read_an_s3_checkpoint(bed: S3Bed, bucket: str, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with Checkpointer(f"s3://{bucket}/run", process_group="local") as ck:
        for step in (1, 2):
            ck.save(step, {"model": {"w": torch.arange(64.0) + step}, "epoch": step})
    sd = {"model": {"w": torch.zeros(64)}}
    dcp.load(sd, storage_reader=ckptguard.DCPReader(f"s3://{bucket}/run"), no_dist=True)
    assert torch.equal(sd["model"]["w"], torch.arange(64.0) + 2)
    sd = {"model": {"w": torch.zeros(64)}}
    dcp.load(sd, storage_reader=ckptguard.DCPReader(f"s3://{bucket}/run/step-00000001"), no_dist=True)
    assert torch.equal(sd["model"]["w"], torch.arange(64.0) + 1)
    res = _cli(
        bed, "export", f"s3://{bucket}/run", str(tmp_path / "m.safetensors"), "--to", "safetensors", "--step", "1"
    )
    assert res.returncode == 0, res.stderr
    from safetensors.torch import load_file as load_safetensors

    assert torch.equal(load_safetensors(str(tmp_path / "m.safetensors"))["model.w"], torch.arange(64.0) + 1)


# -- fencing between jobs, at the level of the index ---------------------------------------------


def test_a_takeover_aborts_a_stalled_attempt_or_adopts_its_commit(bed: S3Bed, bucket: str) -> None:
    url = f"s3://{bucket}/fence"
    first, second, third = (ObjectStoreRoot(open_storage(url)) for _ in range(3))
    first.after_lease()
    # job 1 recorded its intent for step 6 and created the commit object, then stalled before indexing it
    six = first._record_intent(CheckpointName(6), one_rank_manifest(6, 1, "a" * 32))
    assert first.storage.create_exclusive(first.commit_path(CheckpointName(6)), six)
    second.after_lease()  # takes over: adopts step 6 (committed: nothing is lost)
    assert second.committed() == [CheckpointName(6)]
    # job 2 recorded its intent for step 7 and stalled before creating the commit object
    seven = second._record_intent(CheckpointName(7), one_rank_manifest(7, 1, "b" * 32))
    third.after_lease()  # takes over: a tombstone takes step 7's commit key
    assert third.committed() == [CheckpointName(6)]
    assert third.taken_versions(7) == [1]  # taken: a new save of step 7 uses version 2
    with pytest.raises(LeaseLostError, match="aborted this attempt"):
        second._publish(CheckpointName(7), seven)  # resumed: its conditional create finds the tombstone
    with pytest.raises(LeaseLostError, match="another job took over"):
        first.commit("", one_rank_manifest(8, 1, "c" * 32), lambda: None)
    with pytest.raises(LeaseLostError):
        second.retire(second.dir(CheckpointName(6)))
    assert third.committed() == [CheckpointName(6)]


# -- several processes ---------------------------------------------------------------------------


def _results(job: JobResult) -> list[dict[str, object]]:
    return job_results(job)


def _run(
    bed: S3Bed, *args: str, nproc: int = 4, timeout: float = 240, extra: dict[str, str] | None = None
) -> JobResult:
    env = {**bed.env(), "PYTHONPATH": f"{REPO / 'src'}:{REPO}", **(extra or {})}
    return run_job(WORKER, args, nnodes=1, nproc_per_node=nproc, env=env, timeout=timeout)


def test_four_ranks_save_and_load_on_s3(bed: S3Bed, bucket: str) -> None:
    bad = bed.proxy.stats.bad_digest
    job = _run(
        bed, "roundtrip", "--root", f"s3://{bucket}/four", "--count", "2", "--keep-last", "1", "--elems", str(3 << 19)
    )  # 6 MiB per rank: multipart uploads (5 MiB parts), parallel ranged reads
    assert job.ok, job.output()
    done = [r for r in _results(job) if "loaded" in r]
    assert len(done) == 4 and all(r["loaded"] == 1 and r["steps"] == [1] for r in done)
    assert bed.proxy.stats.bad_digest == bad and bed.open_uploads(bucket) == []


@pytest.mark.slow
def test_faults_5xx_slow_and_a_rank_killed_mid_upload(bed: S3Bed, bucket: str) -> None:
    """5 % of requests answered 500/503 (before or after applying them) or slow; then rank 1 is killed in the
    middle of its upload: nothing corrupt is committed, nothing committed is lost, and the next save aborts
    the orphaned multipart uploads."""
    root = f"s3://{bucket}/faults"
    elems = str(3 << 19)  # 6 MiB per rank: two parts
    bed.proxy.fail_rate = 0.05
    job = _run(bed, "roundtrip", "--root", root, "--count", "2", "--elems", elems, nproc=2)
    assert job.ok, job.output()
    assert bed.proxy.stats.injected > 0
    bed.proxy.fail_rate = 0.0
    killed = _run(
        bed,
        "roundtrip",
        "--root",
        root,
        "--count",
        "1",
        "--elems",
        elems,
        "--fault-step",
        "2",
        "--fault",
        "mid_write:1:kill",
        nproc=2,
        timeout=180,
    )
    assert not killed.ok
    assert bed.open_uploads(bucket), "the killed rank should have left a multipart upload open"
    with Checkpointer(root, read_only=True) as ck:
        assert ck.steps() == [0, 1]
    resumed = _run(bed, "roundtrip", "--root", root, "--count", "1", "--elems", elems, nproc=2)
    assert resumed.ok, resumed.output()
    assert {r["resumed_from"] for r in _results(resumed) if "loaded" in r} == {1}
    # The killed job's data uploads are aborted by the next save. An upload of the probe of
    # conditional multipart completion that the killed job had in flight when it opened the root is
    # not: garbage collection looks for open uploads under the attempts only (a known gap, in
    # docs/protocol.md "Retention": a bucket lifecycle rule that aborts incomplete uploads removes it).
    assert [k for k in bed.open_uploads(bucket) if "/.ckptguard/probe/" not in k] == []
    ver = _cli(bed, "verify", root, "--json")
    assert ver.returncode == 0, ver.stdout
    assert [c["step"] for c in json.loads(ver.stdout)["checked"]] == [0, 1, 2]


def _wait_stopped(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process_state(pid) == "T":
            return
        time.sleep(0.2)
    raise AssertionError(f"rank 0 (pid {pid}) did not stop itself")


def test_a_job_stalled_mid_commit_loses_to_the_job_that_took_over(bed: S3Bed, bucket: str, tmp_path: Path) -> None:
    """Job A stops (SIGSTOP) just before committing step 2; its lease expires; job B takes over, saves steps 2
    and 3; A is resumed. Exactly one commit of step 2 wins (B's), A raises, latest stays at 3."""
    root = f"s3://{bucket}/stall"
    holder: dict[str, JobResult] = {}

    def run_a() -> None:
        holder["a"] = _run(
            bed,
            "stall",
            "--root",
            root,
            "--scratch",
            str(tmp_path),
            "--lease-ttl",
            "2",
            "--tag",
            "1",
            nproc=2,
            timeout=300,
        )

    a = threading.Thread(target=run_a)
    a.start()
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "pid-0").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        pid = int((tmp_path / "pid-0").read_text())
        _wait_stopped(pid, 120)
        b = _run(bed, "takeover", "--root", root, "--tag", "2", nproc=2)
        assert b.ok, b.output()
        assert {tuple(r["steps"]) for r in _results(b) if "steps" in r} == {(1, 2, 3)}  # type: ignore[arg-type]
    finally:
        with_pid = tmp_path / "pid-0"
        if with_pid.exists():
            os.kill(int(with_pid.read_text()), signal.SIGCONT)
        a.join(timeout=300)
    job_a = holder["a"]
    errors = [r for r in _results(job_a) if "error" in r]
    assert len(errors) == 2 and {r["error_class"] for r in errors} == {"LeaseLostError"}, job_a.output()
    # Fenced either by the lease check before its commit (the lease is another job's, or gone) or,
    # past that check, by the tombstone the new holder put at its commit key.
    assert all(
        "aborted this attempt" in str(r["error"]) or "no longer holds the lease" in str(r["error"]) for r in errors
    ), errors
    assert not [r for r in _results(job_a) if r.get("saved") == 2]
    with Checkpointer(root, read_only=True) as ck:
        assert ck.steps() == [1, 2, 3]
        out = {"model": {"w": torch.zeros(256, 256), "b": torch.zeros(256)}, "step": -1, "tag": -1}
        assert ck.load(out, step=2, strict=False) == 2 and out["tag"] == 2  # B's step 2, not A's
    latest = json.loads(bed.client().get_object(Bucket=bucket, Key="stall/latest")["Body"].read())
    assert latest["step"] == 3
    index = json.loads(bed.client().get_object(Bucket=bucket, Key=f"stall/{INDEX}")["Body"].read())
    step2 = [(e["version"], e["state"]) for e in index["entries"] if e["step"] == 2]
    assert sorted(step2) == [(1, "aborted"), (2, "committed")]


# -- fencing, unknown outcomes, exit: each stalled, lost or refused request made real by a proxy ---------


def _via(proxy: FaultProxy) -> dict[str, object]:
    """storage_options for a job whose requests go through its own proxy (faults hit it alone)."""
    return {**SMALL, "endpoint_url": proxy.url}


def _small(step: int) -> dict[str, object]:
    return _state(step, 50_000)


def _same(out: dict[str, object], want: dict[str, object]) -> bool:
    return all(torch.equal(out[k], want[k]) for k in ("w", "b")) and out["step"] == want["step"]  # type: ignore[arg-type]


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["result"] = fn()
        except BaseException as e:
            outcome["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, outcome


def _until(cond: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _stall_after(proxy: FaultProxy, first: Callable[[Request], bool]) -> threading.Event:
    """Freeze every request of the proxy's job from the one after the first request ``first`` picks
    (which goes through): the job stalls right there, its lease renewals included."""
    seen = threading.Event()

    def match(r: Request) -> bool:
        if seen.is_set():
            return True
        if first(r):
            seen.set()
        return False

    proxy.add_rule(match, "freeze")
    return seen


def test_a_writer_stalled_after_its_commit_landed_deletes_nothing_of_the_step_adopted(bed: S3Bed, bucket: str) -> None:
    """Job A's commit object of step 2 lands, then A stalls; its lease expires, job B takes over, adopts
    step 2 and loads it. A resumes: it is fenced, and its failure path deletes nothing of step 2."""
    root = f"s3://{bucket}/adopt"
    a_proxy = bed.add_proxy()
    a = Checkpointer(root, lease_ttl_s=2, storage_options=_via(a_proxy))
    a.save(1, _small(1))
    landed = _stall_after(a_proxy, lambda r: r.method == "PUT" and r.path.endswith("step-00000002/MANIFEST.json"))
    t, outcome = _in_thread(lambda: a.save(2, _small(2)))
    _until(lambda: landed.is_set() and a_proxy.frozen > 0)
    with Checkpointer(root, lease_ttl_s=30, lease_wait_s=30, storage_options=SMALL) as b:
        assert b.steps() == [1, 2]
        out = _empty(50_000)
        assert b.load(out) == 2 and _same(out, _small(2))
        a_proxy.thaw()
        t.join(60)
        assert isinstance(outcome.get("error"), LeaseLostError), outcome
        assert "is committed" in str(outcome["error"])
        out = _empty(50_000)
        assert b.load(out, step=2) == 2 and _same(out, _small(2))
        b.save(3, _small(3))
        assert b.steps() == [1, 2, 3]
    a.close()
    with Checkpointer(root, read_only=True) as ck:
        out = _empty(50_000)
        assert ck.load(out, step=2) == 2 and _same(out, _small(2))


def test_a_commit_whose_reply_was_lost_is_settled_never_failed(bed: S3Bed, bucket: str) -> None:
    """The commit lands and its answers are lost (botocore's retries' too): the save reads its commit back
    and succeeds. When it cannot even read back, it raises CommitOutcomeUnknownError, keeps the data,
    and the next save settles it: committed, and whole."""
    root = f"s3://{bucket}/lost"
    proxy = bed.add_proxy()
    with Checkpointer(root, storage_options=_via(proxy)) as ck:
        ck.save(1, _small(1))
        proxy.add_rule(
            lambda r: r.method == "PUT" and r.path.endswith("step-00000002/MANIFEST.json"), "drop", times=3
        )  # S3Options.control_max_attempts: every try of the commit
        ck.save(2, _small(2))
        assert ck.steps() == [1, 2]
        out = _empty(50_000)
        assert ck.load(out) == 2 and _same(out, _small(2))
        proxy.add_rule(lambda r: r.path.endswith("step-00000003/MANIFEST.json"), "drop")  # and no read-back
        with pytest.raises(CommitOutcomeUnknownError, match="may or may not be committed"):
            ck.save(3, _small(3))
        proxy.clear_rules()
        ck.save(4, _small(4))
        assert ck.steps() == [1, 2, 3, 4]
        out = _empty(50_000)
        assert ck.load(out, step=3) == 3 and _same(out, _small(3))


def test_a_fenced_job_moves_no_tag_after_a_conflict(bed: S3Bed, bucket: str) -> None:
    """Job A's swap of tag `best` stalls in flight; its lease expires; job B moves the tag. A's swap lands
    late and fails (412): A must find it lost the root, not swap again over B's tag."""
    root = f"s3://{bucket}/tags"
    a_proxy = bed.add_proxy()
    a = Checkpointer(root, lease_ttl_s=2, storage_options=_via(a_proxy))
    for step in (1, 2, 3):
        a.save(step, _small(step))
    a.tag("best", 1)
    swapping = threading.Event()

    def match(r: Request) -> bool:
        if r.method == "PUT" and r.path.endswith("/tags/best"):
            swapping.set()
        return swapping.is_set()

    a_proxy.add_rule(match, "freeze")
    t, outcome = _in_thread(lambda: a.tag("best", 3))
    _until(lambda: swapping.is_set() and a_proxy.frozen > 0)
    with Checkpointer(root, lease_ttl_s=30, lease_wait_s=30, storage_options=SMALL) as b:
        assert b.tag("best", 2) == 1
        a_proxy.thaw()
        t.join(60)
        assert isinstance(outcome.get("error"), LeaseLostError), outcome
        assert b.tags(refresh=True) == {"best": 2}
    a.close()


def test_a_reader_whose_step_is_deleted_and_saved_again_loads_the_new_one(bed: S3Bed, bucket: str) -> None:
    """The reader holds step 2's manifest when the writer deletes step 2 and saves it again (as the
    Lightning plugin does): the reader loads the new step 2, it does not call it corrupt."""
    root = f"s3://{bucket}/resave"
    r_proxy = bed.add_proxy()
    with Checkpointer(root, storage_options=SMALL) as w:
        w.save(1, _small(1))
        w.save(2, _small(2))
        with Checkpointer(root, read_only=True, storage_options=_via(r_proxy)) as reader:
            r_proxy.add_rule(lambda r: "/.ckptguard/staging/step-00000002." in r.path, "freeze")
            out = _empty(50_000)
            t, outcome = _in_thread(lambda: reader.load(out))
            _until(lambda: r_proxy.frozen > 0)
            w.delete(2)
            again = _small(2)
            again["w"] = again["w"] * 3  # type: ignore[operator]
            w.save(2, again)
            r_proxy.thaw()
            t.join(60)
            assert outcome.get("result") == 2, outcome
            assert _same(out, again)


_EXIT_SCRIPT = """
import atexit, json, sys, time, torch, ckptguard
marks = {}
atexit.register(lambda: print("RELEASED " + json.dumps(time.monotonic() - marks["end"]), flush=True))
ck = ckptguard.Checkpointer(sys.argv[1], lease_ttl_s=30, storage_options={"endpoint_url": sys.argv[2]})
ck.save(1, {"w": torch.zeros(8)})
print("READY", flush=True)
sys.stdin.readline()
marks["end"] = time.monotonic()
"""


def test_exit_releases_the_lease_within_5_s_whatever_the_endpoint_does(bed: S3Bed, bucket: str) -> None:
    """Processes that exit without close() while the endpoint does not answer (frozen) or refuses
    connections are done with the lease's release within 5 s (and gone soon after), print no traceback,
    and leave the lease to expire."""
    src = str(Path(ckptguard.__file__).resolve().parent.parent)  # the ckptguard this test imports
    env = {**os.environ, **bed.env(), "PYTHONPATH": src}
    jobs: dict[str, tuple[FaultProxy, subprocess.Popen[str]]] = {}
    try:
        for endpoint in ("frozen", "refusing"):
            proxy = bed.add_proxy()
            jobs[endpoint] = (
                proxy,
                subprocess.Popen(
                    [sys.executable, "-c", _EXIT_SCRIPT, f"s3://{bucket}/{endpoint}", proxy.url],
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
        for _, p in jobs.values():
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line.startswith("READY"), line + p.communicate(timeout=60)[1]
        frozen, refusing = jobs["frozen"][0], jobs["refusing"][0]
        frozen.add_rule(lambda r: True, "freeze")
        refusing.add_rule(lambda r: True, "reset")  # connections in the pool are closed,
        refusing.stop()  # and new ones refused
        for _, p in jobs.values():
            assert p.stdin is not None
            p.stdin.write("\n")
            p.stdin.flush()
        asked = time.monotonic()
        for endpoint, (_, p) in jobs.items():
            out, err = p.communicate(timeout=60)  # before the bound: many minutes (frozen), over one (refusing)
            gone = time.monotonic() - asked  # the process itself, interpreter finalization included
            released = [float(x.split()[1]) for x in out.splitlines() if x.startswith("RELEASED")]
            # The release is bounded at 5 s; the process's exit adds interpreter finalization (torch, boto3),
            # which a loaded 2-core machine stretches to several seconds: bounded well below the minutes
            # an unbounded release took.
            assert released and released[0] <= 5.0 and gone <= 15.0, (endpoint, gone, out, err)
            assert "Traceback" not in err and "Exception ignored" not in err, (endpoint, err)
            assert p.returncode == 0, (endpoint, err)
            lease = bed.client().get_object(Bucket=bucket, Key=f"{endpoint}/.ckptguard/lease.json")["Body"].read()
            assert json.loads(lease)["ttl_s"] == 30  # left in place: it expires
    finally:
        for proxy, p in jobs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
            proxy.thaw()


@pytest.mark.long
def test_under_a_quarter_of_requests_failing_nothing_committed_is_lost_or_torn(bed: S3Bed) -> None:
    """A quarter of all requests answered 500/503, half of those after landing: saves, retention and
    loads either succeed or fail with an error that names what is intact, and afterwards, with the
    faults gone, what is committed loads whole, verifies, and the next save works. A net for the class
    of stop 29's CI failure (a retry that landed, misread); the probe's own case is pinned by
    test_the_probe_of_conditional_writes_survives_each_of_its_requests_failing_once."""
    failed = 0
    for round_ in range(8):
        bucket = bed.make_bucket(f"ckpt-{uuid.uuid4().hex[:12]}")
        root = f"s3://{bucket}/quarter"
        _Clients.ready.clear()
        bed.reset_faults()
        bed.proxy.fail_rate, bed.proxy.kinds = 0.25, ["500-after", "500", "503", "500-after"]
        try:
            with Checkpointer(root, keep_last=2, storage_options=SMALL) as ck:
                for step in range(1, 5):
                    ck.save(step, _state(step, n=3 << 19))
                out = _empty(n=3 << 19)
                ck.load(out)
                assert _same(out, _state(4, n=3 << 19))
        except CheckpointError as e:
            failed += 1
            # only the retries running out on an injected fault, never a wrong verdict from a retry
            assert "after retries" in str(e) and re.search(
                r"\((InternalError|SlowDown|50[03]):|ConnectionClosedError", str(e)
            ), e
        bed.reset_faults()
        _Clients.ready.clear()
        with Checkpointer(root, storage_options=SMALL) as ck:
            steps = ck.steps()
            if steps:
                out = _empty(n=3 << 19)
                got = ck.load(out)
                assert got in steps and _same(out, _state(got, n=3 << 19)), (round_, got, steps)
            ck.save(10, _state(10, n=3 << 19))
        assert _cli(bed, "verify", root).returncode == 0, round_
    _Clients.ready.clear()
    assert failed < 8  # some rounds get through: the faults are survivable, not a wall
