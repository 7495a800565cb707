"""pytest fixtures for the beds (skip only when the machine cannot run a bed).

Registered for every test by the root ``conftest.py`` (``pytest_plugins``): a test asks for
``sshfs_bed`` or ``small_fs`` by naming it as a parameter, nothing to import.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .beds.diskfull import small_filesystem
from .beds.sshfs import BedUnavailable, SshfsBed, stale_shared_storage


@pytest.fixture
def sshfs_bed() -> Iterator[SshfsBed]:
    """Two stale-caching sshfs mounts of one directory (5 s caches), torn down after the test."""
    try:
        cm = stale_shared_storage(2)
        bed = cm.__enter__()
    except BedUnavailable as e:
        pytest.skip(f"sshfs bed unavailable: {e}")
    try:
        yield bed
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture
def small_fs() -> Iterator[Path]:
    """An 8 MiB tmpfs, unmounted after the test."""
    try:
        cm = small_filesystem("8m")
        mp = cm.__enter__()
    except BedUnavailable as e:
        pytest.skip(f"small filesystem bed unavailable: {e}")
    try:
        yield mp
    finally:
        cm.__exit__(None, None, None)
