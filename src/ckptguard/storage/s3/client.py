"""Talking to S3: options, URLs, the boto3 clients (one per process and configuration), error codes."""

from __future__ import annotations

import base64
import bisect
import io
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, fields, replace
from typing import IO, TYPE_CHECKING, Any, ClassVar, Protocol, cast

import crc32c

from ckptguard.errors import (
    UnsupportedStorageError,
)

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef, ObjectIdentifierTypeDef
else:
    S3Client = CompletedPartTypeDef = ObjectIdentifierTypeDef = Any

log = logging.getLogger("ckptguard")

_WRITER_META = "ckptguard-writer"  # x-amz-meta-ckptguard-writer: which stream created a data object
_MIN_PART = 5 << 20  # S3's smallest part (all but the last)
_MAX_PARTS = 10_000
_RETRY_MODES = {"standard", "adaptive"}
_PERMISSION_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
    "AccountProblem",
    "InvalidToken",
    "ExpiredToken",
    "403",
}
_REGION_CODES = {
    "PermanentRedirect",
    "AuthorizationHeaderMalformed",
    "IllegalLocationConstraintException",
    "301",
    "IncorrectEndpoint",
}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
_PRECONDITION_CODES = {"PreconditionFailed", "412"}
_CONFLICT_CODES = {"ConditionalRequestConflict", "409", "OperationAborted"}
_THROTTLE_CODES = {
    "SlowDown",
    "503",
    "ServiceUnavailable",
    "RequestLimitExceeded",
    "Throttling",
    "ThrottlingException",
    "TooManyRequests",
    "429",
}
_THROTTLE_ROUNDS = 8  # rounds of botocore's own retries a data request gets while S3 throttles it
_THROTTLE_MAX_WAIT_S = 20.0
# The environment boto3 consults when a client is made (the keys by name only: a rotated key is a new client).
_ENV_SETTINGS = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
)


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
    # Data requests' retries: "standard" (exponential backoff with full jitter, 1 s base on 503 SlowDown)
    # or "adaptive" (the same, and after a throttle each process paces its own request rate): at
    # thousands of ranks, adaptive turns S3's SlowDown into a lower rate instead of waves of retries.
    retry_mode: str = "standard"
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    # Control objects (lease, index, `latest`, tags, commit objects): small, so short timeouts and few
    # tries; a lost answer is settled by reading back, and the lease's release at exit stays bounded.
    control_connect_timeout_s: float = 3.0
    control_read_timeout_s: float = 10.0
    control_max_attempts: int = 3
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
        if opts.max_concurrency < 1 or opts.max_attempts < 1 or opts.control_max_attempts < 1:
            raise ValueError("storage_options max_concurrency, max_attempts and control_max_attempts must be >= 1")
        if opts.retry_mode not in _RETRY_MODES:
            raise ValueError(
                f"storage_options retry_mode must be one of {sorted(_RETRY_MODES)}, not {opts.retry_mode!r}"
            )
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


def _crc32c_b64(data: bytes | bytearray | memoryview | Sequence[memoryview]) -> str:
    """The base64 CRC32C S3 expects, of a buffer or of several in order (computed where they are)."""
    if isinstance(data, bytes | bytearray | memoryview):
        value = crc32c.crc32c(data)
    else:
        value = 0
        for v in data:
            value = crc32c.crc32c(v, value)
    return base64.b64encode(value.to_bytes(4, "big")).decode()


class ViewsBody(io.RawIOBase):
    """A request body read from the caller's memory: botocore hashes and sends what ``read`` returns,
    here slices of the views themselves (a bytes-like body must be bytes or bytearray to pass
    botocore's checks, and a memoryview copied into one costs a copy of every byte). Seekable, so a
    retry resends the same bytes from the start."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        super().__init__()
        self._views = [v for v in views if len(v)]
        self._starts: list[int] = []
        at = 0
        for v in self._views:
            self._starts.append(at)
            at += len(v)
        self._size = at
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int | None = -1) -> memoryview:
        """At most ``size`` bytes, as a slice of one view (a short read: callers loop until empty)."""
        if self._pos >= self._size:
            return memoryview(b"")
        i = bisect.bisect_right(self._starts, self._pos) - 1
        view = self._views[i]
        at = self._pos - self._starts[i]
        n = len(view) - at if size is None or size < 0 else min(size, len(view) - at)
        self._pos += n
        return view[at : at + n]

    def readinto(self, buffer: Any) -> int:
        chunk = self.read(len(memoryview(buffer).cast("B")))
        n = len(chunk)
        memoryview(buffer).cast("B")[:n] = chunk
        return n


def _views_body(views: Sequence[memoryview]) -> bytes | IO[bytes]:
    """A body botocore sends from ``views``: the bytes object itself where one view is all of one
    (a small object; sent as it is, without the 100-continue round trip botocore adds before a
    streamed body), otherwise a stream over the views (botocore's stubs only name IO[bytes])."""
    if len(views) == 1 and isinstance(views[0].obj, bytes | bytearray) and views[0].nbytes == len(views[0].obj):
        return cast(bytes, views[0].obj)
    return cast(IO[bytes], ViewsBody(views))


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


def is_throttled(err: BaseException) -> bool:
    """A request S3 refused for its rate (503 SlowDown and the like), translated by ``Bucket.call``."""
    cause = err.__cause__
    return isinstance(cause, Exception) and _is_client_error(cause) and _code(cause) in _THROTTLE_CODES


def call_throttled(storage: Bucket, what: str, path: str, fn: Callable[[], Any]) -> Any:
    """A data request that S3 may throttle: ``storage.call``, and once botocore's retries gave up on a
    throttled request (``max_attempts`` tries, or this process's retry quota spent: botocore allows
    about 100 throttled retries beyond its successes), a wait of rand(0, 1) * min(2 ** round, 20) s
    and another round, at most ``_THROTTLE_ROUNDS`` of them. S3 answers SlowDown while it splits a
    prefix under a new load, which takes longer than one request's retries at thousands of ranks."""
    for round_ in range(_THROTTLE_ROUNDS + 1):
        try:
            return storage.call(what, path, fn)
        except OSError as e:
            if round_ == _THROTTLE_ROUNDS or not is_throttled(e):
                raise
            wait = random.random() * min(2.0**round_, _THROTTLE_MAX_WAIT_S)
            log.debug("ckptguard: S3 throttled the request to %s %s; again in %.1f s", what, path, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


class _Clients:
    """One boto3 client per process and configuration (clients are thread-safe; sessions are not)."""

    lock = threading.Lock()
    cache: ClassVar[dict[tuple[Any, ...], S3Client]] = {}
    ready: ClassVar[dict[tuple[str, str], BaseException | None]] = {}  # (endpoint, bucket) -> probe outcome

    @classmethod
    def get(cls, opts: S3Options, control: bool = False) -> S3Client:
        """The client for data (parts, ranges, listings) or, ``control``, for small control objects."""
        if control:
            # Standard retries for control objects whatever retry_mode says: they are few and one at a
            # time, and a rate limiter's wait must not delay the lease's bounded release at exit.
            opts = replace(
                opts,
                max_attempts=opts.control_max_attempts,
                connect_timeout_s=opts.control_connect_timeout_s,
                read_timeout_s=opts.control_read_timeout_s,
                retry_mode="standard",
            )
        # boto3 reads unset values from the environment when the client is made: a process that points
        # AWS_ENDPOINT_URL (or the region, profile, keys) elsewhere must get a new client, not the old one.
        env = tuple(os.environ.get(k) for k in _ENV_SETTINGS)
        key = (
            opts.endpoint_url,
            opts.region_name,
            opts.profile_name,
            opts.max_concurrency,
            opts.max_attempts,
            opts.retry_mode,
            opts.connect_timeout_s,
            opts.read_timeout_s,
            env,
        )
        with cls.lock:
            client = cls.cache.get(key)
            if client is None:
                import boto3
                from botocore.config import Config

                session = boto3.session.Session(profile_name=opts.profile_name)
                config = Config(
                    retries={
                        "mode": "adaptive" if opts.retry_mode == "adaptive" else "standard",
                        "max_attempts": opts.max_attempts,
                    },
                    max_pool_connections=max(10, 2 * opts.max_concurrency + 8),
                    connect_timeout=opts.connect_timeout_s,
                    read_timeout=opts.read_timeout_s,
                    # We send CRC32C ourselves (computed once per part) and check every byte we read
                    # against the manifest: no second checksum by botocore on either side.
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
                client = session.client(
                    "s3", endpoint_url=opts.endpoint_url, region_name=opts.region_name, config=config
                )
                cls.cache[key] = client
            return client


class Bucket(Protocol):
    """What the write and read streams and the conditional-write probe use of the storage they belong to
    (:class:`~ckptguard.storage.s3.backend.S3Storage` is the one implementation): they are parts of it,
    written apart, so its underscored members are theirs too."""

    options: S3Options
    bucket: str
    root: str
    _slots: threading.BoundedSemaphore

    @property
    def client(self) -> S3Client: ...
    @property
    def endpoint(self) -> str: ...
    def pool(self) -> Executor: ...
    def key(self, path: str) -> str: ...
    def url(self, key: str) -> str: ...
    def path(self, *parts: str) -> str: ...
    def call(self, what: str, path: str, fn: Callable[[], Any]) -> Any: ...
    def _call(self, what: str, path: str, fn: Callable[[], Any]) -> Any: ...
    def _translate(self, err: Exception, what: str, path: str) -> BaseException: ...
    def _head(self, path: str) -> dict[str, Any] | None: ...
    def abort_upload(self, path: str, upload_id: str) -> None: ...
