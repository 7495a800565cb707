"""The once-per-bucket probe of a store reached through a custom endpoint: does it honour conditional
writes? A store that ignores If-None-Match or If-Match would let two writers both win a commit, so it
is refused (UnsupportedStorageError) instead of used unsafely."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from ckptguard.errors import CheckpointError, UnsupportedStorageError
from ckptguard.storage.s3.client import (
    _PRECONDITION_CODES,
    Bucket,
    _code,
    _crc32c_b64,
    _is_client_error,
)

log = logging.getLogger("ckptguard")


def probe_conditional_writes(storage: Bucket) -> BaseException | None:
    """Does this store honour If-None-Match and If-Match on PUT and If-None-Match on completion?"""
    key = storage.key(storage.path(".ckptguard", "probe", f"conditional-{uuid.uuid4().hex}"))
    c = storage.client
    failures: list[str] = []

    def refused(fn: Callable[[], Any]) -> bool:
        try:
            fn()
        except Exception as e:
            if _code(e) in _PRECONDITION_CODES:
                return True
            raise storage._translate(e, "probe conditional writes", storage.url(key)) from e
        return False

    def put(body: bytes, **condition: str) -> Any:
        return c.put_object(Bucket=storage.bucket, Key=key, Body=body, ChecksumCRC32C=_crc32c_b64(body),
                            **condition)  # type: ignore[arg-type]

    try:
        storage._call("probe conditional writes", storage.url(key), lambda: put(b"1", IfNoneMatch="*"))
        if not refused(lambda: put(b"2", IfNoneMatch="*")):
            failures.append("PutObject with If-None-Match: * replaced an existing object")
        if not refused(lambda: put(b"3", IfMatch='"00000000000000000000000000000000"')):
            failures.append("PutObject with a stale If-Match replaced the object")
        upload = c.create_multipart_upload(Bucket=storage.bucket, Key=key, ChecksumAlgorithm="CRC32C")["UploadId"]
        try:
            part = c.upload_part(Bucket=storage.bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"4",
                                 ChecksumCRC32C=_crc32c_b64(b"4"))
            if not refused(lambda: c.complete_multipart_upload(
                    Bucket=storage.bucket, Key=key, UploadId=upload, IfNoneMatch="*",
                    MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"],
                                                "ChecksumCRC32C": _crc32c_b64(b"4")}]})):
                failures.append("CompleteMultipartUpload with If-None-Match: * replaced an existing object")
        finally:
            try:
                c.abort_multipart_upload(Bucket=storage.bucket, Key=key, UploadId=upload)
            except Exception as e:
                if not _is_client_error(e):
                    raise
    except CheckpointError as e:
        return e
    finally:
        try:
            c.delete_object(Bucket=storage.bucket, Key=key)
        except Exception as e:  # the probe object is garbage at worst; a later save's clean-up removes it
            log.debug("ckptguard: could not delete the probe object %s: %s", key, e)
    if failures:
        return UnsupportedStorageError(
            f"the object store at {storage.endpoint} ignores conditional writes ({'; '.join(failures)}): "
            "ckptguard cannot commit checkpoints there without races, and refuses to use it. Use a store "
            "that supports If-None-Match and If-Match (AWS S3, recent MinIO, Ceph RGW >= 19, ...).",
            path=storage.root)
    return None
