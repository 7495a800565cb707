"""Storage backends: the few primitives the commit protocol needs, behind one protocol.

:func:`open_storage` maps a root (a directory or a URL) to its backend. Schemes are
case-insensitive (RFC 3986: ``S3://`` is ``s3://``). A scheme without a backend, and a
URL-like root that is malformed (``s3:/bucket``, ``s3:bucket``), are refused with an
error naming what was probably meant, never taken for a local directory: a typo must
not create ``./s3:/bucket`` and write checkpoints there.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping
from typing import Any

from ckptguard.errors import UnsupportedStorageError
from ckptguard.storage.base import ObjectStore, ReadHandle, StorageBackend, WriteStream
from ckptguard.storage.posix import PosixStorage

__all__ = ["ObjectStore", "PosixStorage", "ReadHandle", "StorageBackend", "WriteStream", "filesystem_path",
           "is_s3_url", "local_path", "open_storage", "require_s3_extra", "url_scheme"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)
SUPPORTED = "local paths, file:// URLs and s3:// URLs (S3 and S3-compatible stores)"
# "name:" as a path's first component, not followed by "//": a URL with its slashes lost. Only
# well-known URL schemes count, so that an ordinary directory such as "run:3" stays a directory.
_MALFORMED = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(?!//)/*(.*)$", re.DOTALL)
_KNOWN_SCHEMES = frozenset({"s3", "file", "gs", "gcs", "az", "abfs", "abfss", "adl", "wasb", "wasbs", "hf",
                            "hdfs", "http", "https", "ftp", "sftp", "ssh", "oss", "cos", "r2", "swift"})
S3_EXTRA = "pip install 'ckptguard[s3]'"


def is_s3_url(root: str | os.PathLike[str]) -> bool:
    m = _URL.match(os.fspath(root))
    return m is not None and m.group(1).lower() == "s3"


def url_scheme(root: str | os.PathLike[str]) -> str:
    """The scheme of a root a backend was opened for: "s3", or "file" for a local path."""
    return "s3" if is_s3_url(root) else "file"


def _refuse_malformed(text: str) -> None:
    m = _MALFORMED.match(text)
    if m is None or m.group(1).lower() not in _KNOWN_SCHEMES:
        return
    scheme, rest = m.group(1).lower(), m.group(2)
    meant = f"file:///{rest}" if scheme == "file" else f"{scheme}://{rest}"
    raise UnsupportedStorageError(
        f"{text} looks like a {scheme}:// URL with its slashes lost; did you mean {meant}? "
        f"(nothing was created; a local directory whose name starts with '{m.group(1)}:' can be given as "
        f"./{text})", path=text)


def require_s3_extra(text: str) -> None:
    """Raise the error that names the install line when the ``[s3]`` extra is missing."""
    try:
        importlib.import_module("boto3")
        importlib.import_module("botocore.exceptions")
    except ImportError as e:
        raise UnsupportedStorageError(
            f"{text}: s3:// roots need the optional S3 dependencies (boto3, botocore), which are not "
            f"installed: {S3_EXTRA}  ({e})", path=text) from None


def _file_url_path(text: str, rest: str) -> str:
    """The path of a ``file://`` URL (RFC 8089): an authority other than empty or ``localhost`` is another
    host, which this process cannot write to, so it is refused rather than read as ``./host/...``."""
    if not rest:
        raise UnsupportedStorageError(
            f"{text}: a file:// URL with no path (it would be the filesystem root) is not a checkpoint root; "
            "write file:///path/to/ckpts (nothing was created)", path=text)
    authority, slash, path = rest.partition("/")
    if authority.lower() not in ("", "localhost"):
        raise UnsupportedStorageError(
            f"{text}: a file:// URL names a path on host {authority!r}; ckptguard only writes to this machine. "
            f"For a local path write file:///{rest} or the path itself (nothing was created).", path=text)
    return slash + path


def _checked_local(path: str, text: str) -> str:
    """``path`` with ``~`` expanded as a shell would; an empty path or the filesystem root is refused: both
    are almost always a mistake (an unset variable, ``file://`` with no path) that would write checkpoints
    into the working directory or ``/``."""
    if path.startswith("~"):
        expanded = os.path.expanduser(path)
        if expanded.startswith("~"):
            raise UnsupportedStorageError(
                f"{text}: cannot expand {path.split(os.sep)[0]!r} (no such user or no HOME); give the full "
                "path (nothing was created)", path=text)
        path = expanded
    if not path:
        raise UnsupportedStorageError(
            f"{text!r}: an empty path is not a checkpoint root (an unset variable?); give a directory, "
            "e.g. ./ckpts for one in the working directory (nothing was created)", path=text)
    if os.path.abspath(path) == os.path.abspath(os.sep):
        raise UnsupportedStorageError(
            f"{text}: the filesystem root is not a checkpoint root; give a directory below it "
            "(nothing was created)", path=text)
    return path


def local_path(root: str | os.PathLike[str]) -> str:
    """``root`` as a local filesystem path; a URL of any other scheme, or a malformed one, is refused.

    ``~`` and ``~user`` are expanded as a shell would. Refused too: an empty path, the filesystem root
    (``/``, ``file://``, ``file:///``) and a ``file://`` URL naming another host.
    """
    text = os.fspath(root)
    m = _URL.match(text)
    if m is None:
        _refuse_malformed(text)
        return _checked_local(text, text)
    if m.group(1).lower() == "file":
        return _checked_local(_file_url_path(text, m.group(2)), text)
    if m.group(1).lower() == "s3":
        raise UnsupportedStorageError(f"{text} is an object store URL; this operation needs a local path",
                                      path=text)
    raise UnsupportedStorageError(
        f"{text}: no storage backend for {m.group(1)}:// URLs in this ckptguard (supported: {SUPPORTED}). "
        "It was not treated as a local directory.", path=text)


def filesystem_path(path: str | os.PathLike[str]) -> str | None:
    """``path`` as a path on a local filesystem (lock files, rename in place, ranks that may or may not share
    it), or None where it names an object in a store every rank reaches (no locks, no rename: one PUT
    replaces it). Refused as :func:`local_path` refuses: a malformed URL or a scheme without a backend."""
    return None if is_s3_url(path) else local_path(path)


def open_storage(root: str | os.PathLike[str], options: Mapping[str, Any] | None = None) -> StorageBackend:
    """The storage backend for a checkpoint root given as a directory or a URL.

    ``options`` configure an object store (for ``s3://``: ``endpoint_url``,
    ``region_name``, ``part_size``... see :class:`ckptguard.storage.s3.S3Options`).
    """
    text = os.fspath(root)
    if is_s3_url(text):
        require_s3_extra(text)  # boto3 is an extra; ckptguard.storage.s3 imports it only when used
        from ckptguard.storage.s3 import S3Storage

        return S3Storage("s3://" + text[5:], dict(options) if options else None)
    path = local_path(text)
    if options:
        raise ValueError(f"storage_options {sorted(options)} apply to object stores, not to the local path {path}")
    return PosixStorage(path)
