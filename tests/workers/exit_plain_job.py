"""A torchrun worker that checkpoints and exits without destroy_process_group(), as many scripts do.

Its own atexit handler is registered before ckptguard is imported, so it runs after ckptguard's
(atexit runs handlers last-registered first) and reports whether the default group was still alive.
"""

from __future__ import annotations

import atexit
import sys


def _after_ckptguard() -> None:
    import torch.distributed as dist

    from tests.support.results import emit_result

    emit_result(initialized_after_exit_handlers=dist.is_initialized())


atexit.register(_after_ckptguard)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ckptguard  # noqa: E402

dist.init_process_group("gloo")
ck = ckptguard.Checkpointer(sys.argv[1])
ck.save(1, {"w": torch.ones(1 << 12)}, blocking=sys.argv[2] == "blocking")
