"""Every field of a manifest as stored, declared with its type and bounds: decoded once, in C.

A manifest is a JSON head (:class:`ManifestBody`) and a MessagePack row section
(:class:`Tables`); ``protocol/manifest.py`` reads and writes them, and what relates
one field to another (chunks cover each tensor once, artifact rows name listed files,
sizes within the bytes stored) is checked in one place, ``protocol/validate.py``.

The schemas decode what format version 2 writes, byte for byte; a field this release
does not know is ignored. Numbers are bounded here so that nothing downstream meets an
integer beyond int64 or a float that is not finite (a JSON number out of a float's
range is refused by the decoder, not turned into ``inf`` or an ``OverflowError``).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from ckptguard.protocol.itemtable import MAX_FILE_BYTES, EncodedItems
from ckptguard.protocol.records import Seconds

#: How many ranks a manifest may name (a world size, a rank, a storage domain's size).
MAX_RANKS = 1 << 31

Count = Annotated[int, msgspec.Meta(ge=0)]
#: Files are at most 2**62 bytes, so offsets and ends of items add up without overflowing int64.
Bytes = Annotated[int, msgspec.Meta(ge=0, le=MAX_FILE_BYTES)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
Ranks = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Short = Annotated[str, msgspec.Meta(max_length=256)]
Name = Annotated[str, msgspec.Meta(max_length=4096)]
#: A checksum as every algorithm of checksum.py writes it: hexadecimal text.
HexChecksum = Annotated[str, msgspec.Meta(pattern="^[0-9a-fA-F]{1,128}$")]
#: A pair of paths: where a file of an artifact goes (relative to it), where it is in the checkpoint.
PathPair = tuple[Name, Name]


class RowsHeader(msgspec.Struct):
    """Where the binary row tables are: the bytes after the JSON head's newline."""

    encoding: Short
    bytes: Count
    files: Count = 0
    items: Count = 0


class DomainBody(msgspec.Struct):
    """The storage domain whose manifest this is: its index among ``count``, and its ranks."""

    index: Rank
    count: Ranks
    ranks: list[Rank]


class ArtifactBody(msgspec.Struct):
    """A rank's ``files=`` entry: a file or a directory, each of its files stored at a listed path."""

    rank: Rank
    key: Name
    kind: Short
    files: list[PathPair]


class ManifestBody(msgspec.Struct):
    """The JSON head of a manifest (what a person reads: step, sequence number, world, attempt,
    checksum algorithm, versions). ``user_metadata`` is the user's own JSON (``metadata=`` of save): any
    JSON value, bounded in size and nesting by the guarded parser like the rest of the head. Fields this
    release does not know are ignored."""

    format: Short
    format_version: int
    step: Count
    version: Positive
    attempt: Short
    created_at: Seconds
    world_size: Ranks
    domain: DomainBody
    hosts: list[Name]
    checksum_algorithm: Short
    versions: dict[Name, Name]
    user_metadata: dict[str, Any]
    artifacts: list[ArtifactBody]
    rows: RowsHeader
    commit_seq: Positive | None = None


class FileColumns(msgspec.Struct, array_like=True):
    """One list per field of the files, one entry per file."""

    path: list[Name]
    size: list[Bytes]
    rank: list[Rank]
    checksum: list[HexChecksum | None]


class DcpEntry(msgspec.Struct, omit_defaults=True):
    """One entry of DCP's metadata (codec.metadata_to_json): a tensor, or ``type: bytes``. Sizes and
    chunk lists are typed as integers of any sign here: a negative one is refused with its tensor's name
    by the checks (protocol/validate.py), which the message names better than a schema path."""

    type: Short
    dtype: Short | None = None
    requires_grad: bool | None = None
    size: list[int] | None = None
    chunks: list[int] | None = None


class DcpBody(msgspec.Struct):
    """DCP's metadata (codec.metadata_to_json): per tensor, its chunks as one flat list of numbers."""

    state_dict: dict[str, DcpEntry] = {}
    planner_data: dict[str, list[str | int]] = {}
    version: Short | None = None


class Tables(msgspec.Struct, array_like=True):
    """The binary section of a manifest (MessagePack): what grows with the number of chunks."""

    files: FileColumns
    items: EncodedItems
    dcp: DcpBody


__all__ = ["ArtifactBody", "DcpBody", "DcpEntry", "DomainBody", "FileColumns", "ManifestBody", "RowsHeader", "Tables"]
