"""The once-per-bucket probe of a store reached through a custom endpoint: does it honour conditional
writes? A store that ignores If-None-Match or If-Match would let two writers both win a commit, so it
is refused (UnsupportedStorageError) instead of used unsafely."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Collection
from typing import Any

from ckptguard.errors import CheckpointError, UnsupportedStorageError
from ckptguard.storage.s3.client import (
    _PRECONDITION_CODES,
    Bucket,
    _code,
    _crc32c_b64,
)

log = logging.getLogger("ckptguard")


def probe_conditional_writes(storage: Bucket) -> BaseException | None:
    """Does this store honour If-None-Match and If-Match on PUT and If-None-Match on completion?

    Each verdict is read from the object afterwards, not from the status code: a request that landed
    and was answered 5xx is retried by botocore, and the retry's 412 (or NoSuchUpload) then answers
    our own first try, not the condition."""
    key = storage.key(storage.path(".ckptguard", "probe", f"conditional-{uuid.uuid4().hex}"))
    url = storage.url(key)
    c = storage.client
    failures: list[str] = []

    def call(fn: Callable[[], Any]) -> Any:
        return storage._call("probe conditional writes", url, fn)

    def attempt(fn: Callable[[], Any], refusals: Collection[str] = _PRECONDITION_CODES) -> None:
        try:
            fn()
        except Exception as e:
            if _code(e) not in refusals:
                raise storage._translate(e, "probe conditional writes", url) from e

    def holds() -> bytes:
        return bytes(call(lambda: c.get_object(Bucket=storage.bucket, Key=key)["Body"].read()))

    def put(body: bytes, **condition: str) -> Any:
        return c.put_object(Bucket=storage.bucket, Key=key, Body=body, ChecksumCRC32C=_crc32c_b64(body), **condition)  # type: ignore[arg-type]

    try:
        call(lambda: put(b"1"))  # a fresh key: unconditional, so that a retry of it is harmless
        attempt(lambda: put(b"2", IfNoneMatch="*"))
        if (expected := holds()) != b"1":
            failures.append("PutObject with If-None-Match: * replaced an existing object")
        attempt(lambda: put(b"3", IfMatch='"00000000000000000000000000000000"'))
        if (now := holds()) != expected:
            failures.append("PutObject with a stale If-Match replaced the object")
        expected = now
        upload = call(lambda: c.create_multipart_upload(Bucket=storage.bucket, Key=key, ChecksumAlgorithm="CRC32C"))[
            "UploadId"
        ]
        part = call(
            lambda: c.upload_part(
                Bucket=storage.bucket,
                Key=key,
                UploadId=upload,
                PartNumber=1,
                Body=b"4",
                ChecksumCRC32C=_crc32c_b64(b"4"),
            )
        )
        attempt(
            lambda: c.complete_multipart_upload(
                Bucket=storage.bucket,
                Key=key,
                UploadId=upload,
                IfNoneMatch="*",
                MultipartUpload={
                    "Parts": [{"PartNumber": 1, "ETag": part["ETag"], "ChecksumCRC32C": _crc32c_b64(b"4")}]
                },
            ),
            refusals={*_PRECONDITION_CODES, "NoSuchUpload"},
        )
        if holds() != expected:
            failures.append("CompleteMultipartUpload with If-None-Match: * replaced an existing object")
    except CheckpointError as e:
        return e
    finally:
        _remove_probe(storage, key)
    if failures:
        return UnsupportedStorageError(
            f"the object store at {storage.endpoint} ignores conditional writes ({'; '.join(failures)}): "
            "ckptguard cannot commit checkpoints there without races, and refuses to use it. Use a store "
            "that supports If-None-Match and If-Match (AWS S3, recent MinIO, Ceph RGW >= 19, ...).",
            path=storage.root,
        )
    return None


def _remove_probe(storage: Bucket, key: str) -> None:
    """The probe object and every upload to it (a create retried after a 5xx that landed leaves two).
    Garbage at worst if this fails: a later save's clean-up removes it. (Not the backend's
    ``uploads_in_progress``/``abort_upload``: those wait for ``ensure_ready``, which runs this probe.)"""
    c = storage.client
    try:
        listed = c.list_multipart_uploads(Bucket=storage.bucket, Prefix=key)
        for upload in listed.get("Uploads", []):
            if upload.get("Key") == key:
                with contextlib.suppress(Exception):
                    c.abort_multipart_upload(Bucket=storage.bucket, Key=key, UploadId=upload["UploadId"])
    except Exception as e:
        log.debug("ckptguard: could not list the uploads to the probe object %s: %s", key, e)
    try:  # whether or not the uploads could be listed
        c.delete_object(Bucket=storage.bucket, Key=key)
    except Exception as e:
        log.debug("ckptguard: could not delete the probe object %s: %s", key, e)
