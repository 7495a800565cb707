"""One job of the model-based test: a Checkpointer in a long-lived process, driven over a pipe.

Receives one command (a dict) at a time on a pipe and answers each with one dict.
Every state saved is made from ``(step, nonce)`` alone, so the driver knows its digest without
the bytes; a load fills a template of sentinels and reports whether a failed load left it so.
"""

from __future__ import annotations

import hashlib
import os
import sys
import traceback
import warnings
from typing import Any

import torch

N = 48 * 1024  # floats per state: ~192 KiB, a few files, fast on 2 shared cores
SENTINEL = -7.0


def make_state(step: int, nonce: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step * 1_000_003 + nonce)
    return {
        "model": {"w": torch.randn(N, generator=g), "b": torch.randn(257, generator=g)},
        "ids": torch.tensor([step, nonce], dtype=torch.int64),
    }


def template() -> dict[str, Any]:
    return {
        "model": {"w": torch.full((N,), SENTINEL), "b": torch.full((257,), SENTINEL)},
        "ids": torch.full((2,), -1, dtype=torch.int64),
    }


def digest(state: Any) -> str:
    """SHA-256 of every tensor's bytes, in key order (the same for a loaded and a read state)."""
    h = hashlib.sha256()

    def walk(v: Any, path: str) -> None:
        if isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k], f"{path}/{k}")
        elif isinstance(v, torch.Tensor):
            h.update(path.encode())
            h.update(str(v.dtype).encode())
            h.update(v.detach().cpu().contiguous().numpy().tobytes())
        else:
            h.update(f"{path}={v!r}".encode())

    walk(state, "")
    return h.hexdigest()


def expected_digest(step: int, nonce: int) -> str:
    return digest(make_state(step, nonce))


class Job:
    def __init__(self) -> None:
        self.ck: Any = None
        self.sabotage: str | None = None

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from ckptguard import Checkpointer

        op = cmd["op"]
        if op == "ping":
            return {"pid": os.getpid()}
        if op == "exit":
            self._close()
            return {}
        if op == "open":
            if self.ck is not None:
                self._close()
            self.sabotage = cmd.get("sabotage")
            self.ck = Checkpointer(
                cmd["root"],
                process_group="local",
                read_only=cmd.get("read_only", False),
                job_id=cmd.get("job_id"),
                keep_last=cmd.get("keep_last"),
                lease_ttl_s=cmd.get("lease_ttl_s", 30.0),
                lease_wait_s=cmd.get("lease_wait_s"),
                load_memory_bytes=cmd.get("load_memory_bytes"),
                storage_options=cmd.get("storage_options"),
            )
            return {}
        if op == "close":
            self._close()
            return {}
        ck = self.ck
        if ck is None:
            raise RuntimeError("no Checkpointer open")
        if op == "save":
            state = make_state(cmd["step"], cmd["nonce"])
            ck.save(cmd["step"], state, overwrite=cmd.get("overwrite", False))
            if self.sabotage == "lose-data":
                _lose_an_older_step(ck, cmd["step"])
            return {"digest": digest(state)}
        if op == "load":
            state = template()
            before = digest(state)
            try:
                step = ck.load(state, step=cmd.get("step"), tag=cmd.get("tag"))
            except BaseException:
                untouched = digest(state) == before
                raise _LoadFailed(untouched) from None
            return {"step": step, "digest": None if step is None else digest(state)}
        if op == "read":
            got = ck.read(step=cmd.get("step"), tag=cmd.get("tag"))
            if got is None:
                return {"step": None, "digest": None}
            ids = got.get("ids")
            step = int(ids[0]) if isinstance(ids, torch.Tensor) else None
            return {"step": step, "digest": digest(got)}
        if op == "delete":
            ck.delete(cmd["step"])
            return {}
        if op == "tag":
            return {"before": ck.tag(cmd["name"], cmd["step"])}
        if op == "untag":
            return {"before": ck.untag(cmd["name"])}
        if op == "steps":
            return {"steps": ck.steps(refresh=True), "tags": ck.tags(refresh=True)}
        raise ValueError(f"unknown op {op!r}")

    def _close(self) -> None:
        ck, self.ck = self.ck, None
        if ck is not None:
            ck.close()


def _lose_an_older_step(ck: Any, step: int) -> None:
    """A deliberately broken library (the test that the model catches one): after a save, a data
    file of another committed step disappears, as if retention or a discard removed the wrong one."""
    for other in ck.steps():
        path = ck.path(other)
        if other == step or not os.path.isdir(path):
            continue
        for dirpath, _, files in os.walk(path):
            for name in files:
                if name != "MANIFEST.json":
                    os.remove(os.path.join(dirpath, name))
                    return


class _LoadFailed(Exception):
    def __init__(self, untouched: bool) -> None:
        super().__init__()
        self.untouched = untouched


def serve(conn: Any, log_path: str) -> None:
    """The worker's loop: commands from ``conn`` (a multiprocessing Connection), one reply each.

    Started by the driver's forkserver, which imported torch and ckptguard once: a new worker
    (after a SIGKILL) is a fork, not a Python start-up. Output and tracebacks go to ``log_path``.
    """
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    from tests.support.beds.s3 import CREDENTIALS

    os.environ.update(CREDENTIALS)  # an S3 root's endpoint comes in storage_options
    os.environ.pop("AWS_ENDPOINT_URL", None)
    warnings.simplefilter("always")
    from ckptguard import CheckpointError

    job = Job()
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        out: dict[str, Any]
        cause: BaseException | None = None
        try:
            out = {"ok": True, **job.handle(cmd)}
        except _LoadFailed as e:
            cause = e.__context__
            out = {"ok": False, "untouched": e.untouched}
        except BaseException as e:
            cause = e
            out = {"ok": False}
        if cause is not None:
            out.update(
                error=type(cause).__name__,
                message=str(cause)[:2000],
                checkpoint_error=isinstance(cause, CheckpointError),
            )
            print(
                f"[model worker {os.getpid()}] {cmd['op']} failed:\n" + "".join(traceback.format_exception(cause)),
                file=sys.stderr,
                flush=True,
            )
        conn.send(out)
        if cmd["op"] == "exit":
            return
