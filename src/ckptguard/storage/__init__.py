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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptguard.errors import UnsupportedStorageError
from ckptguard.storage.base import ObjectStore, ReadHandle, StorageBackend, WriteStream
from ckptguard.storage.posix import PosixStorage

__all__ = [
    "BACKENDS",
    "Backend",
    "ObjectStore",
    "PosixStorage",
    "ReadHandle",
    "StorageBackend",
    "WriteStream",
    "backend_for",
    "check_options",
    "filesystem_path",
    "is_s3_url",
    "local_path",
    "open_storage",
    "require_s3_extra",
    "url_scheme",
]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)
# "name:" as a path's first component, not followed by "//": a URL with its slashes lost. Only
# well-known URL schemes (and every scheme in BACKENDS) count, so that an ordinary directory such as
# "run:3" stays a directory.
_MALFORMED = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(?!//)/*(.*)$", re.DOTALL)
_WELL_KNOWN_SCHEMES = frozenset(
    {
        "gs",
        "gcs",
        "az",
        "abfs",
        "abfss",
        "adl",
        "wasb",
        "wasbs",
        "hf",
        "hdfs",
        "http",
        "https",
        "ftp",
        "sftp",
        "ssh",
        "oss",
        "cos",
        "r2",
        "swift",
    }
)
S3_EXTRA = "pip install 'ckptguard[s3]'"


@dataclass(frozen=True)
class Backend:
    """What ckptguard knows about one URL scheme: everything else (the typo check, the errors, which
    ``Root`` runs the commit protocol on it, which options it takes) is read from here, so that a new
    backend is one entry in :data:`BACKENDS`."""

    scheme: str
    #: Said in errors: what roots of this scheme are.
    what: str
    #: ``(root text, options) -> StorageBackend``; refuses options it does not know (``ValueError``).
    open: Callable[[str, Mapping[str, Any] | None], StorageBackend]
    #: A local filesystem: paths, lock files, rename in place, ``PosixRoot``. Otherwise an object store
    #: with conditional writes (``If-None-Match``, ``If-Match``) and ``ObjectStoreRoot``.
    filesystem: bool
    #: The ``storage_options`` it takes (empty: none).
    option_names: frozenset[str] = frozenset()
    #: Options for one quick request before reading it (``diagnose --checkpoints``): an endpoint that
    #: cannot be reached is said in seconds, not after every request's retries.
    quick_options: Mapping[str, Any] = field(default_factory=dict)
    #: An object store that checks its conditional writes itself (S3: per endpoint and bucket). Any other
    #: object store is probed by ``storage/condprobe.py`` before a job writes to it.
    checks_own_writes: bool = False


def _open_file(text: str, options: Mapping[str, Any] | None) -> StorageBackend:
    path = local_path(text)
    if options:
        raise ValueError(f"storage_options {sorted(options)} apply to object stores, not to the local path {path}")
    return PosixStorage(path)


def _open_s3(text: str, options: Mapping[str, Any] | None) -> StorageBackend:
    require_s3_extra(text)  # boto3 is an extra; ckptguard.storage.s3 imports it only when used
    from ckptguard.storage.s3 import S3Storage

    return S3Storage("s3://" + text[5:], dict(options) if options else None)


_S3_OPTIONS = frozenset(
    {
        "endpoint_url",
        "region_name",
        "profile_name",
        "part_size",
        "max_concurrency",
        "max_attempts",
        "retry_mode",
        "connect_timeout_s",
        "read_timeout_s",
        "control_connect_timeout_s",
        "control_read_timeout_s",
        "control_max_attempts",
        "check_conditional_writes",
    }
)  # S3Options' fields (tests/storage/test_storage.py checks)

#: Every backend, by URL scheme (lower case). A local path without a scheme is ``file``.
BACKENDS: Mapping[str, Backend] = {
    b.scheme: b
    for b in (
        Backend("file", "local paths and file:// URLs", _open_file, filesystem=True),
        Backend(
            "s3",
            "s3:// URLs (S3 and S3-compatible stores)",
            _open_s3,
            filesystem=False,
            option_names=_S3_OPTIONS,
            checks_own_writes=True,
            quick_options={"max_attempts": 1, "connect_timeout_s": 3.0, "read_timeout_s": 10.0},
        ),
    )
}


def _supported() -> str:
    return "; ".join(b.what for b in BACKENDS.values())


def is_s3_url(root: str | os.PathLike[str]) -> bool:
    m = _URL.match(os.fspath(root))
    return m is not None and m.group(1).lower() == "s3"


def backend_for(root: str | os.PathLike[str]) -> Backend:
    """The backend of a root given as a directory or a URL; a scheme without one, or a URL with its
    slashes lost (``s3:/bucket``), is refused (:class:`UnsupportedStorageError`), never a local directory."""
    text = os.fspath(root)
    m = _URL.match(text)
    if m is None:
        _refuse_malformed(text)
        return BACKENDS["file"]
    backend = BACKENDS.get(m.group(1).lower())
    if backend is None:
        raise UnsupportedStorageError(
            f"{text}: no storage backend for {m.group(1)}:// URLs in this ckptguard (supported: {_supported()}). "
            "It was not treated as a local directory.",
            path=text,
        )
    return backend


def url_scheme(root: str | os.PathLike[str]) -> str:
    """The scheme of a root a backend was opened for ("file" for a local path)."""
    return backend_for(root).scheme


def check_options(root: str | os.PathLike[str], options: Mapping[str, Any] | None) -> None:
    """Refuse ``storage_options`` the backend of ``root`` does not take (``ValueError`` naming them and
    the ones it takes), before anything is opened."""
    if not options:
        return
    backend = backend_for(root)
    unknown = sorted(set(options) - backend.option_names)
    if not unknown:
        return
    if not backend.option_names:
        raise ValueError(f"storage_options {unknown} do not apply to {os.fspath(root)} ({backend.what} take none)")
    raise ValueError(
        f"unknown storage_options for {backend.scheme}:// {unknown}; known: {sorted(backend.option_names)}"
    )


def _refuse_malformed(text: str) -> None:
    m = _MALFORMED.match(text)
    if m is None or (m.group(1).lower() not in BACKENDS and m.group(1).lower() not in _WELL_KNOWN_SCHEMES):
        return
    scheme, rest = m.group(1).lower(), m.group(2)
    meant = f"file:///{rest}" if scheme == "file" else f"{scheme}://{rest}"
    raise UnsupportedStorageError(
        f"{text} looks like a {scheme}:// URL with its slashes lost; did you mean {meant}? "
        f"(nothing was created; a local directory whose name starts with '{m.group(1)}:' can be given as "
        f"./{text})",
        path=text,
    )


def require_s3_extra(text: str) -> None:
    """Raise the error that names the install line when the ``[s3]`` extra is missing."""
    try:
        importlib.import_module("boto3")
        importlib.import_module("botocore.exceptions")
    except ImportError as e:
        raise UnsupportedStorageError(
            f"{text}: s3:// roots need the optional S3 dependencies (boto3, botocore), which are not "
            f"installed: {S3_EXTRA}  ({e})",
            path=text,
        ) from None


def _file_url_path(text: str, rest: str) -> str:
    """The path of a ``file://`` URL (RFC 8089): an authority other than empty or ``localhost`` is another
    host, which this process cannot write to, so it is refused rather than read as ``./host/...``."""
    if not rest:
        raise UnsupportedStorageError(
            f"{text}: a file:// URL with no path (it would be the filesystem root) is not a checkpoint root; "
            "write file:///path/to/ckpts (nothing was created)",
            path=text,
        )
    authority, slash, path = rest.partition("/")
    if authority.lower() not in ("", "localhost"):
        raise UnsupportedStorageError(
            f"{text}: a file:// URL names a path on host {authority!r}; ckptguard only writes to this machine. "
            f"For a local path write file:///{rest} or the path itself (nothing was created).",
            path=text,
        )
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
                "path (nothing was created)",
                path=text,
            )
        path = expanded
    if not path:
        raise UnsupportedStorageError(
            f"{text!r}: an empty path is not a checkpoint root (an unset variable?); give a directory, "
            "e.g. ./ckpts for one in the working directory (nothing was created)",
            path=text,
        )
    if os.path.abspath(path) == os.path.abspath(os.sep):
        raise UnsupportedStorageError(
            f"{text}: the filesystem root is not a checkpoint root; give a directory below it (nothing was created)",
            path=text,
        )
    return path


def local_path(root: str | os.PathLike[str]) -> str:
    """``root`` as a local filesystem path; a URL of any other scheme, or a malformed one, is refused.

    ``~`` and ``~user`` are expanded as a shell would. Refused too: an empty path, the filesystem root
    (``/``, ``file://``, ``file:///``) and a ``file://`` URL naming another host.
    """
    text = os.fspath(root)
    backend = backend_for(text)
    if not backend.filesystem:
        raise UnsupportedStorageError(
            f"{text} is a {backend.scheme}:// object store URL; this operation needs a local path", path=text
        )
    m = _URL.match(text)
    if m is None:
        return _checked_local(text, text)
    return _checked_local(_file_url_path(text, m.group(2)), text)


def filesystem_path(path: str | os.PathLike[str]) -> str | None:
    """``path`` as a path on a local filesystem (lock files, rename in place, ranks that may or may not share
    it), or None where it names an object in a store every rank reaches (no locks, no rename: one PUT
    replaces it). Refused as :func:`local_path` refuses: a malformed URL or a scheme without a backend."""
    return local_path(path) if backend_for(path).filesystem else None


def open_storage(root: str | os.PathLike[str], options: Mapping[str, Any] | None = None) -> StorageBackend:
    """The storage backend for a checkpoint root given as a directory or a URL.

    ``options`` configure an object store (for ``s3://``: ``endpoint_url``,
    ``region_name``, ``part_size``... see :class:`ckptguard.storage.s3.S3Options`); the backend
    refuses those it does not take.
    """
    text = os.fspath(root)
    check_options(text, options)
    return backend_for(text).open(text, options)
