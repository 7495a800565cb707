"""The oracle of the manifest fuzzers: every command a user runs on a root whose newest step was
rewritten, and the properties that must hold whatever the rewrite was.

- only ``CheckpointError`` subclasses escape (list, verify, read, export, load);
- verify says intact exactly when ``read`` and ``export`` of that step succeed;
- ``load(step=None)`` gives the newest step when it verifies intact, else falls back to the older one
  (a template or files= that an intact step does not match is a CheckpointError that is not corrupt);
- no allocation beyond the bytes on disk: every manifest that parses declares tensors no larger
  together than its files (a template-free read allocates exactly that), and everything runs under an
  address-space limit a few GiB above the process's own, so an allocation the checks miss fails loudly;
- nothing hangs (an alarm ends an example that takes longer than ``HANG_S``).
"""

from __future__ import annotations

import contextlib
import math
import resource
import shutil
import signal
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from ckptguard import Checkpointer, CheckpointError, CorruptCheckpointError, export_checkpoint
from ckptguard.dcp.records import ITEMSIZES
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import Manifest
from ckptguard.verify import list_root, verify_checkpoint

#: Seconds one example may take before it counts as a hang.
HANG_S = 60
#: Address space an example may add to the process's (a tensor the checks let through would need more).
HEADROOM = 4 << 30


def base_state() -> dict[str, Any]:
    return {"w": torch.arange(8.0), "x": torch.arange(16, dtype=torch.int32).reshape(4, 4), "n": 3}


def make_base(root: Path) -> Path:
    """Step 1 and step 2 of the same state shapes (2's values + 1), each with a file artifact ``cfg``."""
    cfg = root.parent / f"{root.name}-cfg.yaml"
    cfg.write_text("lr: 0.1\n")
    with Checkpointer(root) as ck:
        ck.save(1, base_state(), files={"cfg": str(cfg)})
        ck.save(2, {k: v + 1 for k, v in base_state().items()}, files={"cfg": str(cfg)})
    return root


class Hang(Exception):
    """An example ran longer than HANG_S."""


@contextlib.contextmanager
def bounded(seconds: int = HANG_S, headroom: int = HEADROOM) -> Iterator[None]:
    """Run the body under an alarm and an address-space limit ``headroom`` above the current size."""

    def ring(signum: int, frame: FrameType | None) -> None:
        raise Hang(f"no answer after {seconds} s")

    old_handler = signal.signal(signal.SIGALRM, ring)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_bytes() + headroom
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, old_handler)


def _vm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Outcome:
    parsed: bool
    intact: bool
    read_ok: bool
    export_ok: bool
    loaded: int | None  # the step load(step=None) gave; None: it refused the template or files=


def declared_bytes(m: Manifest) -> int:
    """What a template-free read of ``m`` allocates: every tensor entry of DCP's metadata, whole."""
    total = 0
    for e in m.dcp.get("state_dict", {}).values():
        if e.get("type") == "tensor":
            total += math.prod(e["size"]) * ITEMSIZES.get(e["dtype"], 16)
    return total


def run_commands(root: Path, scratch: Path, step: int = 2) -> Outcome:
    """Every command on ``root`` (whose ``step`` was rewritten); any exception but a CheckpointError
    propagates, and so fails the example."""
    name = CheckpointName(step)
    path = root / name.dirname / "MANIFEST.json"
    parsed = True
    try:
        m = Manifest.from_json(path.read_bytes(), str(path))
    except CheckpointError:
        parsed = False
    else:
        if m.domain_count == 1:
            stored = sum(f.size for f in m.files)
            assert declared_bytes(m) <= stored, f"declares {declared_bytes(m)} bytes, {stored} on disk"
    list_root(str(root))
    intact = verify_checkpoint(str(root), name, threads=1).intact
    read_ok = export_ok = True
    try:
        with Checkpointer(root, read_only=True) as ck:
            ck.read(step)
    except CheckpointError:
        read_ok = False
    try:
        export_checkpoint(root, scratch / "out.pt", "torch", step=step)
    except CheckpointError:
        export_ok = False
    loaded: int | None
    state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in base_state().items()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Checkpointer(root) as ck:
                loaded = ck.load(state, files={"cfg": str(scratch / "cfg.out")})
    except CorruptCheckpointError:
        raise  # step 1 is intact: a load must have fallen back to it
    except CheckpointError:
        loaded = None  # the template (or files=) asks for what an intact step does not hold
    return Outcome(parsed, intact, read_ok, export_ok, loaded)


def check_properties(o: Outcome, step: int = 2) -> None:
    """What must hold between the commands' answers (module docstring)."""
    assert o.parsed or not o.intact, "verify says intact, the manifest does not parse"
    assert o.intact == o.read_ok == o.export_ok, f"verify, read and export disagree: {o}"
    if o.intact:
        assert o.loaded in (step, None), f"an intact newest step, load gave {o.loaded}"
    else:
        assert o.loaded == step - 1, f"a damaged newest step, load gave {o.loaded} instead of falling back"


def kept_until_exit(prefix: str) -> Path:
    """A directory for what every example of this process starts from, removed when it exits."""
    import atexit
    import tempfile

    where = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    return where


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A fresh directory for one example, removed after it."""
    import tempfile

    where = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def fresh_copy(base: Path, where: Path) -> Path:
    if where.exists():
        shutil.rmtree(where)
    shutil.copytree(base, where)
    return where
