"""Durable writes and guarded reads of single small files, for code that works beside a checkpoint.

A framework integration publishes its own small files (a pointer, DeepSpeed's ``latest``, a file
the framework reads) next to what ckptguard committed. These are the operations ckptguard itself
uses for that, so that a crash leaves the old file or the new one, never a torn or missing one:

    from ckptguard.files import replace_file, replacing
    replace_file("/ckpts/latest", b"global_step100")
    with replacing("/ckpts/model.pt") as f:     # streamed: torch.save(state, f)
        torch.save(state, f)

A small record read back (a pointer the integration wrote) is untrusted bytes; :func:`decode_record`
reads it into a msgspec schema with the bounds ckptguard's own control records have, and raises one
:class:`~ckptguard.MalformedRecordError` naming the file and the field otherwise.

Everything here is local to the calling process (no collective); the writes are POSIX only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from ckptguard.protocol.records import MAX_CONTROL_BYTES, MAX_CONTROL_DEPTH, parse_json
from ckptguard.protocol.records import decode as decode_record
from ckptguard.storage.fileio import (
    fsync_dir,
    makedirs_durable,
    open_regular,
    replace_file,
    unique_tmp_name,
    unlink_quietly,
)

__all__ = [
    "MAX_CONTROL_BYTES",
    "decode_record",
    "fsync_dir",
    "makedirs_durable",
    "read_json",
    "replace_file",
    "replacing",
]


@contextmanager
def replacing(path: str) -> Iterator[BinaryIO]:
    """A file to write the new content of ``path`` into; on a clean exit it replaces ``path`` atomically
    (fsync, rename, fsync of the directory), on an exception it is removed and ``path`` is untouched."""
    tmp = unique_tmp_name(path)
    try:
        with open(tmp, "xb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def read_json(path: str, what: str, *, max_bytes: int = MAX_CONTROL_BYTES) -> Any:
    """The JSON value in the small file ``path``, read with the bounds of a control record.

    Args:
        path: A regular file (a FIFO or device is refused, never waited on).
        what: What the file is, named in a refusal.
        max_bytes: The most bytes the file may hold.

    Returns:
        The parsed value (any JSON type: the caller checks its shape).

    Raises:
        OSError: The file cannot be opened or read (FileNotFoundError where it is absent).
        MalformedRecordError: It is larger or nests deeper than a control record may, or is not JSON
            (bytes that are not UTF-8 included).
    """
    with os.fdopen(open_regular(path), "rb") as f:
        data = f.read(max_bytes + 1)
    return parse_json(data, path, what, max_bytes=max_bytes, max_depth=MAX_CONTROL_DEPTH)
