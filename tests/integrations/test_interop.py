"""Interop: DCP reads ckptguard checkpoints, export to torch/safetensors/DCP, import of DCP
directories and torch.save files without running code from them."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import ckptguard
from ckptguard import Checkpointer, PerRank

from tests.support.jobs import REPO

SRC = str(REPO / "src")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def saved(tmp_path: Path) -> tuple[Path, nn.Module, dict]:
    m = model()
    extra = {"epoch": 3, "ids": {0: torch.ones(2)}, "arr": np.arange(3)}
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(5, {"model": m, "extra": extra, "rng": PerRank(torch.get_rng_state())})
    return root, m, extra


class _Result:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def cli(*args: str) -> _Result:
    """The command line, in this process (a subprocess per call costs seconds of torch import)."""
    from typer.testing import CliRunner

    from ckptguard.cli import _register, app

    _register()
    r = CliRunner().invoke(app, list(args))
    return _Result(
        r.exit_code,
        r.stdout,
        r.stderr + (repr(r.exception) if r.exception and r.exit_code != 1 and r.exit_code != 2 else ""),
    )


def test_dcp_load_reads_a_ckptguard_checkpoint(tmp_path: Path) -> None:
    root, m, _ = saved(tmp_path)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    sd = {"model": fresh.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=ckptguard.DCPReader(root))
    fresh.load_state_dict(sd["model"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), m.state_dict().values(), strict=True))


def test_dcp_reader_verifies_bytes(tmp_path: Path) -> None:
    root, _, _ = saved(tmp_path)
    for data in (root / "step-00000005" / "data").iterdir():
        raw = bytearray(data.read_bytes())
        for i in range(0, len(raw), 16):
            raw[i] ^= 1
        data.write_bytes(bytes(raw))
    # dcp.load wraps the reader's CorruptCheckpointError in its CheckpointException
    with pytest.raises(BaseException) as info, warnings.catch_warnings():  # CheckpointException is one
        warnings.simplefilter("ignore")
        dcp.load({"model": model().state_dict()}, storage_reader=ckptguard.DCPReader(root / "step-00000005"))
    failures = getattr(info.value, "failures", {})
    assert any(isinstance(f[0], ckptguard.CorruptCheckpointError) for f in failures.values()), info.value


def test_export_to_torch_safetensors_and_dcp(tmp_path: Path) -> None:
    root, m, extra = saved(tmp_path)
    r = cli("export", str(root), str(tmp_path / "out.pt"), "--to", "torch")
    assert r.returncode == 0, r.stderr
    full = torch.load(tmp_path / "out.pt", weights_only=False)  # plain torch.load reads it
    assert full["extra"]["ids"][0].tolist() == [1.0, 1.0] and np.array_equal(full["extra"]["arr"], extra["arr"])
    assert torch.equal(full["model"]["0.weight"], m.state_dict()["0.weight"])
    assert "rng@rank00000" in full
    r = cli("export", str(root), str(tmp_path / "model.safetensors"), "--to", "safetensors", "--key", "model")
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file as st_load

    st = st_load(str(tmp_path / "model.safetensors"))
    assert set(st) == set(m.state_dict()) and torch.equal(st["2.bias"], m.state_dict()["2.bias"])
    r = cli("export", str(root), str(tmp_path / "dcp_out"), "--to", "dcp", "--step", "5")
    assert r.returncode == 0, r.stderr
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(tmp_path / "dcp_out"), str(tmp_path / "via_dcp.pt"))
    via = torch.load(tmp_path / "via_dcp.pt", weights_only=True)
    assert torch.equal(via["model"]["0.weight"], m.state_dict()["0.weight"])
    assert cli("export", str(root), str(tmp_path / "x.pt"), "--step", "9").returncode == 2


def test_import_a_dcp_directory_and_a_torch_save_file(tmp_path: Path) -> None:
    m = model()
    src = tmp_path / "dcp_src"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": m.state_dict(), "meta": {"epoch": 7, "names": ["a", "b"]}}, checkpoint_id=str(src))
    r = cli("import", str(src), str(tmp_path / "ck"), "--step", "7")
    assert r.returncode == 0, r.stderr
    torch.save({"w": torch.arange(4), "step": 9}, tmp_path / "plain.pt")
    assert cli("import", str(tmp_path / "plain.pt"), str(tmp_path / "ck"), "--step", "9").returncode == 0
    with Checkpointer(tmp_path / "ck", read_only=True) as ck:
        got = ck.read(step=7)
        assert got["meta"] == {"epoch": 7, "names": ["a", "b"]}
        assert torch.equal(got["model"]["2.weight"], m.state_dict()["2.weight"])
        assert torch.equal(ck.read(step=9)["w"], torch.arange(4))


class _Boom:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['CKPTGUARD_PWNED']}",))


def test_a_dcp_metadata_pickle_that_would_run_code_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sentinel = tmp_path / "pwned"
    monkeypatch.setenv("CKPTGUARD_PWNED", str(sentinel))
    src = tmp_path / "dcp_src"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(src))
    (src / ".metadata").write_bytes(pickle.dumps(_Boom()))
    r = cli("import", str(src), str(tmp_path / "ck"), "--step", "1")
    assert r.returncode == 1 and "refusing to unpickle" in r.stderr, r.stderr
    assert not sentinel.exists()
    torch.save({"x": _Boom()}, tmp_path / "evil.pt")
    r = cli("import", str(tmp_path / "evil.pt"), str(tmp_path / "ck"), "--step", "2")
    assert r.returncode == 1 and not sentinel.exists(), r.stderr


def test_version_and_python_m() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ckptguard", "--version"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == f"ckptguard {ckptguard.__version__}"


def _rotate_away_before_the_read(monkeypatch: pytest.MonkeyPatch, act) -> None:
    """Run ``act`` once, after the DCP metadata was read and checked and before any data file is read:
    the training job that wrote the directory rotating it out (or rewriting it) in between."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    set_up = FileSystemReader.set_up_storage_reader
    done: list[bool] = []

    def set_up_then_act(self, *args, **kwargs):
        if not done:
            done.append(True)
            act()
        return set_up(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemReader, "set_up_storage_reader", set_up_then_act)


def test_import_of_a_dcp_directory_deleted_between_check_and_read_imports_what_was_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    src = tmp_path / "dcp"
    saved = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(3, 5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({k: v.clone() for k, v in saved.items()}, checkpoint_id=str(src))
    _rotate_away_before_the_read(monkeypatch, lambda: shutil.rmtree(src))
    assert ckptguard.import_checkpoint(src, tmp_path / "root", 5) == ["b", "w"]
    monkeypatch.undo()
    with Checkpointer(tmp_path / "root", read_only=True) as ck:
        got = ck.read(5)
    assert got is not None and all(torch.equal(got[k], v) for k, v in saved.items())


def test_import_of_a_dcp_file_cut_short_while_read_fails_typed_and_imports_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=str(src))
    data = next(p for p in src.iterdir() if p.suffix == ".distcp")
    _rotate_away_before_the_read(monkeypatch, lambda: os.truncate(data, 100))
    with pytest.raises(ckptguard.CorruptCheckpointError, match="changed while it was being read"):
        ckptguard.import_checkpoint(src, tmp_path / "root", 5)
    monkeypatch.undo()
    assert not (tmp_path / "root").exists() or Checkpointer(tmp_path / "root", read_only=True).steps() == []


def test_dcp_reader_of_a_step_retired_before_its_read_says_retired_and_leaves_the_state(tmp_path: Path) -> None:
    """The reader is made (manifest read), then the writer's retention deletes the step, then dcp.load reads:
    StepRetiredError (it was intact, and is gone), not "the checkpoint is incomplete"; nothing placed."""
    with Checkpointer(tmp_path / "root") as ck:
        ck.save(1, {"w": torch.ones(8)})
        ck.save(2, {"w": torch.full((8,), 2.0)})
        reader = ckptguard.DCPReader(tmp_path / "root", 1)
        ck.delete(1)
    from torch.distributed.checkpoint.api import CheckpointException

    state = {"w": torch.full((8,), 7.0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointException) as raised:  # DCP wraps the reader's error
            dcp.load(state, storage_reader=reader)
    assert "StepRetiredError: step 1" in str(raised.value) and "incomplete" not in str(raised.value), raised.value
    assert torch.equal(state["w"], torch.full((8,), 7.0))
