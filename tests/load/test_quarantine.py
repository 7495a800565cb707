"""A committed checkpoint a load found corrupt is quarantined: recorded in the root by the writing
job, skipped by loads, `ls`, `verify` and the resume answer without being read again, and replaced by
the job's next save of its step (no StepExistsError). Each test failed before the quarantine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from ckptguard import Checkpointer, CorruptCheckpointError, ReplicatedValueError, StepExistsError
from ckptguard.protocol.decisions import Committed, LeaderView, PlanReport, decide_plan, retention
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import Manifest
from ckptguard.protocol.quarantine import QuarantineRecord
from ckptguard.resume import resume_info
from ckptguard.verify import list_root

from tests.support.jobs import REPO, run_job
from tests.support.results import job_results

QUARANTINE = Path(".ckptguard") / "quarantine"


def _state(step: int) -> dict[str, object]:
    return {"w": torch.arange(4000.0) + step, "b": torch.full((300,), float(step)), "step": step}


def _empty() -> dict[str, object]:
    return {"w": torch.zeros(4000), "b": torch.zeros(300), "step": -1}


def _flip(root: Path, step: int, fqn: str = "w", version: int = 1) -> None:
    """One bit of item ``fqn`` of a committed step flipped: sizes stay right, so only a read finds it."""
    step_dir = root / (f"step-{step:08d}" + (f".v{version}" if version > 1 else ""))
    mpath = step_dir / "MANIFEST.json"
    (row,) = [r for r in Manifest.from_json(mpath.read_bytes(), str(mpath)).items if r.fqn == fqn]
    path = step_dir / row.file
    data = bytearray(path.read_bytes())
    data[row.offset + row.length - 1] ^= 0x01
    path.write_bytes(bytes(data))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def _corrupt_newest(root: Path) -> None:
    """Steps 1 and 2 committed, step 2's bytes rotted."""
    with Checkpointer(root) as ck:
        ck.save(1, _state(1))
        ck.save(2, _state(2))
    _flip(root, 2)


def test_a_loop_restarted_after_a_fallback_saves_the_corrupt_step_again(tmp_path: Path) -> None:
    """The training loop of examples/ddp_train.py: load the newest, then save every step from there.
    After the fallback past corrupt step 2, save(2) replaces it (it raised StepExistsError)."""
    root = tmp_path / "ck"
    _corrupt_newest(root)
    with Checkpointer(root) as ck:
        out = _empty()
        with pytest.warns(UserWarning, match=r"step 2 .* is corrupt"):
            assert ck.load(out) == 1
        assert out["step"] == 1
        ck.save(2, _state(20))  # no StepExistsError, no overwrite=True
        out = _empty()
        assert ck.load(out) == 2 and out["step"] == 20 and torch.equal(out["w"], _state(20)["w"])  # type: ignore[arg-type]
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000001", "step-00000002.v2"]
    assert not list((root / QUARANTINE).glob("*.json")), "the replaced step's record is left behind"


def test_a_quarantined_step_is_skipped_without_reading_it_again(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _corrupt_newest(root)
    with Checkpointer(root) as ck, pytest.warns(UserWarning, match="corrupt"):
        assert ck.load(_empty()) == 1
    assert [p.name for p in (root / QUARANTINE).glob("*.json")] == ["step-00000002.json"]
    (root / "step-00000002" / "data").rename(tmp_path / "moved")  # reading it now would be another failure
    with Checkpointer(root) as ck:
        for call in (ck.load, lambda _: ck.read()):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                assert call(_empty()) is not None
            (said,) = [str(w.message) for w in seen]  # said once, and not "falling back": step 2 is not read
            assert "step 2" in said and "quarantined" in said and "without reading it again" in said, said
            assert "checksum" in said  # the reason recorded, not what a read now would find (no data dir)
        with pytest.raises(CorruptCheckpointError):
            ck.load(_empty(), step=2)  # asked for by number: read, and refused


def test_latest_is_the_step_load_resumes_and_quarantined_names_the_skipped_ones(tmp_path: Path) -> None:
    """``latest()`` said it is the step ``load()`` resumes, but gave the quarantined step 2 that every load
    skips; ``steps()`` lists committed steps, quarantined ones included, and ``quarantined()`` names them."""
    root = tmp_path / "ck"
    _corrupt_newest(root)
    with Checkpointer(root) as ck:
        assert ck.latest() == 2 and ck.quarantined() == {}  # not found corrupt yet: nothing has read it
        with pytest.warns(UserWarning, match="corrupt"):
            assert ck.load(_empty()) == 1
        assert ck.steps() == [1, 2] and ck.latest() == 1 and list(ck.quarantined()) == [2]
    with Checkpointer(root, read_only=True) as ck:  # a new job: from the root's record alone
        assert ck.steps() == [1, 2] and ck.latest() == 1
        assert "checksum" in ck.quarantined()[2]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert ck.load(_empty()) == ck.latest()
    with Checkpointer(root) as ck:
        ck.save(2, _state(22))  # replaces the quarantined step: it is the one load resumes again
        assert ck.latest() == 2 and ck.quarantined() == {}
        assert ck.latest(refresh=True) == 2 and ck.quarantined(refresh=True) == {}


def test_a_read_only_job_that_fell_back_does_not_name_the_corrupt_step_latest(tmp_path: Path) -> None:
    """A read_only job records nothing in the root, but its own load skipped step 2: so does latest()."""
    root = tmp_path / "ck"
    _corrupt_newest(root)
    with Checkpointer(root, read_only=True) as ck:
        with pytest.warns(UserWarning, match="corrupt"):
            assert ck.read() is not None
        assert ck.latest() == 1 and list(ck.quarantined()) == [2]


def test_ls_verify_and_the_resume_answer_skip_a_quarantined_step(tmp_path: Path) -> None:
    """`ckptguard run --checkpoints` (quick checks: sizes only) named corrupt step 2 as the one to resume
    from while the job's own load had just said it is corrupt."""
    root = tmp_path / "ck"
    _corrupt_newest(root)
    assert resume_info(str(root)).step == 2  # the quick checks alone cannot see a flipped bit
    with Checkpointer(root) as ck, pytest.warns(UserWarning, match="corrupt"):
        ck.load(_empty())
    info = resume_info(str(root))
    assert info.step == 1 and [u.step for u in info.unsafe] == [2]
    assert "quarantined" in info.unsafe[0].reason and "checksum" in info.unsafe[0].reason
    listing = list_root(str(root))
    assert [(c.step, c.quarantined is not None) for c in listing.checkpoints] == [(1, False), (2, True)]
    ls = _cli("ls", str(root), "--json")
    assert ls.returncode == 0, ls.stderr
    assert [c["quarantined"] is not None for c in json.loads(ls.stdout)["checkpoints"]] == [False, True]
    assert "quarantined" in _cli("ls", str(root)).stdout
    (root / "step-00000002" / "data").rename(tmp_path / "moved")  # verify must not read it again
    ver = _cli("verify", str(root), "--json")
    assert ver.returncode == 1, ver.stdout + ver.stderr
    doc = json.loads(ver.stdout)
    assert doc["safe_to_resume"] == 1
    assert [(r["step"], r["intact"], [p["kind"] for p in r["problems"]]) for r in doc["checked"]] == [
        (1, True, []),
        (2, False, ["quarantined"]),
    ]
    assert doc["checked"][1]["problems"][0]["path"] == str(root / "step-00000002")  # absolute, as every problem
    assert "step 2: quarantined: step-00000002: a load found it corrupt" in _cli("verify", str(root)).stdout


@pytest.mark.parametrize("reason", [b"caf\xe9", b"\xed\xa0\x80", b"\xff"])
def test_a_record_that_is_not_utf8_quarantines_nothing(tmp_path: Path, reason: bytes) -> None:
    """A record that is JSON of the schema but not UTF-8 does not parse: it quarantines nothing, and
    every reader says so instead of raising UnicodeDecodeError."""
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(1, _state(1))
        ck.save(2, _state(2))
    (root / QUARANTINE).mkdir(parents=True)
    (root / QUARANTINE / "step-00000002.json").write_bytes(
        b'{"format":"ckptguard-quarantine","step":2,"version":1,"seq":2,"reason":"' + reason + b'","at":1.0}'
    )
    for command in ("ls", "verify"):
        out = _cli(command, str(root))
        assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(_cli("verify", str(root), "--json").stdout)["safe_to_resume"] == 2
    assert resume_info(str(root)).step == 2
    assert list_root(str(root)).checkpoints[-1].quarantined is None
    for read_only in (True, False):
        with Checkpointer(root, read_only=read_only) as ck:
            assert ck.load(_empty()) == 2


def test_a_read_only_job_skips_but_records_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _corrupt_newest(root)
    with Checkpointer(root, read_only=True) as ck, pytest.warns(UserWarning, match="corrupt"):
        assert ck.load(_empty()) == 1
    assert not (root / QUARANTINE).exists()
    assert list_root(str(root)).checkpoints[-1].quarantined is None


def test_retention_drops_a_quarantined_step_first_and_delete_removes_its_record(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _corrupt_newest(root)
    with Checkpointer(root, keep_last=2) as ck:
        with pytest.warns(UserWarning, match="corrupt"):
            assert ck.load(_empty()) == 1
        ck.save(3, _state(3))  # keep_last=2 of {1, 2 (quarantined), 3}: the corrupt one goes, 1 stays
        assert ck.steps() == [1, 3]
        assert not list((root / QUARANTINE).glob("*.json"))
        _flip(root, 3)
        with pytest.warns(UserWarning, match="corrupt"):
            assert ck.load(_empty()) == 1
        assert [p.name for p in (root / QUARANTINE).glob("*.json")] == ["step-00000003.json"]
        ck.delete(3)
        assert not list((root / QUARANTINE).glob("*.json"))
        assert ck.steps() == [1]


def test_a_record_of_an_earlier_commit_of_the_step_quarantines_nothing(tmp_path: Path) -> None:
    """The record names the commit (its sequence number): the step deleted and saved anew is not it."""
    root = tmp_path / "ck"
    _corrupt_newest(root)
    with Checkpointer(root) as ck, pytest.warns(UserWarning, match="corrupt"):
        ck.load(_empty())
    record = next((root / QUARANTINE).glob("*.json")).read_bytes()
    with Checkpointer(root) as ck:
        ck.delete(2)
        ck.save(2, _state(22))
    (root / QUARANTINE / "step-00000002.json").write_bytes(record)  # a stale record put back
    with Checkpointer(root) as ck, warnings.catch_warnings():
        warnings.simplefilter("error")
        out = _empty()
        assert ck.load(out) == 2 and out["step"] == 22


def test_every_step_quarantined_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(1, _state(1))
    _flip(root, 1)
    with Checkpointer(root) as ck:
        with pytest.raises(CorruptCheckpointError), pytest.warns(UserWarning, match="corrupt"):
            ck.load(_empty())
        with pytest.raises(CorruptCheckpointError, match="quarantined"):
            ck.load(_empty())
        ck.save(1, _state(10))
        out = _empty()
        assert ck.load(out) == 1 and out["step"] == 10


def test_quarantine_on_an_object_store(tmp_path: Path) -> None:
    """The record on s3:// (moto on loopback): written under the index epoch's fence, skipped by the next
    load and by the resume answer, replaced by the next save of the step, gone with it."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto")
    from tests.support.beds.s3 import s3_bed_in_env

    with s3_bed_in_env(seed=37) as bed:
        bucket = bed.make_bucket("quarantine")
        root = f"s3://{bucket}/run"
        with Checkpointer(root) as ck:
            ck.save(1, _state(1))
            ck.save(2, _state(2))
        m = Manifest.from_json(
            bed.client().get_object(Bucket=bucket, Key="run/step-00000002/MANIFEST.json")["Body"].read(), "m"
        )
        (row,) = [r for r in m.items if r.fqn == "w"]
        victim = f"run/.ckptguard/staging/step-00000002.{m.attempt}/{row.file}"
        blob = bytearray(bed.client().get_object(Bucket=bucket, Key=victim)["Body"].read())
        blob[row.offset + row.length - 1] ^= 0x01
        bed.client().put_object(Bucket=bucket, Key=victim, Body=bytes(blob))
        assert resume_info(root).step == 2  # sizes only: the flipped bit is not seen
        with Checkpointer(root, read_only=True) as ck, pytest.warns(UserWarning, match="corrupt"):
            assert ck.load(_empty()) == 1
        assert not [k for k in bed.keys(bucket, "run/") if "/quarantine/" in k]  # a reader records nothing
        with Checkpointer(root) as ck:
            with pytest.warns(UserWarning, match="corrupt"):
                assert ck.load(_empty()) == 1
            assert "run/.ckptguard/quarantine/step-00000002.json" in bed.keys(bucket, "run/")
            assert resume_info(root).step == 1
            with pytest.warns(UserWarning, match="quarantined"):
                assert ck.load(_empty()) == 1
            ck.save(2, _state(20))
            out = _empty()
            assert ck.load(out) == 2 and out["step"] == 20
        assert not [k for k in bed.keys(bucket, "run/") if "/quarantine/" in k]
        assert resume_info(root).step == 2


def test_every_storage_domain_records_the_quarantine_and_the_resave_replaces_it(tmp_path: Path) -> None:
    """Two nodes with node-local roots (two storage domains), one process each (torchrun, gloo): step 2
    is corrupt in node 1's root only. Every rank falls back to step 1, each leader records step 2 in its
    own root, and save(2) then replaces it in both."""
    roots = [tmp_path / "node0", tmp_path / "node1"]
    job = run_job(
        REPO / "tests" / "workers" / "quarantine_job.py",
        nnodes=2,
        nproc_per_node=1,
        node_env=[{"CKPT_ROOT": str(r)} for r in roots],
        timeout=240,
    )
    assert job.ok, job.output()
    results = job_results(job)
    fallback = [r for r in results if r["phase"] == "fallback"]
    resaved = [r for r in results if r["phase"] == "resaved"]
    assert len(fallback) == len(resaved) == 2, job.output()
    for r in fallback:
        assert r["loaded"] == 1 and r["step"] == 1 and r["records"] == ["step-00000002.json"], r
    assert any("step 2" in w and "corrupt" in w for w in next(r for r in fallback if r["rank"] == 0)["warned"])
    for r in resaved:
        assert r["loaded"] == 2 and r["step"] == 20 and r["records"] == [], r
        assert r["dirs"] == ["step-00000001", "step-00000002.v2"], r


# -- rank 0's decisions (pure functions) -------------------------------------------------------------


def _record(step: int, version: int, seq: int | None) -> QuarantineRecord:
    return QuarantineRecord(format="ckptguard-quarantine", step=step, version=version, seq=seq, reason="checksum")


def test_retention_ranks_quarantined_steps_below_every_other_and_keep_every_keeps_none() -> None:
    listing = {s: Committed(1, s) for s in (1, 2, 3, 4)}
    assert retention(listing, 4, 2, None, frozenset({3})) == [1, 3]  # 2 and 4 load: they are the two kept
    assert retention(listing, 4, 3, None, frozenset({3})) == [3]
    assert retention(listing, 4, 2, 2, frozenset({2})) == [1, 2]  # keep_every=2 keeps 4 only
    assert retention(listing, 4, 5, None, frozenset({2})) == []  # room for all: the corrupt one stays


def test_a_save_replaces_a_step_only_while_its_record_names_the_current_commit() -> None:
    listing = {1: {1: 1}, 2: {1: 2}}

    def plan(records: dict, step: int = 2) -> object:
        view = LeaderView([1], listing, 2, records)
        return decide_plan("/r", step, False, [PlanReport([], view, (step, False))])

    assert plan({CheckpointName(2): _record(2, 1, 2)}).version == 2  # type: ignore[attr-defined]
    for stale in (_record(2, 1, 1), _record(2, 2, 2)):  # an earlier commit, another version
        with pytest.raises(StepExistsError):
            plan({stale.name: stale})
    assert plan({CheckpointName(2): _record(2, 1, 2)}, step=3).quarantined == frozenset({2})  # type: ignore[attr-defined]


def test_ranks_saving_different_steps_are_refused_naming_the_rank() -> None:
    reports = [
        PlanReport([], LeaderView([], {}, 0), (5, False)),
        PlanReport([], None, (5, False)),
        PlanReport([], None, (6, False)),
    ]
    with pytest.raises(ReplicatedValueError, match=r"step=6, overwrite=False on rank 2"):
        decide_plan("/r", 5, False, reports)
