"""A root written by ckptguard before the manifest's schema moved (format version 2, committed in
tests/fuzz/fixtures/v2-root): it still verifies, reads and loads, and its manifest written again
from a save today is the same format."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from ckptguard import Checkpointer
from ckptguard.protocol.manifest import Manifest

from tests.fuzz.mutate import split
from tests.fuzz.support import cli

FIXTURE = Path(__file__).parent / "fixtures" / "v2-root"


def test_a_version_2_root_verifies_reads_and_loads(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    shutil.copytree(FIXTURE, root)
    code, out = cli("verify", str(root))
    assert code == 0 and "safe to resume from: step 1" in out, out
    state: dict[str, Any] = {"w": torch.zeros(2, 3), "b": torch.zeros(2, dtype=torch.int16), "step": 0, "note": ""}
    with Checkpointer(root) as ck:
        assert ck.load(state, files={"cfg": str(tmp_path / "cfg.yaml")}) == 1
        read = ck.read(1)
        assert read is not None and read["note"] == "v2"
        assert ck.metadata(1) == {"loss": 0.25}
    assert torch.equal(state["w"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(state["b"], torch.tensor([1, 2], dtype=torch.int16))
    assert state["step"] == 1 and (tmp_path / "cfg.yaml").read_text() == "lr: 0.1\n"


def test_a_save_today_writes_the_version_2_format_byte_for_byte(tmp_path: Path) -> None:
    """The fixture's state saved again: the same head fields in the same order, the same row section
    byte for byte; only what differs between two saves (attempt, time, host, versions) differs."""
    import runpy

    runpy.run_path(
        str(FIXTURE.parent / "make_v2_root.py"),
        run_name="__main__",
        init_globals={"ROOT": tmp_path / "ck", "CFG": tmp_path / "cfg.yaml"},
    )
    old = (FIXTURE / "step-00000001" / "MANIFEST.json").read_bytes()
    new = (tmp_path / "ck" / "step-00000001" / "MANIFEST.json").read_bytes()
    (old_body, _), (new_body, _) = split(old), split(new)
    assert list(new_body) == list(old_body)
    for volatile in ("attempt", "created_at", "hosts", "versions"):
        old_body.pop(volatile), new_body.pop(volatile)
    assert new_body == old_body
    assert new[new.index(b"\n") + 1 :] == old[old.index(b"\n") + 1 :]
    assert list(Manifest.from_json(new, "MANIFEST.json").items) == list(Manifest.from_json(old, "MANIFEST.json").items)
