"""One rank acts, every rank gets the result or the same typed exception (``ckptguard.ranks``), between
two real processes over gloo: rank 1 raises the class rank 0 raised, with rank 0's message, so that
both take the same branch."""

from __future__ import annotations

import datetime
import errno
import multiprocessing as mp
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from ckptguard import CorruptCheckpointError, PeerError, StoragePermissionError
from ckptguard.ranks import one_rank_acts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _corrupt(root: str) -> None:
    raise CorruptCheckpointError(f"{root}/step-3/data: checksum mismatch", path=f"{root}/step-3/data")


def _denied(root: str) -> None:
    raise PermissionError(errno.EACCES, "Permission denied", os.path.join(root, "latest"))


def _not_ours(root: str) -> None:
    raise KeyError("layout")


def _result(root: str) -> dict[str, Any]:
    return {"step": 7, "dir": root}


ACTS = {"corrupt": _corrupt, "denied": _denied, "not_ours": _not_ours, "result": _result}


def _rank(rank: int, port: int, root: str, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        for name, act in ACTS.items():
            try:
                # Rank 1's act would succeed: only rank 0's runs.
                got = one_rank_acts(
                    f"check {root}", lambda act=act: act(root) if dist.get_rank() == 0 else None, where=root
                )
                q.put((name, rank, "ok", got, None))
            except Exception as e:
                q.put(
                    (
                        name,
                        rank,
                        "raised",
                        type(e).__name__,
                        (str(e), getattr(e, "rank", None), getattr(e, "path", None)),
                    )
                )
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], tuple[Any, ...]]:
    root = str(tmp_path_factory.mktemp("ranks"))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, root, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = [q.get(timeout=120) for _ in range(2 * len(ACTS))]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return {(name, rank): (how, value, detail) for name, rank, how, value, detail in got}


def test_corruption_on_rank_0_is_a_corrupt_checkpoint_error_on_every_rank(outcomes: dict) -> None:
    for rank in (0, 1):
        how, cls, _ = outcomes[("corrupt", rank)]
        assert (how, cls) == ("raised", "CorruptCheckpointError"), rank
    message, blamed, path = outcomes[("corrupt", 1)][2]
    assert "checksum mismatch" in message and "rank 0" in message
    assert blamed == 0 and path.endswith("step-3/data")


def test_a_denied_write_on_rank_0_is_a_storage_permission_error_on_every_rank(outcomes: dict) -> None:
    for rank in (0, 1):
        how, cls, _ = outcomes[("denied", rank)]
        assert (how, cls) == ("raised", StoragePermissionError.__name__), rank
    message, blamed, path = outcomes[("denied", 1)][2]
    assert "permission denied" in message and path.endswith("latest") and blamed == 0


def test_an_error_of_another_kind_names_its_class_on_the_other_ranks(outcomes: dict) -> None:
    assert outcomes[("not_ours", 0)][:2] == ("raised", "KeyError")  # rank 0: its own exception, unchanged
    how, cls, (message, _, _) = outcomes[("not_ours", 1)]
    assert (how, cls) == ("raised", PeerError.__name__) and "KeyError" in message and "layout" in message


def test_rank_0s_result_reaches_every_rank(outcomes: dict) -> None:
    assert outcomes[("result", 0)][:2] == outcomes[("result", 1)][:2] == ("ok", outcomes[("result", 0)][1])
    assert outcomes[("result", 1)][1]["step"] == 7


INTERNALS = ("ckptguard.protocol", "ckptguard.storage", "ckptguard.dcp", "ckptguard.comm")


def test_integrations_import_only_the_public_api() -> None:
    """Every import in integrations/, at module level or inside a function, of ckptguard's internals."""
    import ast

    import ckptguard.integrations

    found = []
    for path in sorted(Path(ckptguard.integrations.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level >= 1:  # relative: ..protocol, ..comm
                names = [f"ckptguard.{node.module or ''}"] + [f"ckptguard.{a.name}" for a in node.names]
            found += [
                f"{path.name}:{node.lineno} {n}"
                for n in names
                if any(n == m or n.startswith(m + ".") for m in INTERNALS)
            ]
    assert found == []
