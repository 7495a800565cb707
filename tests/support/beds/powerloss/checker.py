"""A group of long-lived ranks that load crash states, one after the other, and report what they found.

Loading must happen at the world size of the save (``files=`` artifacts are per rank and
cannot be resharded), and starting a process group per state would cost seconds; so N
processes join one gloo group once and take requests over pipes. Each request is one
state directory; every rank opens a ``read_only`` Checkpointer on it, loads the newest
checkpoint and then every other committed step, and compares bit for bit with what the
save that wrote it saved. Facts only: the judging (old or new? lost?) is the explorer's.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import tempfile
import traceback
import warnings
from datetime import timedelta
from typing import Any

from .content import artifact_files, blank_state, differences, loaded_id, read_tree


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _check_one(req: dict[str, Any], rank: int, group: Any) -> dict[str, Any]:
    from ckptguard import Checkpointer

    facts: dict[str, Any] = {"errors": [], "steps": None, "loads": {}, "fallback": False, "newest": None}
    restore = os.path.join(req["scratch"], f"rank{rank}")
    try:
        ck = Checkpointer(req["root"], read_only=True, process_group=group)
    except Exception as e:
        facts["errors"].append(f"read_only Checkpointer failed: {_describe(e)}")
        return facts
    try:
        facts["steps"] = ck.steps()
        order: list[int | None] = [None] + [s for s in reversed(facts["steps"][:-1])]
        for which in order:
            state = blank_state(rank)
            shutil.rmtree(restore, ignore_errors=True)
            files = {"offload": restore} if req["files"] else None
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    got = ck.load(state, step=which, files=files)
            except Exception as e:
                facts["errors"].append(f"load(step={which}) raised {_describe(e)}")
                continue
            if which is None:
                facts["newest"] = got
                facts["fallback"] = any("falling back" in str(w.message) for w in caught)
            if got is None:
                continue
            step, gen = loaded_id(state)
            bad = [] if step == got else [f"loaded step {got} holds step {step}"]
            bad += differences(state, step, gen, rank)
            if req["files"] and read_tree(restore) != artifact_files(step, gen, rank):
                bad.append("files= artifact")
            facts["loads"][got] = {"gen": gen, "bad": bad}
    finally:
        ck.close()
        shutil.rmtree(restore, ignore_errors=True)
    return facts


def _serve(rank: int, world: int, init: str, conn: Any, src_paths: list[str]) -> None:
    import sys

    sys.path[:0] = [p for p in src_paths if p not in sys.path]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    group = dist.new_group(backend="gloo")
    conn.send("ready")
    while True:
        try:
            req = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            break
        if req is None:
            break
        try:
            conn.send(_check_one(req, rank, group))
        except Exception:
            conn.send(
                {
                    "errors": [f"checker crashed: {traceback.format_exc()}"],
                    "steps": None,
                    "loads": {},
                    "fallback": False,
                    "newest": None,
                }
            )
    dist.destroy_process_group()


class Checker:
    """``with Checker(world) as c: facts = c.check(root, files=...)`` (facts of every rank)."""

    def __init__(self, world: int, timeout: float = 120.0) -> None:
        self.world = world
        self.timeout = timeout
        self._tmp = tempfile.mkdtemp(prefix="ckptguard-plcheck-")
        ctx = mp.get_context("spawn")
        import sys

        self._conns = []
        self._procs = []
        init = os.path.join(self._tmp, "store")
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(r, world, init, child, list(sys.path)), daemon=True)
            p.start()
            self._conns.append(parent)
            self._procs.append(p)
        for c in self._conns:
            self._recv(c)

    def _recv(self, conn: Any) -> Any:
        if not conn.poll(self.timeout):
            self.close()
            raise TimeoutError(f"a checker rank did not answer within {self.timeout:.0f} s")
        return conn.recv()

    def check(self, root: str, files: bool) -> list[dict[str, Any]]:
        req = {"root": root, "files": files, "scratch": os.path.join(self._tmp, "restore")}
        for c in self._conns:
            c.send(req)
        return [self._recv(c) for c in self._conns]

    def close(self) -> None:
        for c in self._conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                c.send(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._conns, self._procs = [], []
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> Checker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
