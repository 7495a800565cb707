"""The driver side of the model-based test: worker processes, storage backends, S3 fault kinds.

A :class:`Worker` is one long-lived process running ``worker.serve``; commands go down a pipe and
one reply per command comes back. Workers are forked from a forkserver that imported torch and
ckptguard once, so replacing a worker killed by SIGKILL costs a fork, not a Python start-up.

The backends give each example a fresh root and an auditor: a read-only Checkpointer in the
driver's process that checks the root against the model. On S3 the auditor talks to moto
directly, past the fault proxy, so an injected fault never blurs what the root holds.

S3 faults are named kinds in :data:`S3_FAULTS`, each a function that sets the proxy up and
returns the function that undoes it (5xx answers, lost replies, stale listings, frozen requests,
dropped and reset connections); the state machine draws from the table.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from tests.support.beds.s3 import FaultProxy, Request, S3Bed


class WorkerDied(RuntimeError):
    """The worker process exited (or stopped answering) when a reply was expected."""


def _context() -> Any:
    """A forkserver that has imported torch and ckptguard: every worker is a cheap fork of it."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "__main__",
            "torch",
            "ckptguard.checkpointer",
            "ckptguard.storage.s3",
            "tests.support.beds.s3",
            "tests.support.model.worker",
        ]
    )
    return ctx


class Worker:
    """One worker process; at most one command in flight."""

    def __init__(self, log_dir: Path) -> None:
        from tests.support.model.worker import serve

        self.log_path = log_dir / f"worker-{uuid.uuid4().hex[:8]}.log"
        ctx = _context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, str(self.log_path)), daemon=True)
        self.proc.start()
        child.close()
        self.in_flight: dict[str, Any] | None = None
        self.stopped = False

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def alive(self) -> bool:
        return bool(self.proc.is_alive())

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.in_flight is None, f"worker {self.pid} already runs {self.in_flight}"
        self.in_flight = cmd
        try:
            self.conn.send(cmd)
        except OSError as e:
            raise WorkerDied(f"worker {self.pid} is gone: {e} (log {self.log_path})") from e

    def poll(self, timeout: float) -> dict[str, Any] | None:
        """The reply to the command in flight, or None if none came within ``timeout`` seconds."""
        try:
            if not self.conn.poll(timeout):
                return None
            out = self.conn.recv()
        except (EOFError, OSError) as e:
            raise WorkerDied(
                f"worker {self.pid} exited with {self.proc.exitcode} (log {self.log_path}):\n" + self.log_tail()
            ) from e
        self.in_flight = None
        return dict(out)

    def call(self, cmd: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        self.send(cmd)
        out = self.poll(timeout)
        if out is None:
            raise WorkerDied(f"worker {self.pid} did not answer {cmd} in {timeout:.0f} s (log {self.log_path})")
        return out

    def kill(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(timeout=30)
        self.in_flight = None
        self.stopped = False
        self.conn.close()

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self.stopped = False

    def exit(self) -> None:
        if self.alive():
            if self.stopped:
                self.cont()
            try:
                if self.in_flight is None or self.poll(60) is not None:
                    self.call({"op": "exit"}, timeout=60)
                    self.proc.join(timeout=30)
            except WorkerDied:
                pass
        self.kill()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class WorkerPool:
    """Hands out workers: one given back idle (its Checkpointer closed) if there is one, else a new fork.

    Workers do not depend on the backend (an S3 root's endpoint travels in ``storage_options``), so
    one pool serves both backends of a run.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.idle: list[Worker] = []
        self.started = 0

    def give_back(self, w: Worker) -> None:
        self.idle.append(w)

    def take(self) -> Worker:
        while self.idle:
            w = self.idle.pop()
            if w.alive():
                return w
        self.started += 1
        return Worker(self.log_dir)

    def close(self) -> None:
        for w in self.idle:
            w.exit()
        self.idle.clear()


# -- S3 fault kinds ----------------------------------------------------------------------------------
Undo = Callable[[], None]


def _proxy_faults(rate: float, kinds: list[str]) -> Callable[[FaultProxy], Undo]:
    def apply(proxy: FaultProxy) -> Undo:
        proxy.fail_rate, proxy.kinds = rate, list(kinds)

        def undo() -> None:
            proxy.fail_rate, proxy.kinds = 0.0, ["500", "503", "500-after", "slow"]

        return undo

    return apply


def _hidden_listing(proxy: FaultProxy) -> Undo:
    proxy.hide_listing_s = 30.0

    def undo() -> None:
        proxy.hide_listing_s = 0.0

    return undo


# Which requests a rule picks. Control objects are the small ones every decision reads or swaps: the
# lease, the index, `latest`, tags, and the commit objects (a step's MANIFEST.json); data objects are an
# attempt's tensors under the staging prefix.
_CONTROL = re.compile(r"/(\.ckptguard/(index|lease)\.json|latest|tags/[^/]+|step-\d+(\.v\d+)?/MANIFEST\.json)$")


def is_control(r: Request) -> bool:
    return _CONTROL.search(r.path) is not None


def is_data(r: Request) -> bool:
    return "/.ckptguard/staging/" in r.path


def is_commit_put(r: Request) -> bool:
    """The create of a commit object (or of the tombstone that settles an unanswered one: same key)."""
    return r.method == "PUT" and r.path.endswith("/MANIFEST.json")


def _rule(
    match: Callable[[Request], bool], action: str, times: int | None = None, rate: float = 1.0
) -> Callable[[FaultProxy], Undo]:
    """A proxy rule for as long as the fault lasts; undoing it thaws what it froze (those requests land
    now, late: after the client gave up on them and perhaps after its retries did)."""

    def apply(proxy: FaultProxy) -> Undo:
        pick = match
        if rate < 1.0:
            with proxy.lock:
                rng = random.Random(proxy.rng.random())

            def pick(r: Request) -> bool:
                return match(r) and rng.random() < rate

        rule = proxy.add_rule(pick, action, times=times)

        def undo() -> None:
            with proxy.lock:
                if rule in proxy.rules:
                    proxy.rules.remove(rule)
            if action == "freeze":
                proxy.thaw()
                proxy.settled()

        return undo

    return apply


S3_FAULTS: dict[str, Callable[[FaultProxy], Undo]] = {
    "5xx": _proxy_faults(0.3, ["500", "503"]),  # retried by botocore, mostly absorbed
    "outage": _proxy_faults(1.0, ["500", "503"]),  # every request refused: operations fail
    "lost-replies": _proxy_faults(0.3, ["500-after"]),  # applied upstream, answered 500
    "lost-all-replies": _proxy_faults(1.0, ["500-after"]),  # applied, and every retry's reply lost too
    "slow": _proxy_faults(0.5, ["slow"]),
    "hidden-listing": _hidden_listing,  # listings omit keys written in the last 30 s
    # Frozen requests: held unanswered and not forwarded until the fault ends, then forwarded (they land
    # late, after the client's read timeout gave up on them). The first two, so that a retry gets through
    # and the frozen try lands behind it; or every commit create (and the tombstone that would settle it):
    # a commit whose outcome the writer cannot learn, decided only when the frozen creates land.
    "freeze-control": _rule(is_control, "freeze", times=2),
    "freeze-data": _rule(is_data, "freeze", times=2),
    "freeze-commit": _rule(is_commit_put, "freeze"),
    # Dropped connections: the request is applied upstream, then the connection closes with no answer
    # (30 % of all requests, or every commit create: a commit that landed and whose every reply is lost);
    # reset: the connection closes at once, nothing forwarded.
    "drop": _rule(lambda r: True, "drop", rate=0.3),
    "drop-commit": _rule(is_commit_put, "drop"),
    "reset": _rule(lambda r: True, "reset", rate=0.3),
}


# -- backends --------------------------------------------------------------------------------------
# Control requests time out after 3 s (of the library's 10 s default), so that a frozen one costs
# seconds of the test's time, not half a minute.
WRITER_OPTIONS_S3 = {
    "part_size": 5 << 20,
    "max_attempts": 3,
    "connect_timeout_s": 2.0,
    "read_timeout_s": 10.0,
    "control_read_timeout_s": 3.0,
    "max_concurrency": 4,
}


class Backend:
    """Where the roots live; POSIX by default."""

    name = "posix"
    faults: ClassVar[dict[str, Callable[[FaultProxy], Undo]]] = {}

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._undo: Undo | None = None

    def new_root(self) -> str:
        path = self.workdir / f"root-{uuid.uuid4().hex[:10]}"
        return str(path)

    def storage_options(self) -> dict[str, Any] | None:
        return None

    def auditor(self, root: str) -> Any:
        from ckptguard import Checkpointer

        return Checkpointer(root, process_group="local", read_only=True)

    def fault_on(self, kind: str) -> None:
        raise NotImplementedError("POSIX has no injected storage faults here")

    def fault_off(self) -> None:
        pass

    @property
    def fault_active(self) -> bool:
        return self._undo is not None

    @property
    def settling(self) -> bool:
        """Requests are held by the store's path and may still land (frozen ones): the root may change
        with no client acting, so what it shows now decides nothing."""
        return False

    def remove_root(self, root: str) -> None:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


class S3Backend(Backend):
    """Roots under one bucket of the moto bed; workers go through the fault proxy, the auditor does not."""

    name = "s3"
    faults: ClassVar[dict[str, Callable[[FaultProxy], Undo]]] = S3_FAULTS

    def __init__(self, workdir: Path, bed: S3Bed) -> None:
        super().__init__(workdir)
        self.bed = bed
        self.bucket = bed.make_bucket(f"model-{uuid.uuid4().hex[:12]}")

    def new_root(self) -> str:
        return f"s3://{self.bucket}/root-{uuid.uuid4().hex[:10]}"

    def storage_options(self) -> dict[str, Any] | None:
        return {**WRITER_OPTIONS_S3, "endpoint_url": self.bed.endpoint}

    def auditor(self, root: str) -> Any:
        from ckptguard import Checkpointer

        return Checkpointer(
            root,
            process_group="local",
            read_only=True,
            storage_options={"endpoint_url": self.bed.moto.url, "part_size": 5 << 20},
        )

    @property
    def settling(self) -> bool:
        proxy = self.bed.proxy
        with proxy.lock:
            return proxy.frozen > 0 or proxy.landing > 0

    def fault_on(self, kind: str) -> None:
        self.fault_off()
        self._undo = self.faults[kind](self.bed.proxy)

    def fault_off(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None

    def remove_root(self, root: str) -> None:
        pass  # a bucket per run; moto's memory goes with the server
