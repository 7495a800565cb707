"""S3 and S3-compatible object stores, through boto3.

What the protocol needs maps onto S3 as follows:

- **exclusive create**: ``PutObject`` / ``CompleteMultipartUpload`` with
  ``If-None-Match: *`` (one of several writers gets 200, the others 412);
- **compare-and-swap**: ``PutObject`` with ``If-Match: <ETag read earlier>``;
- **streamed writes**: parts of ``part_size`` bytes uploaded in parallel, each
  with its CRC32C in ``x-amz-checksum-crc32c`` so the store checks it on
  arrival, then completed with ``If-None-Match: *``;
- **ranged reads**: ``GetObject`` with ``Range``, chunks in parallel, read
  straight into the caller's buffers;
- there are no directories: a "directory" is a key prefix, ``sync_dir`` and
  ``makedirs`` do nothing, and there is no rename (``publish`` is refused: the
  commit on object stores is a conditional create, see
  :mod:`ckptguard.protocol.objstore`).

Retries: botocore's "standard" mode retries throttling, 5xx and dropped
connections with jittered exponential back-off. A conditional write retried
after a 5xx can get 412 because its own first try landed: on 412 we read the
object back and count it as ours when it carries what we wrote (the bytes of a
small object, a per-stream token in the metadata of a data object).

A store reached through a custom endpoint is probed once per process and
bucket: a store that ignores ``If-None-Match`` or ``If-Match`` (on PUT or on
multipart completion) is refused with :class:`UnsupportedStorageError`, never
used unsafely.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import functools
import logging
import posixpath
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar, cast

import crc32c

from ckptguard.errors import (
    BucketNotFoundError,
    CheckpointError,
    CorruptCheckpointError,
    NotVisibleError,
    StorageError,
    StoragePermissionError,
    UnsupportedStorageError,
    WrongRegionError,
)
from ckptguard.storage.base import MAX_SMALL_OBJECT_BYTES

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef, ObjectIdentifierTypeDef
else:
    S3Client = CompletedPartTypeDef = ObjectIdentifierTypeDef = Any

log = logging.getLogger("ckptguard")

_WRITER_META = "ckptguard-writer"  # x-amz-meta-ckptguard-writer: which stream created a data object
_MIN_PART = 5 << 20  # S3's smallest part (all but the last)
_MAX_PARTS = 10_000
_PERMISSION_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
                     "AccountProblem", "InvalidToken", "ExpiredToken", "403"}
_REGION_CODES = {"PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException",
                 "301", "IncorrectEndpoint"}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
_PRECONDITION_CODES = {"PreconditionFailed", "412"}
_CONFLICT_CODES = {"ConditionalRequestConflict", "409", "OperationAborted"}


@dataclass(frozen=True)
class S3Options:
    """How to reach the store: ``Checkpointer("s3://bucket/prefix", storage_options={...})``.

    Unset values come from the usual AWS settings: ``AWS_ENDPOINT_URL`` (or
    ``AWS_ENDPOINT_URL_S3``), ``AWS_REGION``/``AWS_DEFAULT_REGION``,
    ``AWS_PROFILE``, the credential chain (env, shared files, instance role).
    """

    endpoint_url: str | None = None  # an S3-compatible store (MinIO, Ceph, R2, a local server)
    region_name: str | None = None
    profile_name: str | None = None
    part_size: int = 16 << 20  # bytes per multipart part (objects below it take one PutObject)
    max_concurrency: int = 16  # parts and ranges in flight per process
    max_attempts: int = 10  # per request, by botocore's standard retry mode (throttling, 5xx, resets)
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    check_conditional_writes: bool | None = None  # None: probe stores reached through a custom endpoint

    @staticmethod
    def from_mapping(options: dict[str, Any] | None) -> S3Options:
        if not options:
            return S3Options()
        known = {f.name for f in fields(S3Options)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown storage_options for s3:// {unknown}; known: {sorted(known)}")
        opts = replace(S3Options(), **options)
        if opts.part_size < _MIN_PART:
            raise ValueError(f"storage_options part_size must be >= {_MIN_PART} (S3's smallest part)")
        if opts.max_concurrency < 1 or opts.max_attempts < 1:
            raise ValueError("storage_options max_concurrency and max_attempts must be >= 1")
        return opts


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix without slashes at either end) of ``s3://bucket/prefix``."""
    if not url.lower().startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url}")
    rest = url[5:]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise UnsupportedStorageError(f"{url}: no bucket name (expected s3://BUCKET/PREFIX)", path=url)
    return bucket, prefix.strip("/")


def _body(data: bytearray) -> bytes:
    """botocore sends a bytearray as it is (its stubs only say bytes): no copy into a bytes object."""
    return cast(bytes, data)


def _crc32c_b64(data: bytes | bytearray | memoryview) -> str:
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


def _code(err: Exception) -> str:
    response = getattr(err, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code or (str(status) if status else "")


def _status(err: Exception) -> int | None:
    response = getattr(err, "response", None) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status else None


def _is_client_error(err: BaseException) -> bool:
    from botocore.exceptions import ClientError

    return isinstance(err, ClientError)


class _Clients:
    """One boto3 client per process and configuration (clients are thread-safe; sessions are not)."""

    lock = threading.Lock()
    cache: ClassVar[dict[tuple[Any, ...], S3Client]] = {}
    ready: ClassVar[dict[tuple[str, str], BaseException | None]] = {}  # (endpoint, bucket) -> probe outcome

    @classmethod
    def get(cls, opts: S3Options) -> S3Client:
        key = (opts.endpoint_url, opts.region_name, opts.profile_name, opts.max_concurrency, opts.max_attempts,
               opts.connect_timeout_s, opts.read_timeout_s)
        with cls.lock:
            client = cls.cache.get(key)
            if client is None:
                import boto3
                from botocore.config import Config

                session = boto3.session.Session(profile_name=opts.profile_name)
                config = Config(
                    retries={"mode": "standard", "max_attempts": opts.max_attempts},
                    max_pool_connections=max(10, 2 * opts.max_concurrency + 8),
                    connect_timeout=opts.connect_timeout_s,
                    read_timeout=opts.read_timeout_s,
                    # We send CRC32C ourselves (computed once per part) and check every byte we read
                    # against the manifest: no second checksum by botocore on either side.
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
                client = session.client("s3", endpoint_url=opts.endpoint_url, region_name=opts.region_name,
                                        config=config)
                cls.cache[key] = client
            return client


class S3Storage:
    """A checkpoint root ``s3://bucket/prefix`` (see :class:`~ckptguard.storage.base.StorageBackend`)."""

    has_directories = False

    def __init__(self, url: str, options: S3Options | dict[str, Any] | None = None) -> None:
        self.options = options if isinstance(options, S3Options) else S3Options.from_mapping(options)
        self.bucket, self.prefix = parse_url(url)
        self.root = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self._base = f"s3://{self.bucket}/"
        self._client: S3Client | None = None
        self._ready = False
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.options.max_concurrency + 2)

    # -- plumbing ------------------------------------------------------------------------
    @property
    def client(self) -> S3Client:
        if self._client is None:
            self._client = _Clients.get(self.options)
        return self._client

    @property
    def endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)

    def pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.options.max_concurrency, thread_name_prefix="ckptguard-s3")
            return self._pool

    def key(self, path: str) -> str:
        if path == self._base.rstrip("/"):
            return ""
        if not path.startswith(self._base):
            raise ValueError(f"{path} is not in bucket {self.bucket}")
        return path[len(self._base):]

    def url(self, key: str) -> str:
        return self._base + key

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def call(self, what: str, path: str, fn: Callable[[], Any]) -> Any:
        """Run one request (botocore retries it); its errors as OSErrors or typed CheckpointErrors."""
        self.ensure_ready()
        return self._call(what, path, fn)

    def _call(self, what: str, path: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:
            raise self._translate(e, what, path) from e

    def _translate(self, err: Exception, what: str, path: str) -> BaseException:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        if isinstance(err, NoCredentialsError):
            return StoragePermissionError(
                f"no AWS credentials found to {what} {path}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, or run where an instance role applies", path=path)
        if isinstance(err, ClientError):
            code = _code(err)
            message = str(err.response.get("Error", {}).get("Message", "")) or str(err)
            if code == "NoSuchBucket":
                return BucketNotFoundError(
                    f"bucket {self.bucket} does not exist at {self.endpoint} (while trying to {what} {path}). "
                    "Create it, or check the bucket name and endpoint_url.", path=path)
            if code in _PERMISSION_CODES:
                return StoragePermissionError(
                    f"access denied to {what} {path} ({code}: {message}). The credentials in use need "
                    "s3:GetObject, s3:PutObject, s3:DeleteObject, s3:ListBucket and s3:AbortMultipartUpload "
                    "on this bucket and prefix.", path=path)
            if code in _REGION_CODES:
                return self._region_error(err, what, path)
            if code in _MISSING_CODES:
                return FileNotFoundError(errno.ENOENT, f"no such object ({what})", path)
            return OSError(errno.EIO, f"S3 refused to {what} ({code}: {message}) after retries", path)
        if isinstance(err, BotoCoreError | OSError):
            return OSError(errno.EIO, f"S3 request to {what} failed after retries: {type(err).__name__}: {err}",
                           path)
        return err

    def _region_error(self, err: Exception, what: str, path: str) -> WrongRegionError:
        headers = getattr(err, "response", {}).get("ResponseMetadata", {}).get("HTTPHeaders", {})
        region = headers.get("x-amz-bucket-region") or getattr(err, "response", {}).get("Error", {}).get("Region")
        where = f"it is in region {region}" if region else "it is in another region"
        return WrongRegionError(
            f"bucket {self.bucket} is not in region {self.client.meta.region_name} ({where}; while trying to "
            f"{what} {path}). Set AWS_REGION or storage_options={{'region_name': ...}} to the bucket's region.",
            path=path)

    def ensure_ready(self) -> None:
        """Once per instance: the bucket is reachable; once per process and store: conditional writes work."""
        if self._ready:
            return
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as e:
            status = _status(e) if _is_client_error(e) else None
            if status == 404:
                raise BucketNotFoundError(
                    f"bucket {self.bucket} does not exist at {self.endpoint}. Create it, or check the bucket "
                    "name and endpoint_url.", path=self.root) from e
            if status == 403:
                raise StoragePermissionError(
                    f"access denied to bucket {self.bucket} at {self.endpoint}: the credentials in use may not "
                    "list or read it (s3:ListBucket).", path=self.root) from e
            if status in (301, 307, 400) and _is_client_error(e):
                headers = e.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})  # type: ignore[attr-defined]
                if status != 400 or headers.get("x-amz-bucket-region"):
                    raise self._region_error(e, "reach the bucket", self.root) from e
            raise self._translate(e, "reach the bucket", self.root) from e
        if self._should_probe():
            probe_key = (self.endpoint, self.bucket)
            with _Clients.lock:
                known = probe_key in _Clients.ready
                outcome = _Clients.ready.get(probe_key)
            if not known:
                outcome = self._probe_conditional_writes()
                with _Clients.lock:
                    _Clients.ready[probe_key] = outcome
            if outcome is not None:
                raise outcome
        self._ready = True

    def _should_probe(self) -> bool:
        if self.options.check_conditional_writes is not None:
            return self.options.check_conditional_writes
        host = self.endpoint.split("://", 1)[-1].split("/", 1)[0].split(":", 1)[0]
        return not host.endswith(".amazonaws.com")

    def _probe_conditional_writes(self) -> BaseException | None:
        """Does this store honour If-None-Match and If-Match on PUT and If-None-Match on completion?"""
        key = self.key(self.path(".ckptguard", "probe", f"conditional-{uuid.uuid4().hex}"))
        c = self.client
        failures: list[str] = []

        def refused(fn: Callable[[], Any]) -> bool:
            try:
                fn()
            except Exception as e:
                if _code(e) in _PRECONDITION_CODES:
                    return True
                raise self._translate(e, "probe conditional writes", self.url(key)) from e
            return False

        def put(body: bytes, **condition: str) -> Any:
            return c.put_object(Bucket=self.bucket, Key=key, Body=body, ChecksumCRC32C=_crc32c_b64(body),
                                **condition)  # type: ignore[arg-type]

        try:
            self._call("probe conditional writes", self.url(key), lambda: put(b"1", IfNoneMatch="*"))
            if not refused(lambda: put(b"2", IfNoneMatch="*")):
                failures.append("PutObject with If-None-Match: * replaced an existing object")
            if not refused(lambda: put(b"3", IfMatch='"00000000000000000000000000000000"')):
                failures.append("PutObject with a stale If-Match replaced the object")
            upload = c.create_multipart_upload(Bucket=self.bucket, Key=key, ChecksumAlgorithm="CRC32C")["UploadId"]
            try:
                part = c.upload_part(Bucket=self.bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"4",
                                     ChecksumCRC32C=_crc32c_b64(b"4"))
                if not refused(lambda: c.complete_multipart_upload(
                        Bucket=self.bucket, Key=key, UploadId=upload, IfNoneMatch="*",
                        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"],
                                                    "ChecksumCRC32C": _crc32c_b64(b"4")}]})):
                    failures.append("CompleteMultipartUpload with If-None-Match: * replaced an existing object")
            finally:
                try:
                    c.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
                except Exception as e:
                    if not _is_client_error(e):
                        raise
        except CheckpointError as e:
            return e
        finally:
            try:
                c.delete_object(Bucket=self.bucket, Key=key)
            except Exception as e:  # the probe object is garbage at worst; a later save's clean-up removes it
                log.debug("ckptguard: could not delete the probe object %s: %s", key, e)
        if failures:
            return UnsupportedStorageError(
                f"the object store at {self.endpoint} ignores conditional writes ({'; '.join(failures)}): "
                "ckptguard cannot commit checkpoints there without races, and refuses to use it. Use a store "
                "that supports If-None-Match and If-Match (AWS S3, recent MinIO, Ceph RGW >= 19, ...).",
                path=self.root)
        return None

    # -- namespace -----------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        self.ensure_ready()  # no directories; but a missing bucket is best reported at once

    def make_dir_durable(self, path: str) -> None:
        self.ensure_ready()

    def _list(self, prefix: str, delimiter: bool) -> Iterator[dict[str, Any]]:
        """Pages of ListObjectsV2 (used to find names and garbage, never to decide a commit)."""
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            if delimiter:
                kwargs["Delimiter"] = "/"
            if token:
                kwargs["ContinuationToken"] = token
            page = self.call("list", self.url(prefix), functools.partial(self.client.list_objects_v2, **kwargs))
            yield page
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def _dir_prefix(self, path: str) -> str:
        key = self.key(path)
        return f"{key}/" if key else ""

    def listdir(self, path: str) -> list[str]:
        prefix = self._dir_prefix(path)
        names: set[str] = set()
        for page in self._list(prefix, delimiter=True):
            for p in page.get("CommonPrefixes", []):
                names.add(p["Prefix"][len(prefix):].rstrip("/"))
            for o in page.get("Contents", []):
                name = o["Key"][len(prefix):]
                if name:
                    names.add(name)
        return sorted(names)

    def sizes_in(self, directory: str) -> dict[str, int]:
        prefix = self._dir_prefix(directory)
        out: dict[str, int] = {}
        for page in self._list(prefix, delimiter=True):
            for o in page.get("Contents", []):
                name = o["Key"][len(prefix):]
                if name:
                    out[name] = int(o["Size"])
        return out

    def _head(self, path: str) -> dict[str, Any] | None:
        key = self.key(path)
        if not key:
            return None
        try:
            head: dict[str, Any] = self.call("look up", path, lambda: self.client.head_object(Bucket=self.bucket,
                                                                                                Key=key))
        except FileNotFoundError:
            return None
        return head

    def exists(self, path: str) -> bool:
        if self._head(path) is not None:
            return True
        prefix = self._dir_prefix(path)
        page = next(self._list(prefix, delimiter=True))
        return bool(page.get("Contents") or page.get("CommonPrefixes"))

    def size(self, path: str) -> int | None:
        head = self._head(path)
        return int(head["ContentLength"]) if head is not None else None

    def mtime(self, path: str) -> float | None:
        head = self._head(path)
        if head is not None:
            return float(head["LastModified"].timestamp())
        newest: float | None = None  # a "directory": its newest object
        for page in self._list(self._dir_prefix(path), delimiter=False):
            for o in page.get("Contents", []):
                t = float(o["LastModified"].timestamp())
                newest = t if newest is None else max(newest, t)
        return newest

    def uploads_in_progress(self, path: str) -> list[tuple[str, str]]:
        """(path, upload id) of every multipart upload not completed nor aborted under ``path``."""
        prefix = self._dir_prefix(path)
        out: list[tuple[str, str]] = []
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        while True:
            page = self.call("list multipart uploads", self.url(prefix),
                             functools.partial(self.client.list_multipart_uploads, **kwargs))
            out.extend((self.url(u["Key"]), u["UploadId"]) for u in page.get("Uploads", []))
            if not page.get("IsTruncated"):
                return out
            kwargs["KeyMarker"] = page.get("NextKeyMarker", "")
            kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    def abort_upload(self, path: str, upload_id: str) -> None:
        try:
            self.call("abort a multipart upload", path, lambda: self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=self.key(path), UploadId=upload_id))
        except FileNotFoundError:  # NoSuchUpload: completed or aborted meanwhile
            pass
        except OSError as e:
            if "NoSuchUpload" not in str(e):
                raise

    def remove_tree(self, path: str) -> None:
        """Every object under ``path`` (and ``path`` itself), and the multipart uploads left there."""
        for upload_path, upload_id in self.uploads_in_progress(path):
            self.abort_upload(upload_path, upload_id)
        keys = [self.key(path)] if self.key(path) else []
        for page in self._list(self._dir_prefix(path), delimiter=False):
            keys.extend(o["Key"] for o in page.get("Contents", []))
        for i in range(0, len(keys), 1000):
            batch: list[ObjectIdentifierTypeDef] = [{"Key": k} for k in keys[i:i + 1000]]
            out = self.call("delete objects", path, functools.partial(
                self.client.delete_objects, Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}))
            errors = [e for e in out.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                raise OSError(errno.EIO, f"S3 could not delete {len(errors)} object(s), e.g. {errors[0]}", path)

    def sync_dir(self, path: str) -> None:
        pass  # no directory entries: an object is durable once its PUT or completion returned

    # -- small objects ---------------------------------------------------------------------
    def _get(self, path: str, limit: int) -> tuple[bytes, str] | None:
        key = self.key(path)
        try:
            resp = self.call("read", path, lambda: self.client.get_object(Bucket=self.bucket, Key=key))
        except FileNotFoundError:
            return None
        length = int(resp.get("ContentLength", 0))
        body = resp["Body"]
        try:
            if length > limit:
                raise CorruptCheckpointError(
                    f"{path} is {length:,} bytes, more than the {limit:,} a control object may have: "
                    "refusing to read it", path=path)
            data = self._call("read", path, body.read)
        finally:
            body.close()
        if len(data) != length:
            raise OSError(errno.EIO, f"S3 returned {len(data)} of {length} bytes", path)
        return bytes(data), str(resp["ETag"])

    def read_bytes(self, path: str, limit: int = MAX_SMALL_OBJECT_BYTES) -> bytes:
        for attempt in range(3):
            try:
                got = self._get(path, limit)
                break
            except OSError as e:  # a connection dropped mid-body: botocore does not retry those
                if isinstance(e, FileNotFoundError) or attempt == 2:
                    raise
                time.sleep(0.1 * 2 ** attempt)
        if got is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", path)
        return got[0]

    def read_versioned(self, path: str) -> tuple[bytes, str] | None:
        for attempt in range(3):
            try:
                return self._get(path, MAX_SMALL_OBJECT_BYTES)
            except OSError as e:
                if isinstance(e, FileNotFoundError) or attempt == 2:
                    raise
                time.sleep(0.1 * 2 ** attempt)
        raise AssertionError("unreachable")

    def _conditional_put(self, path: str, data: bytes, **condition: str) -> bool:
        """PUT under a condition; False if the store refused it (412), True if it (or our own earlier
        try, retried after a 5xx) landed: on 412 the object is read back and must hold ``data``."""
        key = self.key(path)
        body = bytearray(data)
        checksum = _crc32c_b64(body)
        for attempt in range(8):
            try:
                self.call("write", path, lambda: self.client.put_object(
                    Bucket=self.bucket, Key=key, Body=_body(body), ChecksumCRC32C=checksum, **condition))  # type: ignore[arg-type]
                return True
            except OSError as e:
                cause = e.__cause__
                code = _code(cause) if isinstance(cause, Exception) else ""
                if code in _PRECONDITION_CODES:
                    now = self.read_versioned(path)
                    return now is not None and now[0] == data
                if code in _CONFLICT_CODES and attempt < 7:  # a concurrent conditional write: ask again
                    time.sleep(0.05 * 2 ** attempt)
                    continue
                if code in _MISSING_CODES and "IfMatch" in condition:
                    return False  # If-Match on an object that is gone
                raise
        raise AssertionError("unreachable")

    def create_exclusive(self, path: str, data: bytes) -> bool:
        return self._conditional_put(path, data, IfNoneMatch="*")

    def replace(self, path: str, data: bytes) -> None:
        stream = S3WriteStream(self, path, exclusive=False)
        try:
            stream.write([memoryview(data)])
            stream.sync()
        finally:
            stream.close()

    def compare_and_swap(self, path: str, data: bytes, token: str | None) -> bool:
        if token is None:
            return self.create_exclusive(path, data)
        return self._conditional_put(path, data, IfMatch=token)

    def delete(self, path: str) -> None:
        key = self.key(path)
        with contextlib.suppress(FileNotFoundError):
            self.call("delete", path, lambda: self.client.delete_object(Bucket=self.bucket, Key=key))

    def delete_if_version(self, path: str, token: str) -> bool:
        """DELETE with If-Match on the ETag read: a writer that replaced the object since keeps it.
        (The version is checked first too, so a store that ignores If-Match on DELETE narrows the
        race to the one request.)"""
        current = self.read_versioned(path)
        if current is None or current[1] != token:
            return False
        key = self.key(path)
        try:
            self.call("delete", path, lambda: self.client.delete_object(Bucket=self.bucket, Key=key, IfMatch=token))
        except FileNotFoundError:
            return False
        except OSError as e:
            cause = e.__cause__
            if isinstance(cause, Exception) and _code(cause) in _PRECONDITION_CODES:
                return False
            raise
        return True

    def publish(self, src: str, dst: str) -> None:
        raise UnsupportedStorageError(
            f"object stores have no rename: {src} cannot be published as {dst}. Checkpoints on object stores "
            "are committed by a conditional create of their manifest (ckptguard.protocol.objstore).", path=dst)

    # -- data ------------------------------------------------------------------------------
    def open_new(self, path: str) -> S3WriteStream:
        self.ensure_ready()
        return S3WriteStream(self, path, exclusive=True)

    def open_read(self, path: str) -> S3ReadHandle:
        head = self._head(path)
        if head is None:
            raise CorruptCheckpointError(f"{path} is missing: the checkpoint is incomplete", path=path)
        return S3ReadHandle(self, path, int(head["ContentLength"]))

    def wait_visible(self, path: str, size: int | None = None, timeout: float = 30.0) -> None:
        """S3 reads its own and others' writes at once; only a size is worth waiting for."""
        if size is None:
            return  # a "directory" is a prefix: nothing to see until objects are written under it
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            seen = self.size(path)
            if seen == size:
                return
            if time.monotonic() >= deadline:
                state = "missing" if seen is None else f"{seen} bytes, expected {size}"
                raise NotVisibleError(f"{path} is not there with the right size after {timeout:.0f} s ({state})",
                                      path=path)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def prefetch(self, directory: str, prefix: str) -> Callable[[], None]:
        return _nothing

    def free_bytes(self, path: str) -> int | None:
        return None

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _nothing() -> None:
    pass


class S3WriteStream:
    """A new object written in order: buffered into parts, uploaded in parallel, completed by ``sync``.

    Bytes are copied into part buffers (callers may reuse their buffers once
    ``write`` returns). At most ``max_concurrency + 2`` parts per process are in
    memory at once: ``write`` waits for a free slot.
    """

    def __init__(self, storage: S3Storage, path: str, exclusive: bool) -> None:
        self.storage = storage
        self.path = path
        self.key = storage.key(path)
        self.exclusive = exclusive
        self.token = uuid.uuid4().hex
        self.part_size = storage.options.part_size
        self._buf: bytearray | None = None
        self._fill = 0
        self._slot_held = False
        self._upload: str | None = None
        self._parts: list[Future[CompletedPartTypeDef]] = []
        self._done = False
        self._size = 0

    def write(self, views: Sequence[memoryview]) -> None:
        if self._done:
            raise ValueError(f"{self.path}: write after sync")
        for v in views:
            mv = v.cast("B") if v.format != "B" or v.ndim != 1 else v
            pos = 0
            while pos < len(mv):
                if self._buf is None:
                    self._take_slot()
                    self._buf = bytearray(self.part_size)
                    self._fill = 0
                n = min(len(mv) - pos, len(self._buf) - self._fill)
                self._buf[self._fill:self._fill + n] = mv[pos:pos + n]
                self._fill += n
                pos += n
                self._size += n
                if self._fill == len(self._buf):
                    self._ship(final=False)

    def _take_slot(self) -> None:
        self.storage._slots.acquire()
        self._slot_held = True

    def _release_slot(self) -> None:
        self.storage._slots.release()

    def _ship(self, final: bool) -> None:
        assert self._buf is not None
        data = self._buf if self._fill == len(self._buf) else self._buf[:self._fill]
        self._buf = None
        self._slot_held = False
        if self._upload is None:
            self._upload = self._start_upload()
        number = len(self._parts) + 1
        if number > _MAX_PARTS:
            raise OSError(errno.EFBIG, f"more than {_MAX_PARTS} parts: raise storage_options part_size", self.path)
        self._parts.append(self.storage.pool().submit(self._upload_part, number, data))
        if not final and len(self._parts) in (1000, 3000, 6000):
            self.part_size *= 2  # stay under S3's 10,000 parts whatever the object's size

    def _start_upload(self) -> str:
        s = self.storage
        resp = s.call("start an upload", self.path, lambda: s.client.create_multipart_upload(
            Bucket=s.bucket, Key=self.key, ChecksumAlgorithm="CRC32C", Metadata={_WRITER_META: self.token}))
        return str(resp["UploadId"])

    def _upload_part(self, number: int, data: bytearray) -> CompletedPartTypeDef:
        s = self.storage
        try:
            checksum = _crc32c_b64(data)
            upload = self._upload
            assert upload is not None
            resp = s.call("upload a part", self.path, lambda: s.client.upload_part(
                Bucket=s.bucket, Key=self.key, UploadId=upload, PartNumber=number, Body=_body(data),
                ChecksumCRC32C=checksum))
            return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC32C": checksum}
        finally:
            self._release_slot()

    def sync(self) -> None:
        """Complete the object (exclusively: FileExistsError if another writer created it first)."""
        if self._done:
            return
        s = self.storage
        if self._upload is None:
            data = self._buf[:self._fill] if self._buf is not None else bytearray()
            if self._buf is not None:
                self._buf = None
                self._release_slot()
            self._put_whole(data)
        else:
            if self._buf is not None and self._fill:
                self._ship(final=True)
            elif self._buf is not None:
                self._buf = None
                self._release_slot()
            parts = [f.result() for f in self._parts]
            self._complete(parts)
        self._done = True
        log.debug("ckptguard: wrote %s (%d bytes) to %s", self.path, self._size, s.endpoint)

    def _put_whole(self, data: bytearray) -> None:
        s = self.storage
        cond = {"IfNoneMatch": "*"} if self.exclusive else {}
        checksum = _crc32c_b64(data)
        try:
            s.call("write", self.path, lambda: s.client.put_object(
                Bucket=s.bucket, Key=self.key, Body=_body(data), ChecksumCRC32C=checksum,
                Metadata={_WRITER_META: self.token}, **cond))  # type: ignore[arg-type]
        except OSError as e:
            self._settle_refusal(e)

    def _complete(self, parts: list[CompletedPartTypeDef]) -> None:
        s = self.storage
        cond = {"IfNoneMatch": "*"} if self.exclusive else {}
        upload = self._upload
        assert upload is not None
        try:
            s.call("complete an upload", self.path, lambda: s.client.complete_multipart_upload(
                Bucket=s.bucket, Key=self.key, UploadId=upload,
                MultipartUpload={"Parts": parts}, **cond))  # type: ignore[arg-type]
        except OSError as e:
            self._settle_refusal(e)
        self._upload = None

    def _settle_refusal(self, err: OSError) -> None:
        """412 (or NoSuchUpload): ours if the object carries this stream's token (a retry after a 5xx
        whose first try landed); otherwise another writer created the object first."""
        cause = err.__cause__
        code = _code(cause) if isinstance(cause, Exception) else ""
        if code not in _PRECONDITION_CODES and code != "NoSuchUpload":
            raise err
        head = self.storage._head(self.path)
        if head is not None and head.get("Metadata", {}).get(_WRITER_META) == self.token:
            return
        if self._upload is not None:
            self.storage.abort_upload(self.path, self._upload)
            self._upload = None
        raise FileExistsError(errno.EEXIST, "another writer created this object first", self.path)

    def close(self) -> None:
        """Without a completed ``sync`` the object is dropped (its upload aborted)."""
        if self._buf is not None:
            self._buf = None
            self._release_slot()
        if not self._done:
            for f in self._parts:  # dropping the upload anyway: its parts' errors do not matter
                with contextlib.suppress(BaseException):
                    f.result()
            self._parts = []
            if self._upload is not None:
                try:
                    self.storage.abort_upload(self.path, self._upload)
                except (OSError, CheckpointError) as e:  # left for a later save's clean-up
                    log.warning("ckptguard: could not abort the upload of %s: %s", self.path, e)
                self._upload = None
            self._done = True


class S3ReadHandle:
    """An object read by ranges: large reads are split and fetched in parallel into the caller's buffers."""

    def __init__(self, storage: S3Storage, path: str, size: int) -> None:
        self.storage = storage
        self.path = path
        self._size = size

    def size(self) -> int:
        return self._size

    def read_into(self, views: Sequence[memoryview], offset: int) -> None:
        flat = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views if len(v)]
        total = sum(len(v) for v in flat)
        if not total:
            return
        if offset + total > self._size:
            raise CorruptCheckpointError(
                f"{self.path} is truncated: {total} bytes expected at offset {offset}, the object ends at "
                f"{self._size}. The checkpoint is corrupt.", path=self.path)
        chunk = self.storage.options.part_size
        jobs: list[tuple[int, list[memoryview]]] = []  # (object offset, destination views)
        pos = offset
        current: list[memoryview] = []
        room = chunk
        for v in flat:
            at = 0
            while at < len(v):
                n = min(room, len(v) - at)
                current.append(v[at:at + n])
                at += n
                room -= n
                if room == 0:
                    jobs.append((pos, current))
                    pos += chunk
                    current, room = [], chunk
        if current:
            jobs.append((pos, current))
        if len(jobs) == 1:
            self._fetch(*jobs[0])
            return
        futures = [self.storage.pool().submit(self._fetch, at, dest) for at, dest in jobs]
        for f in futures:
            f.result()

    def _fetch(self, offset: int, dest: list[memoryview]) -> None:
        s = self.storage
        length = sum(len(d) for d in dest)
        key = s.key(self.path)
        for attempt in range(4):
            try:
                resp = s.call("read", self.path, lambda: s.client.get_object(
                    Bucket=s.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}"))
                body = resp["Body"]
                try:
                    got = _read_body_into(body, dest)
                finally:
                    body.close()
                if got == length:
                    return
                raise OSError(errno.EIO, f"S3 returned {got} of {length} bytes", self.path)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{self.path} is missing: the checkpoint is incomplete",
                                             path=self.path) from None
            except OSError:  # a connection dropped mid-body: botocore does not retry those
                if attempt == 3:
                    raise
                time.sleep(0.1 * 2 ** attempt)
            except Exception as e:
                if attempt == 3 or _is_client_error(e):
                    raise s._translate(e, "read", self.path) from e
                time.sleep(0.1 * 2 ** attempt)

    def close(self) -> None:
        pass


def _read_body_into(body: Any, dest: list[memoryview]) -> int:
    """Read an HTTP body straight into ``dest`` (urllib3's readinto: no intermediate bytes objects)."""
    raw = getattr(body, "_raw_stream", None)
    readinto = getattr(raw, "readinto", None)
    got = 0
    for d in dest:
        at = 0
        while at < len(d):
            if readinto is not None:
                n = readinto(d[at:])
            else:
                chunk = body.read(len(d) - at)
                n = len(chunk)
                d[at:at + n] = chunk
            if not n:
                return got
            at += n
            got += n
    return got


__all__ = ["S3Options", "S3ReadHandle", "S3Storage", "S3WriteStream", "StorageError", "parse_url"]
