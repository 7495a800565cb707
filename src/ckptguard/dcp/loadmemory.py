"""How much a load may hold in host memory, and how many files it may keep open between its passes.

The verified-bytes budget decides which items a load reads once into memory (in place or staged) and
which it verifies first and reads again into place (the Performance page); the descriptor count decides
which files stay open for that second read and which are spilled to a local file.
"""

from __future__ import annotations

import os
import resource

#: Share of MemAvailable a load may hold per rank of this host when ``memory_bytes`` is None, on
#: storage where a second read is not cheap (object stores: a spill to local disk).
MEMORY_SHARE = 0.5
#: What a load holds per rank when MemAvailable cannot be read.
FALLBACK_MEMORY_BYTES = 256 << 20
#: What a load holds per rank by default on POSIX storage when its bytes would not stay in the page
#: cache between the passes (see ``page_cache_bytes``).
POSIX_MEMORY_BYTES = 256 << 20
#: Share of MemAvailable the bytes of one load (this rank's, times the ranks of the host) may take for
#: the page cache to be trusted to keep them between the verifying pass and the placing one.
PAGE_CACHE_SHARE = 0.5

_FD_MARGIN = 256  # descriptors left to the rest of the process when files are kept open for a load


def available_bytes() -> int | None:
    """MemAvailable now (free memory plus what the kernel can reclaim, the page cache included), or
    None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def auto_memory_bytes(local_ranks: int) -> int:
    """The verified-bytes budget of one rank: a share of the memory available now on this host,
    split between the ranks of the host (the loads of a restarted job run at once)."""
    available = available_bytes()
    if available is None:
        return FALLBACK_MEMORY_BYTES
    return int(available * MEMORY_SHARE) // max(1, local_ranks)


def page_cache_fits(rank_bytes: int, local_ranks: int) -> bool:
    """Whether a load of ``rank_bytes`` on each of ``local_ranks`` ranks of this host can count on the
    page cache keeping what the first pass read until the second: then verifying everything first
    and reading it again into place from the files kept open costs a memory copy from the cache,
    which measured cheaper here than holding the bytes in fresh host memory (the Performance page)."""
    available = available_bytes()
    return available is not None and rank_bytes * max(1, local_ranks) <= available * PAGE_CACHE_SHARE


def keepable_files(wanted: int) -> int:
    """How many files may be kept open for a second read: the soft descriptor limit is raised toward
    the hard one when ``wanted`` needs it; ``_FD_MARGIN`` descriptors stay free for the rest."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + 2 * _FD_MARGIN
    if need > soft:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = _FD_MARGIN
    return max(0, min(wanted, soft - in_use - _FD_MARGIN))


def load_budget(memory_bytes: int | None, rank_bytes: int, local_ranks: int) -> int:
    """The verified-bytes budget of one load: ``memory_bytes`` if given, else (POSIX) 0 when the page cache
    can keep this rank's ``rank_bytes`` between the passes, ``POSIX_MEMORY_BYTES`` when it cannot."""
    if memory_bytes is not None:
        return memory_bytes
    return 0 if page_cache_fits(rank_bytes, local_ranks) else POSIX_MEMORY_BYTES
