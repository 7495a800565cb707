"""The patch proposed in OLMo #894: only global rank 0 does the directory work.

Other nodes just pass the barriers and write into ``stepN-tmp`` (after OLMo's
``wait_for``). Run with torchrun; see ``_olmo.py`` for the protocol.
"""

from __future__ import annotations

import torch.distributed as dist
from _olmo import main


def is_global_rank_0() -> bool:
    """``get_global_rank() == 0`` instead of ``get_fs_local_rank() == 0``."""
    return dist.get_rank() == 0


if __name__ == "__main__":
    main(is_global_rank_0, "global_rank0")
