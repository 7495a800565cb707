"""S3's and botocore's errors as the ones ckptguard's callers handle: OSErrors and typed CheckpointErrors.

A missing bucket, denied access and a bucket in another region each get their own error naming the
bucket and what to do; a missing object is a FileNotFoundError; anything else that survived
botocore's retries is an OSError (EIO).
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any

from ckptguard.errors import BucketNotFoundError, StoragePermissionError, WrongRegionError
from ckptguard.storage.s3.client import (
    _MISSING_CODES,
    _PERMISSION_CODES,
    _REGION_CODES,
    _code,
    _is_client_error,
    _status,
)

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client
else:
    S3Client = Any


def translate_error(err: Exception, what: str, path: str, bucket: str, client: S3Client) -> BaseException:
    """The error to raise for ``err``, raised by a request to ``what`` on ``path`` in ``bucket``."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    if isinstance(err, NoCredentialsError):
        return StoragePermissionError(
            f"no AWS credentials found to {what} {path}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or run where an instance role applies",
            path=path,
        )
    if isinstance(err, ClientError):
        code = _code(err)
        message = str(err.response.get("Error", {}).get("Message", "")) or str(err)
        if code == "NoSuchBucket":
            return BucketNotFoundError(
                f"bucket {bucket} does not exist at {client.meta.endpoint_url} (while trying to {what} {path}). "
                "Create it, or check the bucket name and endpoint_url.",
                path=path,
            )
        if code in _PERMISSION_CODES:
            return StoragePermissionError(
                f"access denied to {what} {path} ({code}: {message}). The credentials in use need "
                "s3:GetObject, s3:PutObject, s3:DeleteObject, s3:ListBucket and s3:AbortMultipartUpload "
                "on this bucket and prefix.",
                path=path,
            )
        if code in _REGION_CODES:
            return region_error(err, what, path, bucket, client)
        if code in _MISSING_CODES:
            return FileNotFoundError(errno.ENOENT, f"no such object ({what})", path)
        return OSError(errno.EIO, f"S3 refused to {what} ({code}: {message}) after retries", path)
    if isinstance(err, BotoCoreError | OSError):
        return OSError(errno.EIO, f"S3 request to {what} failed after retries: {type(err).__name__}: {err}", path)
    return err


def region_error(err: Exception, what: str, path: str, bucket: str, client: S3Client) -> WrongRegionError:
    """The bucket is in another region than the client's: which one, where S3 says it."""
    headers = getattr(err, "response", {}).get("ResponseMetadata", {}).get("HTTPHeaders", {})
    region = headers.get("x-amz-bucket-region") or getattr(err, "response", {}).get("Error", {}).get("Region")
    where = f"it is in region {region}" if region else "it is in another region"
    return WrongRegionError(
        f"bucket {bucket} is not in region {client.meta.region_name} ({where}; while trying to "
        f"{what} {path}). Set AWS_REGION or storage_options={{'region_name': ...}} to the bucket's region.",
        path=path,
    )


def bucket_error(err: Exception, bucket: str, root: str, client: S3Client) -> BaseException:
    """The error to raise for ``err``, raised by ``HeadBucket`` on ``bucket`` (the root ``root``)."""
    endpoint = client.meta.endpoint_url
    status = _status(err) if _is_client_error(err) else None
    if status == 404:
        return BucketNotFoundError(
            f"bucket {bucket} does not exist at {endpoint}. Create it, or check the bucket name and endpoint_url.",
            path=root,
        )
    if status == 403:
        return StoragePermissionError(
            f"access denied to bucket {bucket} at {endpoint}: the credentials in use may not "
            "list or read it (s3:ListBucket).",
            path=root,
        )
    if status in (301, 307, 400) and _is_client_error(err):
        headers = err.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})  # type: ignore[attr-defined]
        if status != 400 or headers.get("x-amz-bucket-region"):
            return region_error(err, "reach the bucket", root, bucket, client)
    return translate_error(err, "reach the bucket", root, bucket, client)
