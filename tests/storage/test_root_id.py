"""The root's identity (``.ckptguard/root-id``, what integrations bind pointer files to): created once by
compare-and-swap under the lease's fence like every control record, one identity however many create it
at once, and never by a job that no longer holds the root (the S3 side: tests/test_s3.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ckptguard import Checkpointer, CheckpointError, CorruptCheckpointError, LeaseLostError
from ckptguard.protocol import rootid
from ckptguard.storage import open_storage
from ckptguard.verify import ROOT_ID_RECORD, read_root_id


def test_the_identity_is_created_once_and_every_job_reads_the_same(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ident = ck.root_id()
        assert len(ident) == 32 and ck.root_id() == ident
    assert (root / ROOT_ID_RECORD).read_bytes() == ident.encode() + b"\n"
    assert read_root_id(str(root)) == ident
    with Checkpointer(root) as ck:
        assert ck.root_id() == ident
    with Checkpointer(root, read_only=True) as ck:
        assert ck.root_id() == ident


def test_a_read_only_job_creates_no_identity(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(1, {"x": 1})
    with Checkpointer(root, read_only=True) as ck, pytest.raises(CheckpointError, match="read_only"):
        ck.root_id()
    assert read_root_id(str(root)) is None and not (root / ROOT_ID_RECORD).exists()


def test_creators_at_once_end_with_one_identity(tmp_path: Path) -> None:
    """Eight creators released together, each with its own storage: every one gets the identity that
    landed (the record was created by a write that did not check for one already there)."""
    root = tmp_path / "ck"
    with Checkpointer(root):
        pass
    start, got = threading.Barrier(8), []

    def create() -> None:
        storage = open_storage(str(root))
        start.wait()
        got.append(rootid.create(storage, fence=lambda: None))

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1
    assert read_root_id(str(root)) == got[0]


def test_a_creator_that_lost_the_root_creates_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Checkpointer(root):
        pass

    def lost() -> None:
        raise LeaseLostError("another job holds the root now")

    with pytest.raises(LeaseLostError):
        rootid.create(open_storage(str(root)), fence=lost)
    assert read_root_id(str(root)) is None
    assert not list((root / ".ckptguard").glob("root-id*")), "a staged record was left behind"


def test_a_damaged_record_is_refused_not_replaced(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        (root / ROOT_ID_RECORD).write_bytes(b"not an identity\n")
        with pytest.raises(CorruptCheckpointError, match="root identity"):
            ck.root_id()
    assert (root / ROOT_ID_RECORD).read_bytes() == b"not an identity\n"
