"""Every control record of a root, and the one guarded parser that reads them all.

A record read from storage is untrusted bytes: another tool, a torn write or an attacker
may have put anything there. :func:`decode` checks the size and the nesting depth BEFORE
any decoder recurses (a deeply nested document would otherwise end in ``RecursionError``),
then decodes into the record's schema; anything else is one :class:`MalformedRecordError`
naming the file and the field.

The schemas are msgspec ``Struct``s: msgspec gives strict typed decoding of JSON with
field paths in its errors, and the same schemas encode to MessagePack, which is the
compact form the manifest's per-chunk rows want; one library for every record.

Records and their bounds (the Commit protocol page, "Limits on untrusted input", lists them all):

    latest            LatestRecord   MAX_CONTROL_BYTES   MAX_CONTROL_DEPTH
    tags/NAME         TagRecord      MAX_CONTROL_BYTES   MAX_CONTROL_DEPTH
    .ckptguard/lease.json  LeaseBody MAX_CONTROL_BYTES   MAX_CONTROL_DEPTH
    .ckptguard/index.json  IndexBody MAX_INDEX_BYTES     MAX_CONTROL_DEPTH
    MANIFEST.json     head: ManifestBody (schema.py), storage read limit, MAX_MANIFEST_DEPTH;
                      rows: Tables (MessagePack, decode_binary), typed throughout
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import numpy as np

from ckptguard.errors import MalformedRecordError

#: latest, tags and lease.json hold a few fields: anything bigger was not written by ckptguard.
MAX_CONTROL_BYTES = 64 << 10
#: The S3 index grows one entry per save attempt not yet collected (~150 bytes each).
MAX_INDEX_BYTES = 256 << 20
#: Control records nest at most 3 deep (index -> entries -> entry).
MAX_CONTROL_DEPTH = 8
#: A manifest's body nests ~6 deep; user_metadata and the DCP metadata add what the user's state has.
#: Python's own decoder recurses about 1000 deep before RecursionError: stay well below.
MAX_MANIFEST_DEPTH = 128

#: A record's timestamps are seconds since the epoch: finite, and below the year 10000.
MAX_TIME = 253402300800.0

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TIME)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Name = Annotated[str, msgspec.Meta(max_length=4096)]
#: A pid is handed to os.kill: beyond a C int it would raise OverflowError there.
Pid = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
#: An attempt id becomes part of a path (staging/step-N.<attempt>): hex only, never ``../``.
ATTEMPT_PATTERN = "^[0-9a-f]{16,64}$"
Attempt = Annotated[str, msgspec.Meta(pattern=ATTEMPT_PATTERN)]


class LatestRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """``latest``: the checkpoint committed last (a hint for tools; loads list the root instead).

    Written by :mod:`ckptguard.protocol.latest` only; fields left unset are not written."""

    step: NonNegative
    dir: Name | None = None
    updated_at: Seconds = 0.0
    seq: Positive | None = None
    high_seq: Positive | None = None  # the highest sequence number ever handed out here


class TagRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """``tags/NAME``: a name pinned to a committed step."""

    step: NonNegative
    tag: Name = ""
    dir: Name | None = None
    updated_at: Seconds = 0.0


class LeaseBody(msgspec.Struct, frozen=True):
    """``.ckptguard/lease.json``: which job may write to the root (protocol/lease.py holds the logic)."""

    holder: Name
    job: Name | None
    host: Name
    pid: Pid
    boot_id: Name
    epoch: NonNegative
    acquired_at: Seconds
    renewed_at: Seconds
    ttl_s: Seconds
    pid_ns: Name = ""


class IndexEntryBody(msgspec.Struct, frozen=True):
    step: NonNegative
    version: Positive
    attempt: Attempt
    state: Literal["pending", "committed", "aborted"]
    epoch: NonNegative
    seq: Positive | None = None


class IndexBody(msgspec.Struct, frozen=True):
    """``.ckptguard/index.json`` on object stores: every attempt and its state."""

    format: Literal["ckptguard-index"]
    epoch: NonNegative
    next_seq: Positive
    entries: list[IndexEntryBody]


class TombstoneRecord(msgspec.Struct, frozen=True):
    """A commit key an aborted attempt can never take (object stores)."""

    format: Literal["ckptguard-tombstone"]
    attempt: Name = ""
    epoch: NonNegative = 0  # the index epoch of the job that wrote it
    at: Seconds = 0.0


T = TypeVar("T")

_OPEN_CLOSE = np.zeros(256, dtype=np.int8)
_OPEN_CLOSE[[ord("["), ord("{")]] = 1
_OPEN_CLOSE[[ord("]"), ord("}")]] = -1
_CHUNK = 16 << 20


def nesting_depth(data: bytes) -> int:
    """How deep a JSON decoder would recurse into ``data``, found without recursing.

    Backslashes occur only inside strings, as escape pairs: dropping ``\\\\`` then ``\\"``
    leaves every remaining quote a string delimiter, so the brackets at an even count of
    quotes are exactly those a decoder meets (up to its first syntax error, where it stops
    anyway). Linear, vectorised and in bounded chunks: fast enough for manifests of
    hundreds of MB.
    """
    if b"[" not in data and b"{" not in data:
        return 0
    if b"\\" in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    arr = np.frombuffer(data, dtype=np.uint8)
    quotes_before, depth, deepest = 0, 0, 0
    for start in range(0, len(arr), _CHUNK):
        chunk = arr[start : start + _CHUNK]
        # Only quotes and brackets matter: keep those ('[' | 32 == '{', ']' | 32 == '}'), then
        # a quote count's parity says inside a string (uint8 wraps, parity survives).
        special = chunk[(chunk == 34) | ((chunk | 32) == 123) | ((chunk | 32) == 125)]
        if not len(special):
            continue
        is_quote = special == 34
        parity = (np.cumsum(is_quote, dtype=np.uint8) + quotes_before) & 1
        quotes_before = int(parity[-1])
        steps = _OPEN_CLOSE[special[~is_quote & (parity == 0)]]
        if len(steps):
            running = np.cumsum(steps, dtype=np.int64) + depth
            deepest = max(deepest, int(running.max()))
            depth = int(running[-1])
    return deepest


def check_bounds(data: bytes, path: str, what: str, *, max_bytes: int | None, max_depth: int) -> None:
    """Refuse ``data`` before decoding if it is larger or nests deeper than a ``what`` may."""
    if max_bytes is not None and len(data) > max_bytes:
        raise MalformedRecordError(
            f"{path}: {len(data):,} bytes is more than a {what} may have ({max_bytes:,}): not written by ckptguard",
            path=path,
            field="(size)",
        )
    depth = nesting_depth(data)
    if depth > max_depth:
        raise MalformedRecordError(
            f"{path}: nested {depth} deep, more than a {what} may be ({max_depth}): not written by ckptguard",
            path=path,
            field="(nesting)",
        )


_FIELD = re.compile(r" - at `\$(.*)`$")


def decode(
    data: bytes, schema: type[T], path: str, *, max_bytes: int = MAX_CONTROL_BYTES, max_depth: int = MAX_CONTROL_DEPTH
) -> T:
    """``data`` as a ``schema`` record, or MalformedRecordError naming ``path`` and the field."""
    what = schema.__name__
    check_bounds(data, path, what, max_bytes=max_bytes, max_depth=max_depth)
    try:
        return msgspec.json.decode(data, type=schema)
    except msgspec.ValidationError as e:
        m = _FIELD.search(str(e))
        field = m.group(1).lstrip(".") if m else "(record)"
        raise MalformedRecordError(
            f"{path}: not a valid {what}: {e}; it was modified by hand or by another tool",
            path=path,
            field=field or "(record)",
        ) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        # msgspec raises UnicodeDecodeError, not DecodeError, for a string that is not UTF-8
        raise MalformedRecordError(f"{path}: not a valid {what} (not JSON: {e})", path=path, field="(record)") from None


def decode_binary(data: bytes | memoryview, schema: type[T], path: str, what: str) -> T:
    """MessagePack ``data`` as a ``schema`` record (a manifest's row tables), or MalformedRecordError
    naming ``path`` and the field. The schema has no untyped parts, so it bounds the nesting; every
    length a header claims is checked against the bytes left before anything is allocated; the size
    is bounded by the read that got ``data``."""
    try:
        return msgspec.msgpack.decode(data, type=schema)
    except msgspec.ValidationError as e:
        m = _FIELD.search(str(e))
        field = _field_names(schema, m.group(1)) if m else "(record)"
        raise MalformedRecordError(
            f"{path}: not a valid {what}: {e}; it was modified by hand or by another tool", path=path, field=field
        ) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:  # a string not UTF-8: UnicodeDecodeError
        raise MalformedRecordError(
            f"{path}: not a valid {what} (not MessagePack of its schema: {e})", path=path, field="(record)"
        ) from None


_STEP = re.compile(r"\[(\d+)\]|\.(\w+)|\[[^]]*\]")


def _field_names(schema: Any, where: str) -> str:
    """``[1][3][5]`` of an array-like record as ``items.file[5]``: the field, by name."""
    out: list[str] = []
    current: Any = schema
    for m in _STEP.finditer(where):
        fields = (
            msgspec.structs.fields(current)
            if isinstance(current, type) and issubclass(current, msgspec.Struct)
            else None
        )
        if (
            fields is not None
            and m.group(1) is not None
            and current.__struct_config__.array_like
            and int(m.group(1)) < len(fields)
        ):
            f = fields[int(m.group(1))]
            out.append(f.name)
            current = f.type
        elif fields is not None and m.group(2) is not None:
            out.append(m.group(2))
            current = next((f.type for f in fields if f.name == m.group(2)), None)
        else:
            out.append(m.group(0))
            current = None
    return ".".join(out).replace(".[", "[") or "(record)"


def encode(record: msgspec.Struct) -> bytes:
    """A record as the one-line JSON that :func:`decode` reads back."""
    return msgspec.json.encode(record) + b"\n"


def parse_json(
    data: bytes | str, path: str, what: str, *, max_bytes: int | None, max_depth: int = MAX_MANIFEST_DEPTH
) -> Any:
    """Untyped JSON (a manifest's body, a safetensors header), bounded the same way as a record."""
    raw = data.encode() if isinstance(data, str) else data
    check_bounds(raw, path, what, max_bytes=max_bytes, max_depth=max_depth)
    try:
        return json.loads(data)  # Python's decoder: big integers stay exact, as the manifest was written
    except (ValueError, RecursionError) as e:
        raise MalformedRecordError(f"{path}: {what} is not JSON ({e})", path=path, field="(record)") from None


__all__ = [
    "MAX_CONTROL_BYTES",
    "MAX_CONTROL_DEPTH",
    "MAX_INDEX_BYTES",
    "MAX_MANIFEST_DEPTH",
    "IndexBody",
    "IndexEntryBody",
    "LatestRecord",
    "LeaseBody",
    "MalformedRecordError",
    "TagRecord",
    "TombstoneRecord",
    "check_bounds",
    "decode",
    "decode_binary",
    "encode",
    "nesting_depth",
    "parse_json",
]
