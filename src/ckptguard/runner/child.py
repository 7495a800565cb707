"""Running the user's command as a child: streams passed through byte for byte, signals forwarded.

Each of stdout and stderr is connected to the child through a pipe, or, when the runner's own
stream is a terminal, through a pseudo-terminal of the same window size (so the child sees a
terminal and keeps its colours and progress bars). The pseudo-terminal's output processing is
off, so the bytes read from it are the bytes the child wrote; the real terminal does its own.

The child leads its own session and process group: a signal sent to the runner (Ctrl-C in the
terminal, SLURM's SIGTERM before the time limit, SIGHUP when the terminal goes) is forwarded to
that whole group, so launchers and their workers get it once, as if they had been sent it
directly. The runner itself never dies of them: it keeps passing output through until the child
has exited, then returns the child's status.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import selectors
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

from ckptguard.runner.capture import StreamCapture

if TYPE_CHECKING:
    from ckptguard.runner.hang import HangWatch

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
READ_BYTES = 1 << 16
#: After the child exits, how long output still held open by its leftover processes is passed on.
DRAIN_AFTER_EXIT_S = 5.0
#: After the child exits, how long the streams may be quiet before the rest is handed off.
IDLE_AFTER_EXIT_S = 0.5
FLUSH_EVERY_S = 0.5


class CommandNotFound(Exception):
    """The command does not exist (status 127) or cannot be executed (status 126)."""

    def __init__(self, command: str, status: int, reason: str) -> None:
        super().__init__(f"{command}: {reason}")
        self.status = status


@dataclass
class ChildResult:
    status: int  # the child's exit status; 128 + N when signal N ended it
    signals_forwarded: list[int]
    started_at: float
    ended_at: float
    #: The signal that ended the child itself (its process, not a status it chose), or None.
    signal: int | None = None
    #: The reader of one of the runner's streams went away (``| head``), so the child's end was closed.
    reader_gone: bool = False


def exit_status(returncode: int) -> int:
    """A shell's view of a Popen return code: 128 + N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _winsize(fd: int) -> bytes | None:
    try:
        return fcntl.ioctl(fd, termios.TIOCGWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    except OSError:
        return None


def _open_pty(like_fd: int) -> tuple[int, int]:
    """A pseudo-terminal (master, slave) with ``like_fd``'s window size and no output processing."""
    master, slave = os.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST  # the child's "\n" stays "\n": the real terminal adds its own "\r"
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    size = _winsize(like_fd)
    if size is not None:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, size)
    return master, slave


class _Out:
    """One stream from the child: where it is read, where it goes, where it is kept."""

    def __init__(self, read_fd: int, out_fd: int, capture: StreamCapture, is_pty: bool) -> None:
        self.read_fd, self.out_fd, self.capture, self.is_pty = read_fd, out_fd, capture, is_pty
        self.out_open = True

    def pump(self) -> bool:
        """Pass on one read; False at the end of the stream, or when our reader went away (then
        the child's end is closed, so its next write fails as it would without the runner)."""
        try:
            data = os.read(self.read_fd, READ_BYTES)
        except OSError as e:
            if e.errno == errno.EIO and self.is_pty:  # every slave closed: the pty's end of file
                return False
            if e.errno in (errno.EAGAIN, errno.EINTR):
                return True
            raise
        if not data:
            return False
        self.capture.write(data)
        self._write_all(data)
        return self.out_open

    def close(self) -> None:
        """Close our read end (once)."""
        if self.read_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.read_fd)
            self.read_fd = -1

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.out_fd, view)
            except InterruptedError:
                continue
            except BlockingIOError:  # our stream was left non-blocking by someone: wait for room
                time.sleep(0.001)
                continue
            except OSError:  # our reader went away (EPIPE): stop passing on
                self.out_open = False
                return
            view = view[n:]


def run_child(
    argv: Sequence[str],
    env: Mapping[str, str],
    stdout: StreamCapture,
    stderr: StreamCapture,
    on_start: Callable[[int], None] | None = None,
    watch: HangWatch | None = None,
) -> ChildResult:
    """Run ``argv`` to its end, passing its output through and keeping it; return its status.
    ``watch`` (--hang-timeout) is told of every output and may stop a job that makes no progress.

    Raises CommandNotFound before anything runs when ``argv[0]`` cannot be executed.
    """
    if not argv or not argv[0]:
        raise CommandNotFound(argv[0] if argv else "", 127, "command not found")
    ours = (1, 2)
    masters: list[int] = []
    child_ends: list[int] = []
    for fd in ours:
        if os.isatty(fd):
            m, s = _open_pty(fd)
        else:
            m, s = os.pipe()
        masters.append(m)
        child_ends.append(s)
    forwarded: list[int] = []
    proc: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: FrameType | None) -> None:
        forwarded.append(signum)
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signum)

    def resize(_signum: int, _frame: FrameType | None) -> None:
        for fd, m, out in zip(ours, masters, outs, strict=True):
            size = _winsize(fd)
            if out.is_pty and size is not None:
                with contextlib.suppress(OSError):
                    fcntl.ioctl(m, termios.TIOCSWINSZ, size)
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGWINCH)

    outs = [_Out(masters[0], 1, stdout, os.isatty(1)), _Out(masters[1], 2, stderr, os.isatty(2))]
    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    previous[signal.SIGWINCH] = signal.signal(signal.SIGWINCH, resize)
    started = time.time()
    try:
        try:
            proc = subprocess.Popen(
                list(argv),
                env=dict(env),
                stdout=child_ends[0],
                stderr=child_ends[1],
                start_new_session=True,
                close_fds=True,
            )
        except FileNotFoundError as e:
            raise CommandNotFound(argv[0], 127, "command not found") from e
        except PermissionError as e:
            raise CommandNotFound(argv[0], 126, "permission denied (not executable)") from e
        except OSError as e:
            raise CommandNotFound(argv[0], 126, f"cannot execute: {e.strerror or e}") from e
        finally:
            for fd in child_ends:
                os.close(fd)
        if on_start is not None:
            on_start(proc.pid)
        for sig in forwarded:  # a signal that arrived before the child existed
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
        _pump(proc, outs, stdout, stderr, watch)
        ended = time.time()
        assert proc.returncode is not None
        return ChildResult(
            exit_status(proc.returncode),
            forwarded,
            started,
            ended,
            signal=-proc.returncode if proc.returncode < 0 else None,
            reader_gone=any(not o.out_open for o in outs),
        )
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for o in outs:
            o.close()


def _pump(
    proc: subprocess.Popen[bytes],
    outs: list[_Out],
    stdout: StreamCapture,
    stderr: StreamCapture,
    watch: HangWatch | None = None,
) -> None:
    """Pass output on until both streams end, or, once the child has exited, until they have been
    quiet for IDLE_AFTER_EXIT_S (at most DRAIN_AFTER_EXIT_S): streams still held open then by the
    child's leftover processes are handed to a detached forwarder (``_hand_off``)."""
    sel = selectors.DefaultSelector()
    for o in outs:
        sel.register(o.read_fd, selectors.EVENT_READ, o)
    open_outs = list(outs)
    exited_at: float | None = None
    last_data = last_flush = time.monotonic()
    while open_outs:
        events = sel.select(timeout=0.1)
        for key, _ in events:
            out: _Out = key.data
            if not out.pump():
                sel.unregister(key.fd)
                open_outs.remove(out)
                out.close()
        now = time.monotonic()
        if events:
            last_data = now
            if watch is not None:
                watch.output()
        if not events or now - last_flush > FLUSH_EVERY_S:
            stdout.flush()
            stderr.flush()
            last_flush = now
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if watch is not None and (exited_at is None or watch.fired_at is not None):
            watch.check(proc.pid)
        if (
            exited_at is not None
            and not events
            and (now - last_data > IDLE_AFTER_EXIT_S or now - exited_at > DRAIN_AFTER_EXIT_S)
        ):
            break  # a leftover process of the child holds the stream open: do not wait for it
    sel.close()
    if watch is not None:
        watch.finish()
    if open_outs:
        _hand_off(open_outs)
    wait_in_steps(proc)


def wait_in_steps(proc: subprocess.Popen[bytes]) -> None:
    """Wait for ``proc`` in short steps: a signal that arrives just before a blocking wait enters
    its system call is handled only once that call returns, so one unbounded wait could sit on a
    Ctrl-C to be forwarded until the child exits on its own."""
    while proc.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)


def _hand_off(outs: list[_Out]) -> None:
    """Keep passing on what the child's leftover processes write, after the runner is done.

    A detached process (its own session, reparented to init) takes over the read ends and copies
    to the runner's streams until each ends, as if those processes wrote there directly: their
    writes never fail because the runner left, and when a stream's reader goes away the read end
    is closed, so they get EPIPE/SIGPIPE as they would directly. Its bytes are not kept.
    """
    try:
        pid = os.fork()
    except OSError:
        return
    if pid == 0:  # pragma: no cover - runs in the detached forwarder
        code = 0
        try:
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            for s in (*FORWARDED, signal.SIGWINCH):
                signal.signal(s, signal.SIG_IGN if s != signal.SIGWINCH else signal.SIG_DFL)
            _forward_until_eof(outs)
        except BaseException:
            code = 1
        os._exit(code)
    os.waitpid(pid, 0)
    for o in outs:
        o.close()


def _forward_until_eof(outs: list[_Out]) -> None:  # pragma: no cover - runs in the forwarder
    sel = selectors.DefaultSelector()
    for each in outs:
        sel.register(each.read_fd, selectors.EVENT_READ, each)
    left = len(outs)
    while left:
        for key, _ in sel.select():
            o: _Out = key.data
            try:
                data = os.read(o.read_fd, READ_BYTES)
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EINTR):
                    continue
                data = b""
            if data:
                o._write_all(data)
            if not data or not o.out_open:
                sel.unregister(key.fd)
                o.close()
                left -= 1
