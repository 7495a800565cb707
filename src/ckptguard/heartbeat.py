"""The job's side of `ckptguard run --hang-timeout`: a progress signal that is not output
(``ckptguard.runner.heartbeat``; every Checkpointer save and load sends one).

``heartbeat()`` touches the file that the runner named in ``CKPTGUARD_HEARTBEAT``; the runner
counts its modification time as progress, like a line of output. Outside `ckptguard run` (the
variable unset) it does nothing. Standard library only, and at most one ``utime`` per second, so
that it can be called every step or every batch.
"""

from __future__ import annotations

import contextlib
import os
import time

HEARTBEAT_ENV = "CKPTGUARD_HEARTBEAT"
#: The runner's clock is coarser than this: more frequent calls only cost system calls.
MIN_INTERVAL_S = 1.0

_last = 0.0


def heartbeat() -> None:
    """Tell `ckptguard run --hang-timeout` that the job is making progress (a no-op without it).

    Never raises: a heartbeat that cannot be written is a heartbeat missed, not a failure.
    """
    global _last
    path = os.environ.get(HEARTBEAT_ENV)
    if not path:
        return
    now = time.monotonic()
    if now - _last < MIN_INTERVAL_S:
        return
    _last = now
    try:
        os.utime(path)
    except FileNotFoundError:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
    except OSError:
        pass
