"""S3Storage: the StorageBackend of S3 and S3-compatible object stores, through boto3 (see the
package docstring for how each operation maps onto S3)."""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import posixpath
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

from ckptguard._pool import ExitSafePool
from ckptguard.errors import (
    CorruptCheckpointError,
    NotVisibleError,
    UnsupportedStorageError,
)
from ckptguard.storage.base import MAX_SMALL_OBJECT_BYTES
from ckptguard.storage.fileio import buffer_views

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef, ObjectIdentifierTypeDef
else:
    S3Client = CompletedPartTypeDef = ObjectIdentifierTypeDef = Any

from ckptguard.storage.s3.client import (
    _CONFLICT_CODES,
    _MISSING_CODES,
    _PRECONDITION_CODES,
    S3Options,
    _body,
    _Clients,
    _code,
    _crc32c_b64,
    parse_url,
)
from ckptguard.storage.s3.probe import probe_conditional_writes
from ckptguard.storage.s3.streams import S3ReadHandle, S3WriteStream
from ckptguard.storage.s3.translate import bucket_error, translate_error

log = logging.getLogger("ckptguard")


class S3Storage:
    """A checkpoint root ``s3://bucket/prefix`` (see :class:`~ckptguard.storage.base.StorageBackend`)."""

    keeps_open_files = False  # a ranged GET after a delete finds nothing
    cheap_small_reads = False  # every read is a ranged GET: a request, billed and throttled
    cheap_listing = False  # every page of a listing is a request
    leaves_uploads = True  # multipart uploads
    visible_once_written = True  # S3 reads its own writes, for every client

    def __init__(self, url: str, options: S3Options | dict[str, Any] | None = None) -> None:
        self.options = options if isinstance(options, S3Options) else S3Options.from_mapping(options)
        self.bucket, self.prefix = parse_url(url)
        self.root = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self._base = f"s3://{self.bucket}/"
        self._client: S3Client | None = None
        self._control: S3Client | None = None
        self._ready = False
        self._pool: ExitSafePool | None = None
        self._pool_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.options.max_concurrency + 2)

    # -- plumbing ------------------------------------------------------------------------
    @property
    def client(self) -> S3Client:
        if self._client is None:
            self._client = _Clients.get(self.options)
        return self._client

    @property
    def control(self) -> S3Client:
        """The client for small control objects: short timeouts, few retries (S3Options.control_*)."""
        if self._control is None:
            self._control = _Clients.get(self.options, control=True)
        return self._control

    @property
    def endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)

    def pool(self) -> Executor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ExitSafePool(self.options.max_concurrency, thread_name_prefix="ckptguard-s3")
            return self._pool

    def key(self, path: str) -> str:
        if path == self._base.rstrip("/"):
            return ""
        if not path.startswith(self._base):
            raise ValueError(f"{path} is not in bucket {self.bucket}")
        return path[len(self._base) :]

    def url(self, key: str) -> str:
        return self._base + key

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def join(self, directory: str, name: str) -> str:
        return posixpath.join(directory, name)

    def parent(self, path: str) -> str:
        return posixpath.dirname(path.rstrip("/"))

    def is_dir(self, path: str, follow_links: bool = True) -> bool:
        return True  # no directories: any name may be a prefix (its listing tells what it holds)

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
        return translate_error(err, what, path, self.bucket, self.client)

    def ensure_ready(self) -> None:
        """Once per instance: the bucket is reachable; once per process and store: conditional writes work."""
        if self._ready:
            return
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as e:
            raise bucket_error(e, self.bucket, self.root, self.client) from e
        if self._should_probe():
            probe_key = (self.endpoint, self.bucket)
            with _Clients.lock:
                known = probe_key in _Clients.ready
                outcome = _Clients.ready.get(probe_key)
            if not known:
                outcome = probe_conditional_writes(self)
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

    # -- namespace -----------------------------------------------------------------------
    def makedirs(self, path: str, within: str | None = None) -> None:
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
                names.add(p["Prefix"][len(prefix) :].rstrip("/"))
            for o in page.get("Contents", []):
                name = o["Key"][len(prefix) :]
                if name:
                    names.add(name)
        return sorted(names)

    def sizes_in(self, directory: str) -> dict[str, int]:
        prefix = self._dir_prefix(directory)
        out: dict[str, int] = {}
        for page in self._list(prefix, delimiter=True):
            for o in page.get("Contents", []):
                name = o["Key"][len(prefix) :]
                if name:
                    out[name] = int(o["Size"])
        return out

    def _head(self, path: str) -> dict[str, Any] | None:
        key = self.key(path)
        if not key:
            return None
        try:
            head: dict[str, Any] = self.call(
                "look up", path, lambda: self.control.head_object(Bucket=self.bucket, Key=key)
            )
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
            page = self.call(
                "list multipart uploads",
                self.url(prefix),
                functools.partial(self.client.list_multipart_uploads, **kwargs),
            )
            out.extend((self.url(u["Key"]), u["UploadId"]) for u in page.get("Uploads", []))
            if not page.get("IsTruncated"):
                return out
            kwargs["KeyMarker"] = page.get("NextKeyMarker", "")
            kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    def abort_upload(self, path: str, upload_id: str) -> None:
        try:
            self.call(
                "abort a multipart upload",
                path,
                lambda: self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key(path), UploadId=upload_id),
            )
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
            batch: list[ObjectIdentifierTypeDef] = [{"Key": k} for k in keys[i : i + 1000]]
            out = self.call(
                "delete objects",
                path,
                functools.partial(
                    self.client.delete_objects, Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                ),
            )
            errors = [e for e in out.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                raise OSError(errno.EIO, f"S3 could not delete {len(errors)} object(s), e.g. {errors[0]}", path)

    def sync_dir(self, path: str) -> None:
        pass  # no directory entries: an object is durable once its PUT or completion returned

    # -- small objects ---------------------------------------------------------------------
    def _get(self, path: str, limit: int) -> tuple[bytes, str] | None:
        key = self.key(path)
        try:
            resp = self.call("read", path, lambda: self.control.get_object(Bucket=self.bucket, Key=key))
        except FileNotFoundError:
            return None
        length = int(resp.get("ContentLength", 0))
        body = resp["Body"]
        try:
            if length > limit:
                raise CorruptCheckpointError(
                    f"{path} is {length:,} bytes, more than the {limit:,} a control object may have: "
                    "refusing to read it",
                    path=path,
                )
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
                time.sleep(0.1 * 2**attempt)
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
                time.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")

    def _conditional_put(self, path: str, data: bytes, **condition: str) -> bool:
        """PUT under a condition; False if the store refused it (412), True if it (or our own earlier
        try, retried after a 5xx) landed: on 412 the object is read back and must hold ``data``."""
        key = self.key(path)
        body = bytearray(data)
        checksum = _crc32c_b64(body)
        for attempt in range(8):
            try:
                self.call(
                    "write",
                    path,
                    lambda: self.control.put_object(
                        Bucket=self.bucket,
                        Key=key,
                        Body=_body(body),
                        ChecksumCRC32C=checksum,
                        **condition,  # type: ignore[arg-type]
                    ),
                )
                return True
            except OSError as e:
                cause = e.__cause__
                code = _code(cause) if isinstance(cause, Exception) else ""
                if code in _PRECONDITION_CODES:
                    now = self.read_versioned(path)
                    return now is not None and now[0] == data
                if code in _CONFLICT_CODES and attempt < 7:  # a concurrent conditional write: ask again
                    time.sleep(0.05 * 2**attempt)
                    continue
                if code in _MISSING_CODES and "IfMatch" in condition:
                    return False  # If-Match on an object that is gone
                raise
        raise AssertionError("unreachable")

    def create_exclusive(self, path: str, data: bytes) -> bool:
        return self._conditional_put(path, data, IfNoneMatch="*")

    def replace(self, path: str, data: bytes | Sequence[bytes]) -> None:
        stream = S3WriteStream(self, path, exclusive=False)
        try:
            stream.write(buffer_views(data), stable=True)  # bytes: immutable, held until sync
            stream.sync()
        finally:
            stream.close()

    def compare_and_swap(
        self, path: str, data: bytes, token: str | None, fence: Callable[[], None] | None = None
    ) -> bool:
        """A conditional PUT (If-None-Match / If-Match): one request, so ``fence`` runs right before it."""
        if fence is not None:
            fence()
        if token is None:
            return self.create_exclusive(path, data)
        return self._conditional_put(path, data, IfMatch=token)

    def delete(self, path: str) -> None:
        key = self.key(path)
        with contextlib.suppress(FileNotFoundError):
            self.call("delete", path, lambda: self.control.delete_object(Bucket=self.bucket, Key=key))

    def delete_if_version(self, path: str, token: str, fence: Callable[[], None] | None = None) -> bool:
        """DELETE with If-Match on the ETag read: a writer that replaced the object since keeps it.
        (The version is checked first too, so a store that ignores If-Match on DELETE narrows the
        race to the one request.)"""
        current = self.read_versioned(path)
        if current is None or current[1] != token:
            return False
        if fence is not None:
            fence()
        key = self.key(path)
        try:
            self.call("delete", path, lambda: self.control.delete_object(Bucket=self.bucket, Key=key, IfMatch=token))
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
            "are committed by a conditional create of their manifest (ckptguard.protocol.objstore).",
            path=dst,
        )

    # -- data ------------------------------------------------------------------------------
    def open_new(self, path: str) -> S3WriteStream:
        self.ensure_ready()
        return S3WriteStream(self, path, exclusive=True)

    def open_read(self, path: str) -> S3ReadHandle:
        head = self._head(path)
        if head is None:
            raise CorruptCheckpointError(f"{path} is missing: the checkpoint is incomplete", path=path)
        return S3ReadHandle(self, path, int(head["ContentLength"]))

    def wait_visible(
        self, path: str, size: int | None = None, timeout: float = 30.0, stop_if: Callable[[], None] | None = None
    ) -> None:
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
                raise NotVisibleError(
                    f"{path} is not there with the right size after {timeout:.0f} s ({state})", path=path
                )
            if stop_if is not None:
                stop_if()
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def prefetch(self, directory: str, prefix: str) -> Callable[[], None]:
        return _nothing

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _nothing() -> None:
    pass
