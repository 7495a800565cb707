"""Logs saved as UTF-16, with or without a byte-order mark (some Windows tools write none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptguard.diagnose.engine import diagnose
from ckptguard.diagnose.ingest import UsageError

LOG = (
    "[rank0]: step 812 | loss 2.31\r\n"
    "[rank1]: Traceback (most recent call last):\r\n"
    '[rank1]:   File "C:\\work\\train.py", line 377, in main\r\n'
    "[rank1]:     loss = model(batch).loss\r\n"
    "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 1 has a total "
    "capacity of 79.15 GiB of which 1.21 GiB is free.\r\n"
)
ENCODINGS = {
    "le-bom": ("utf-16-le", "\ufeff"),
    "be-bom": ("utf-16-be", "\ufeff"),
    "le": ("utf-16-le", ""),
    "be": ("utf-16-be", ""),
}


@pytest.mark.parametrize("big", [False, True], ids=["paste", "printed"])
@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
def test_utf16_log_is_read(tmp_path: Path, encoding: str, big: bool) -> None:
    codec, bom = ENCODINGS[encoding]
    # a printed log is larger than a paste: it is read line by line, not normalised whole
    text = bom + ("[rank0]: step 1 | loss 2.50 | lr 3e-4 | tokens/s 81234\r\n" * 40000 if big else "") + LOG
    (tmp_path / "train.log").write_bytes(text.encode(codec))
    d = diagnose([str(tmp_path / "train.log")])
    assert (d.kind, d.initiating_rank) == ("cuda_oom", 1), d.notes
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank_1.log").write_bytes(
        (bom + LOG.replace("[rank0]: ", "").replace("[rank1]: ", "")).encode(codec)
    )
    d = diagnose([str(tmp_path / "logs")])
    assert (d.kind, d.initiating_rank) == ("cuda_oom", 1), d.notes


def test_binary_with_nul_bytes_is_still_refused(tmp_path: Path) -> None:
    # every other byte NUL, but the bytes between are not text: not a UTF-16 log
    (tmp_path / "weights.log").write_bytes(bytes(b for i in range(8192) for b in (i * 37 % 256 | 0x80, 0)))
    with pytest.raises(UsageError, match="binary"):
        diagnose([str(tmp_path / "weights.log")])
