"""Data objects: a new object written in parts, uploaded in parallel and completed under a condition;
an object read by parallel ranged GETs straight into the caller's buffers."""

from __future__ import annotations

import contextlib
import errno
import http.client
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, cast

from ckptguard.errors import (
    CheckpointError,
    CorruptCheckpointError,
)

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef, ObjectIdentifierTypeDef
else:
    S3Client = CompletedPartTypeDef = ObjectIdentifierTypeDef = Any

from ckptguard.storage.s3.client import (
    _MAX_PARTS,
    _PRECONDITION_CODES,
    _WRITER_META,
    Bucket,
    _code,
    _crc32c_b64,
    _is_client_error,
    _views_body,
    call_throttled,
)

log = logging.getLogger("ckptguard")


class S3WriteStream:
    """A new object written in order: cut into parts, uploaded in parallel, completed by ``sync``.

    Views written ``stable`` (the caller keeps their bytes alive and unchanged until ``sync`` returns:
    tensor memory during a save) are sent from where they are, each part a list of slices of them;
    other views are copied first, since their caller may reuse its buffers once ``write`` returns.
    At most ``max_concurrency + 2`` parts per process are queued or in flight at once: a full part
    waits for a free slot, and so does copying into a new part.
    """

    def __init__(self, storage: Bucket, path: str, exclusive: bool) -> None:
        self.storage = storage
        self.path = path
        self.key = storage.key(path)
        self.exclusive = exclusive
        self.token = uuid.uuid4().hex
        self.part_size = storage.options.part_size
        self._pending: list[memoryview] = []  # the next part's bytes, in order
        self._fill = 0
        self._slot_held = False
        self._upload: str | None = None
        self._parts: list[Future[CompletedPartTypeDef]] = []
        self._done = False
        self._size = 0

    def write(self, views: Sequence[memoryview], stable: bool = False) -> None:
        if self._done:
            raise ValueError(f"{self.path}: write after sync")
        for v in views:
            mv = v.cast("B") if v.format != "B" or v.ndim != 1 else v
            pos = 0
            while pos < len(mv):
                n = min(len(mv) - pos, self.part_size - self._fill)
                piece = mv[pos : pos + n]
                if not stable:
                    if not self._slot_held:
                        self._take_slot()
                    piece = memoryview(bytes(piece))
                self._pending.append(piece)
                self._fill += n
                pos += n
                self._size += n
                if self._fill == self.part_size:
                    self._ship(final=False)

    def _take_slot(self) -> None:
        self.storage._slots.acquire()
        self._slot_held = True

    def _release_slot(self) -> None:
        if self._slot_held:
            self._slot_held = False
            self.storage._slots.release()

    def _take_pending(self) -> list[memoryview]:
        data, self._pending, self._fill = self._pending, [], 0
        return data

    def _ship(self, final: bool) -> None:
        if not self._slot_held:
            self._take_slot()
        data = self._take_pending()
        self._slot_held = False  # the part's upload releases it
        try:
            if self._upload is None:
                self._upload = self._start_upload()
            number = len(self._parts) + 1
            if number > _MAX_PARTS:
                raise OSError(errno.EFBIG, f"more than {_MAX_PARTS} parts: raise storage_options part_size", self.path)
            self._parts.append(self.storage.pool().submit(self._upload_part, number, data))
        except BaseException:
            self.storage._slots.release()
            raise
        if not final and len(self._parts) in (1000, 3000, 6000):
            self.part_size *= 2  # stay under S3's 10,000 parts whatever the object's size

    def _start_upload(self) -> str:
        s = self.storage
        resp = call_throttled(
            s,
            "start an upload",
            self.path,
            lambda: s.client.create_multipart_upload(
                Bucket=s.bucket, Key=self.key, ChecksumAlgorithm="CRC32C", Metadata={_WRITER_META: self.token}
            ),
        )
        return str(resp["UploadId"])

    def _upload_part(self, number: int, data: list[memoryview]) -> CompletedPartTypeDef:
        s = self.storage
        try:
            checksum = _crc32c_b64(data)
            upload = self._upload
            assert upload is not None
            # botocore seeks the body back to its start before each retry: the same bytes, the same checksum.
            resp = call_throttled(
                s,
                "upload a part",
                self.path,
                lambda: s.client.upload_part(
                    Bucket=s.bucket,
                    Key=self.key,
                    UploadId=upload,
                    PartNumber=number,
                    Body=_views_body(data),
                    ChecksumCRC32C=checksum,
                ),
            )
            return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC32C": checksum}
        finally:
            s._slots.release()

    def sync(self) -> None:
        """Complete the object (exclusively: FileExistsError if another writer created it first)."""
        if self._done:
            return
        s = self.storage
        if self._upload is None:
            data = self._take_pending()
            try:
                self._put_whole(data)
            finally:
                self._release_slot()
        else:
            if self._fill:
                self._ship(final=True)
            else:
                self._release_slot()
            parts = [f.result() for f in self._parts]
            self._complete(parts)
        self._done = True
        log.debug("ckptguard: wrote %s (%d bytes) to %s", self.path, self._size, s.endpoint)

    def _put_whole(self, data: list[memoryview]) -> None:
        s = self.storage
        cond = {"IfNoneMatch": "*"} if self.exclusive else {}
        checksum = _crc32c_b64(data)
        try:
            call_throttled(
                s,
                "write",
                self.path,
                lambda: s.client.put_object(
                    Bucket=s.bucket,
                    Key=self.key,
                    Body=_views_body(data),
                    ChecksumCRC32C=checksum,
                    Metadata={_WRITER_META: self.token},
                    **cond,  # type: ignore[arg-type]
                ),
            )
        except OSError as e:
            self._settle_refusal(e)

    def _complete(self, parts: list[CompletedPartTypeDef]) -> None:
        s = self.storage
        cond = {"IfNoneMatch": "*"} if self.exclusive else {}
        upload = self._upload
        assert upload is not None
        try:
            call_throttled(
                s,
                "complete an upload",
                self.path,
                lambda: s.client.complete_multipart_upload(
                    Bucket=s.bucket,
                    Key=self.key,
                    UploadId=upload,
                    MultipartUpload={"Parts": parts},
                    **cond,  # type: ignore[arg-type]
                ),
            )
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
        self._take_pending()
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

    def __init__(self, storage: Bucket, path: str, size: int) -> None:
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
                f"{self._size}. The checkpoint is corrupt.",
                path=self.path,
            )
        chunk = self.storage.options.part_size
        jobs: list[tuple[int, list[memoryview]]] = []  # (object offset, destination views)
        pos = offset
        current: list[memoryview] = []
        room = chunk
        for v in flat:
            at = 0
            while at < len(v):
                n = min(room, len(v) - at)
                current.append(v[at : at + n])
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
                resp = call_throttled(
                    s,
                    "read",
                    self.path,
                    lambda: s.client.get_object(
                        Bucket=s.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}"
                    ),
                )
                body = resp["Body"]
                try:
                    got = _read_body_into(body, dest)
                finally:
                    body.close()
                if got == length:
                    return
                raise OSError(errno.EIO, f"S3 returned {got} of {length} bytes", self.path)
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"{self.path} is missing: the checkpoint is incomplete", path=self.path
                ) from None
            except OSError:  # a connection dropped mid-body: botocore does not retry those
                if attempt == 3:
                    raise
                time.sleep(0.1 * 2**attempt)
            except Exception as e:
                if attempt == 3 or _is_client_error(e):
                    raise s._translate(e, "read", self.path) from e
                time.sleep(0.1 * 2**attempt)

    def close(self) -> None:
        pass


def _read_body_into(body: Any, dest: list[memoryview]) -> int:
    """Read an HTTP body straight into ``dest``: no intermediate bytes objects."""
    readinto = _body_readinto(body)
    got = 0
    for d in dest:
        at = 0
        while at < len(d):
            if readinto is not None:
                n = readinto(d[at:])
            else:
                chunk = body.read(len(d) - at)
                n = len(chunk)
                d[at : at + n] = chunk
            if not n:
                return got
            at += n
            got += n
    return got


def _body_readinto(body: Any) -> Callable[[memoryview], int] | None:
    """The socket-level ``readinto`` under botocore's body: http.client's, which receives into the
    buffer given. urllib3's own ``readinto`` reads a bytes object of the whole length asked for and
    copies it (a second buffer of every range in flight); it is used only when the body is encoded
    (urllib3 decodes it) or http.client's response is not there."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    headers = getattr(raw, "headers", None)
    if isinstance(fp, http.client.HTTPResponse) and headers is not None and not headers.get("content-encoding"):
        return fp.readinto
    readinto = getattr(raw, "readinto", None)
    return cast("Callable[[memoryview], int] | None", readinto)
