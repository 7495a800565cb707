"""`ls`, `verify` and `export` beside a live job whose retention retires steps while they read.

A real writer (a subprocess saving with keep_last=1 in a loop) runs while the commands run
repeatedly through the real command line: a retired step is never reported as damaged, a
step committed between two listings never crashes a command.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

WRITER = textwrap.dedent("""
    import sys, torch
    from ckptguard import Checkpointer
    root, stop = sys.argv[1], sys.argv[2]
    import os
    with Checkpointer(root, keep_last=1) as ck:
        step = 0
        while not os.path.exists(stop):
            step += 1
            ck.save(step, {"w": torch.full((64, 1024), float(step)), "n": step}, metadata={"step": step})
""")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptguard.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def live_root(tmp_path: Path) -> Iterator[Path]:
    root, stop = tmp_path / "ckpt", tmp_path / "stop"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(stop)])
    try:
        deadline = time.monotonic() + 60
        while not any(root.glob("step-*/MANIFEST.json")):
            assert writer.poll() is None and time.monotonic() < deadline, "the writer never committed a step"
            time.sleep(0.05)
        yield root
    finally:
        stop.touch()
        try:
            writer.wait(timeout=60)
        finally:
            if writer.poll() is None:
                writer.kill()
    assert writer.returncode == 0


def test_ls_verify_export_beside_a_retiring_writer(live_root: Path, tmp_path: Path) -> None:
    for i in range(2):  # text, then --json
        out = cli("ls", str(live_root), "--json")
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert all(c["manifest_error"] is None for c in doc["checkpoints"]), doc
        out = cli("verify", str(live_root), *(["--json"] if i % 2 else []))
        assert out.returncode == 0, out.stdout + out.stderr
        assert "MANIFEST.json is missing" not in out.stdout and "NOT INTACT" not in out.stdout
        assert "Traceback" not in out.stderr and "KeyError" not in out.stderr
        if i % 2:
            assert json.loads(out.stdout)["intact"] is True
        target = tmp_path / f"export-{i}.pt"
        out = cli("export", str(live_root), str(target))
        assert out.returncode == 0, out.stderr
        assert target.stat().st_size > 0


def test_verify_a_step_retired_mid_read_is_retired_not_damaged(tmp_path: Path) -> None:
    """Deterministic: the step goes between the listing and the read of its bytes."""
    import torch

    from ckptguard import Checkpointer
    from ckptguard.protocol.layout import CheckpointName
    from ckptguard.verify import list_root, verify_checkpoint

    root = tmp_path / "ckpt"
    with Checkpointer(root, keep_last=1) as ck:
        ck.save(1, {"w": torch.ones(10)})
        listing = list_root(str(root))
        ck.save(2, {"w": torch.ones(10)})  # retires step 1
    (only,) = [c for c in listing.checkpoints if c.current]
    result = verify_checkpoint(str(root), CheckpointName(only.step, only.version))
    assert result.retired and not result.problems, result


def test_ls_shows_a_dead_holders_lease_stale_at_once(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    code = textwrap.dedent(f"""
        import os, torch
        from ckptguard import Checkpointer
        ck = Checkpointer({str(root)!r})
        ck.save(1, {{"w": torch.ones(4)}})
        os._exit(0)  # dies holding the lease
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    out = cli("ls", str(root))
    assert out.returncode == 0, out.stderr
    assert "stale" in out.stdout and "held by" not in out.stdout, out.stdout
    from ckptguard.verify import list_root

    lease = list_root(str(root)).to_json()["lease"]  # what `ls --json` prints
    assert lease["live"] is False and lease["holder_gone"] is True and lease["pid"] > 0


def test_a_step_directory_left_without_its_manifest_is_damaged_not_retired(tmp_path: Path) -> None:
    """A retirement takes the whole directory away; a directory that stays without its manifest was damaged."""
    import torch

    from ckptguard import Checkpointer
    from ckptguard.protocol.layout import CheckpointName
    from ckptguard.verify import verify_checkpoint

    root = tmp_path / "ckpt"
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.ones(10)})
    (root / "step-00000001" / "MANIFEST.json").unlink()
    result = verify_checkpoint(str(root), CheckpointName(1))
    assert not result.retired and not result.intact and result.problems[0].kind == "manifest"
