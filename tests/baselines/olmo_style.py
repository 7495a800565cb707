"""OLMo #894 as it is: every node's LOCAL_RANK 0 does the directory work (``get_fs_local_rank``).

Run with torchrun; see ``_olmo.py`` for the protocol, ``--help`` for the options.
Exits 1 on the first failed save, printing ``BASELINE FAILED ...`` and the traceback.
"""

from __future__ import annotations

import os

from _olmo import main


def is_fs_local_rank_0() -> bool:
    """OLMo's default without OLMO_SHARED_FS/FS_LOCAL_RANK: one leader per node."""
    return int(os.environ["LOCAL_RANK"]) == 0


if __name__ == "__main__":
    main(is_fs_local_rank_0, "olmo_style")
