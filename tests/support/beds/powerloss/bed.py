"""Mount the recording file system, drive its controls, read back what it recorded.

``recording_mount()`` starts ``recordfs.py`` in its own process over a backing directory
and yields a :class:`Mount`; whatever happens in the body, the mount is unmounted
(``fusermount3 -u``, lazily if busy) and the recorder's process group is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .recordfs import CONTROL_PREFIX
from tests.support.beds.sshfs import BedUnavailable

__all__ = ["BedUnavailable", "Mount", "Recording", "control", "recording_mount", "unavailable_reason"]

RECORDFS = Path(__file__).with_name("recordfs.py")


def unavailable_reason() -> str | None:
    """Why the bed cannot run here, or None (only a missing FUSE, tool or binding counts)."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel/container)"
    if not (shutil.which("fusermount3") or shutil.which("fusermount")):
        return "fusermount3 not installed (run .ci/install_system_deps.sh)"
    os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: libfuse3.so.3 missing
        return f"mfusepy unusable ({e}); pip install -r requirements/ci.txt, apt-get install fuse3"
    return None


def control(mountpoint: str | os.PathLike[str], cmd: str, label: str = "") -> None:
    """Send ``cmd`` (start, mark, stop) to the recorder: a lookup of a magic name, answered ENOENT."""
    name = f"{CONTROL_PREFIX}{cmd}-{label}.{uuid.uuid4().hex[:8]}"
    if os.path.lexists(os.path.join(mountpoint, name)):
        raise RuntimeError(f"{mountpoint} is not the recording file system")


@dataclass
class Mount:
    mountpoint: Path
    backing: Path
    logdir: Path
    proc: subprocess.Popen[bytes]

    def control(self, cmd: str, label: str = "") -> None:
        control(self.mountpoint, cmd, label)

    def recording(self, timeout: float = 30.0) -> Recording:
        """The log of the last start..stop (waits for the recorder to write it)."""
        deadline = time.monotonic() + timeout
        while not (self.logdir / "done").exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the recorder wrote no log:\n{self.log_tail()}")
            time.sleep(0.02)
        rec = Recording.load(self.logdir)
        for name in ("done", "ops.jsonl", "initial.json", "data.bin"):
            (self.logdir / name).unlink()
        return rec

    def log_tail(self) -> str:
        p = self.logdir / "recordfs.log"
        return p.read_text(errors="replace")[-4000:] if p.exists() else ""


def _unmount(mp: Path) -> None:
    if not os.path.ismount(mp):
        return
    fm = shutil.which("fusermount3") or shutil.which("fusermount") or "fusermount"
    if subprocess.run([fm, "-u", str(mp)], capture_output=True).returncode == 0:
        return
    subprocess.run([fm, "-u", "-z", str(mp)], capture_output=True)
    if os.path.ismount(mp):
        subprocess.run(["umount", "-l", str(mp)], capture_output=True)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


@contextlib.contextmanager
def recording_mount(base: str | None = None) -> Iterator[Mount]:
    """A fresh backing directory mounted through the recorder; unmounted whatever happens."""
    reason = unavailable_reason()
    if reason:
        raise BedUnavailable(reason)
    tmp = Path(tempfile.mkdtemp(prefix="ckptguard-powerloss-", dir=base))
    backing, mp, logdir = tmp / "backing", tmp / "mnt", tmp / "log"
    for d in (backing, mp, logdir):
        d.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(RECORDFS), str(backing), str(mp), str(logdir)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(logdir / "recordfs.log", "wb"),  # noqa: SIM115 - the child owns it
        start_new_session=True,
    )
    mount = Mount(mp, backing, logdir, proc)
    try:
        deadline = time.monotonic() + 20
        while not os.path.ismount(mp):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the recording file system did not mount:\n{mount.log_tail()}")
            time.sleep(0.02)
        yield mount
    finally:
        _unmount(mp)
        _kill(proc)
        if not os.path.ismount(mp):
            shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class Recording:
    """What the recorder wrote: the durable state at start, the operations, their bytes."""

    initial: dict[str, Any]
    ops: list[dict[str, Any]]
    data: bytes

    @staticmethod
    def load(logdir: Path) -> Recording:
        initial = json.loads((logdir / "initial.json").read_text())
        ops = [json.loads(line) for line in (logdir / "ops.jsonl").read_text().splitlines() if line]
        return Recording(initial, ops, (logdir / "data.bin").read_bytes())

    def blob(self, ref: list[int]) -> bytes:
        off, n = ref
        return self.data[off : off + n]

    def save(self, path: Path) -> None:
        """Keep a recording (e.g. as a regression test's input)."""
        path.mkdir(parents=True, exist_ok=True)
        (path / "initial.json").write_text(json.dumps(self.initial))
        (path / "ops.jsonl").write_text("".join(json.dumps(o) + "\n" for o in self.ops))
        (path / "data.bin").write_bytes(self.data)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.ops:
            out[o["op"]] = out.get(o["op"], 0) + 1
        return out
