"""NFS-like shared storage with stale client caches: several sshfs mounts of one directory.

Why: the OLMo #894 class of races needs what NFS clients do, i.e. each node keeps its
own cached view of names (positive and negative dentries) and attributes for a few
seconds. These machines have no kernel NFS client, but FUSE works. Each sshfs mount
is an independent client with its own kernel dentry/attribute cache and its own
sshfs directory cache, so a directory created through mount A stays invisible through
mount B (if B looked the name up shortly before) for ``cache_timeout`` seconds, and a
removed one stays visible through B for about twice that. All writes go to one server
directory, like an NFS export.

The bed runs its *own* sshd (not the system one): bound to 127.0.0.1 on a free port,
host and client keys generated in a temp dir, key-only login, its own config and pid
file. Everything (mounts, sshd, temp dir) is torn down on exit, also when the test fails.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..jobs import free_port

SSHD = "/usr/sbin/sshd"


class BedUnavailable(RuntimeError):
    """A bed cannot run on this machine (the reason says what is missing)."""


@dataclass
class SshfsBed:
    """One server directory and ``len(mounts)`` independent, stale-caching views of it."""

    server_dir: Path
    """The real directory (the 'NFS server' side); reading it shows the truth."""
    mounts: list[Path]
    """Mount point per simulated node; node ``i`` should only use ``mounts[i]``."""
    cache_timeout: float
    port: int
    mount_options: str
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    def node_env(self, var: str = "CKPT_ROOT", subdir: str = "") -> list[dict[str, str]]:
        """``run_job(node_env=...)`` that points node ``i`` at ``mounts[i]/subdir``."""
        return [{var: str(m / subdir) if subdir else str(m)} for m in self.mounts]


def sshfs_unavailable_reason() -> str | None:
    """Why the sshfs bed cannot run here, or None. Only a missing FUSE/tool counts."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel/container)"
    missing = [
        name
        for name, found in (
            ("sshfs", shutil.which("sshfs")),
            ("fusermount", shutil.which("fusermount3") or shutil.which("fusermount")),
            ("sshd", os.access(SSHD, os.X_OK) and SSHD),
            ("ssh-keygen", shutil.which("ssh-keygen")),
        )
        if not found
    ]
    if missing:
        return f"{', '.join(missing)} not installed (run .ci/install_system_deps.sh)"
    return None


def _fusermount() -> str:
    return shutil.which("fusermount3") or shutil.which("fusermount") or "fusermount"


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


def _start_sshd(tmp: Path, authorized_keys: Path) -> tuple[subprocess.Popen[bytes], int]:
    """Start a foreground sshd on a free loopback port; retries if the port was taken."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "host_key")],
        check=True,
    )
    # sshd refuses to start without its privilege separation directory.
    Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)
    last_log = ""
    for _ in range(3):
        port = free_port()
        config = tmp / "sshd_config"
        config.write_text(
            f"""ListenAddress 127.0.0.1
Port {port}
HostKey {tmp / "host_key"}
PidFile {tmp / "sshd.pid"}
AuthorizedKeysFile {authorized_keys}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
UsePAM no
StrictModes no
X11Forwarding no
AllowTcpForwarding no
Subsystem sftp internal-sftp
MaxStartups 100
LogLevel ERROR
"""
        )
        log = tmp / "sshd.log"
        proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(log, "wb"),  # noqa: SIM115 - the child owns it
            start_new_session=True,
        )
        if _wait_port(port, proc, timeout=10):
            return proc, port
        _stop(proc)
        last_log = log.read_text(errors="replace")
    raise RuntimeError(f"sshd did not start:\n{last_log}")


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def _unmount(mp: Path) -> None:
    """Unmount, falling back to a lazy unmount if the mount is busy."""
    if not os.path.ismount(mp):
        return
    fm = _fusermount()
    if subprocess.run([fm, "-u", str(mp)], capture_output=True).returncode == 0:
        return
    subprocess.run([fm, "-u", "-z", str(mp)], capture_output=True)
    if os.path.ismount(mp):
        subprocess.run(["umount", "-l", str(mp)], capture_output=True)


def _mount(server: str, mp: Path, port: int, key: Path, options: str, log: Path) -> subprocess.Popen[bytes]:
    """One sshfs client in the foreground (so we own its pid), ready when mounted."""
    cmd = [
        "sshfs",
        "-f",
        server,
        str(mp),
        "-p",
        str(port),
        "-o",
        f"IdentityFile={key},IdentitiesOnly=yes,StrictHostKeyChecking=no,"
        "UserKnownHostsFile=/dev/null,BatchMode=yes,LogLevel=ERROR",
        "-o",
        options,
    ]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),  # noqa: SIM115 - the child owns it
        start_new_session=True,
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if os.path.ismount(mp):
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    _stop(proc)
    _unmount(mp)
    raise RuntimeError(f"sshfs mount of {mp} failed:\n{log.read_text(errors='replace')}")


def cache_options(cache_timeout: float) -> str:
    """sshfs/FUSE options that make a mount cache names, attributes and misses.

    ``cache=yes,cache_timeout`` are sshfs's (2.x names, still accepted by 3.7 as aliases
    of ``dir_cache``/``dcache_timeout``); ``entry_timeout``/``attr_timeout``/
    ``negative_timeout`` are the kernel's FUSE caches (negative_timeout defaults to 0, so
    without it a miss is never cached and "created but invisible" cannot happen).
    """
    t = f"{cache_timeout:g}"
    return f"cache=yes,cache_timeout={t},entry_timeout={t},attr_timeout={t},negative_timeout={t}"


@contextlib.contextmanager
def stale_shared_storage(
    n_mounts: int = 2, *, cache_timeout: float = 5, base: Path | None = None
) -> Iterator[SshfsBed]:
    """Start sshd and ``n_mounts`` stale-caching sshfs mounts of one directory.

    Raises :class:`BedUnavailable` only if FUSE or a tool is missing; any other failure
    to start is a real error. Unmounts and stops sshd on exit, whatever happened.
    """
    reason = sshfs_unavailable_reason()
    if reason:
        raise BedUnavailable(reason)
    tmp = Path(tempfile.mkdtemp(prefix="ckptguard-sshfs-", dir=base))
    sshd: subprocess.Popen[bytes] | None = None
    bed: SshfsBed | None = None
    mounts: list[Path] = []
    try:
        key = tmp / "client_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        authorized = tmp / "authorized_keys"
        shutil.copy(tmp / "client_key.pub", authorized)
        authorized.chmod(0o600)
        sshd, port = _start_sshd(tmp, authorized)
        server_dir = tmp / "export"
        server_dir.mkdir()
        options = cache_options(cache_timeout)
        bed = SshfsBed(server_dir, mounts, cache_timeout, port, options)
        for i in range(n_mounts):
            mp = tmp / f"node{i}"
            mp.mkdir()
            bed._procs.append(
                _mount(
                    f"{getpass.getuser()}@127.0.0.1:{server_dir}",
                    mp,
                    port,
                    key,
                    options,
                    tmp / f"sshfs{i}.log",
                )
            )
            mounts.append(mp)
        yield bed
    finally:
        for mp in mounts:
            _unmount(mp)
        if bed is not None:
            for p in bed._procs:
                _stop(p)
        if sshd is not None:
            _stop(sshd)
        if not any(os.path.ismount(m) for m in mounts):
            shutil.rmtree(tmp, ignore_errors=True)
