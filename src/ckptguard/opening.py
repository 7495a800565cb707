"""Opening a Checkpointer's root with its settings: the checks that need the root, then the session.

Everything a setting or the root's kind can refuse is refused here, before the first collective: an
unknown URL scheme, a root that is a file. A read_only root that does not exist is opened (there is
nothing to load) with a warning, since it is most often a typo.
"""

from __future__ import annotations

import logging
import os

from ckptguard.arguments import check_root
from ckptguard.comm import Comm, LocalTransport, default_comm
from ckptguard.errors import CheckpointError
from ckptguard.protocol.root import open_root
from ckptguard.protocol.session import Session, open_session
from ckptguard.settings import CheckpointerSettings, combine

log = logging.getLogger("ckptguard")


def open_checkpointer(
    root: str | os.PathLike[str], settings: CheckpointerSettings
) -> tuple[CheckpointerSettings, Session]:
    """Open ``root`` with ``settings``: collective over the settings' process group.

    Args:
        root: A directory or a URL of a registered storage scheme.
        settings: Validated settings (``checksum=None``: the storage's default).

    Returns:
        The settings with the checksum resolved, and the root's session (its lease taken unless read_only).

    Raises:
        TypeError: ``root`` is neither a path nor a URL.
        UnsupportedStorageError: ``root`` is a URL of a scheme with no backend.
        CheckpointError: ``root`` is a file (LeaseHeldError: another job holds its lease).
    """
    check_root(root)
    croot = open_root(root, settings.storage_options)  # refuses unknown URL schemes before any collective
    storage = croot.storage
    settings = combine(settings, {"checksum": settings.checksum or croot.default_checksum})
    location = croot.location()
    if location == "not a directory":
        raise CheckpointError(
            f"the root {storage.root} is a file, not a directory: a checkpoint root is a "
            "directory (a new one is created where nothing exists yet). Give the directory "
            "the checkpoints are in, or load a single file with ckptguard.load_file",
            path=storage.root,
        )
    if settings.read_only and location == "missing":
        log.warning(
            "ckptguard: the read_only root %s does not exist: there is nothing to load or list (a typo in the path?)",
            storage.root,
        )
    group = settings.process_group
    comm = (
        Comm(LocalTransport())
        if isinstance(group, str) and group == "local"
        else default_comm(group, settings.collective_timeout_s)
    )
    session = open_session(
        comm,
        croot,
        settings.options(croot.default_checksum),
        read_only=settings.read_only,
        job_id=settings.job_id,
        lease_ttl_s=settings.lease_ttl_s,
        lease_wait_s=settings.lease_wait_s,
    )
    return settings, session
