"""A newcomer's first runs, each as a log written in the shape they reported: a DeepSpeed run
across hosts, a checkpoint directory unwritable from the start, and Ctrl-C."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptguard.diagnose.engine import diagnose

LOGS = Path(__file__).parent / "newcomer"


def test_deepspeed_multihost_keeps_hosts_and_world_size() -> None:
    """Two nodes of four processes: world size 8 from the launcher's own figures; the node whose
    worker segfaulted first is named, and its ranks (the launcher prints its last local rank's
    command, whichever process died)."""
    d = diagnose([str(LOGS / "ds_multihost.log")])
    assert (d.failure_class, d.world_size, d.initiating_host) == ("segfault", 8, "worker-1")
    assert d.initiating_rank is None
    assert "worker-1" in d.rank_attribution and "4-7" in d.rank_attribution


def test_deepspeed_one_process_per_node_names_the_rank() -> None:
    """One process per node: the node's only rank is the one that died (node rank x 1 + 0)."""
    d = diagnose([str(LOGS / "ds_one_per_node.log")])
    assert (d.failure_class, d.initiating_rank, d.initiating_host, d.world_size) == ("segfault", 5, "worker-5", 8)
    assert d.collateral_ranks == [0, 3]


@pytest.mark.parametrize("name", ["unwritable.log", "unwritable_notes.log"])
def test_unwritable_checkpoint_dir_names_the_rank_the_others_name(name: str) -> None:
    """Every rank fails on the directory; rank 1's error is printed first but says rank 0 failed
    first, and torchrun's Root Cause agrees: rank 0 is named, with what decided it."""
    d = diagnose([str(LOGS / name)])
    assert (d.failure_class, d.initiating_rank) == ("permission_denied_checkpoint_dir", 0)
    if name == "unwritable_notes.log":
        assert "names it as the first to fail" in d.rank_attribution


@pytest.mark.parametrize("name", ["ctrlc.log", "ctrlc_table_only.log"])
def test_ctrl_c_is_interrupted_not_a_scheduler_limit(name: str) -> None:
    """KeyboardInterrupt and SIGINT (-2) are the class `interrupted`, which --on-failure hooks
    receive; never the scheduler's time limit."""
    proc = subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", "diagnose", str(LOGS / name), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    d = json.loads(proc.stdout)
    assert (d["failure_class"], d["kind"]) == ("interrupted", "interrupted")
    assert all(a["failure_class"] != "scheduler_time_limit" for a in d["alternatives"][:1])


def test_an_interrupted_job_is_never_restarted() -> None:
    """A Ctrl-C is a person's or a tool's decision to stop: `run --max-restarts` must not undo it."""
    from ckptguard.diagnose.kb import load_kb

    restart = load_kb().classes["interrupted"].restart
    assert restart.transient is False and restart.why


def test_host_named_one_way() -> None:
    """NCCL names the host `gpu-node-3`, torchrun's summary `gpu-node-3.cluster.local`: the
    report names it once, by its full name."""
    d = diagnose([str(LOGS / "host_two_names.log")])
    assert (d.failure_class, d.initiating_rank) == ("nccl_network_error", 1)
    assert d.initiating_host == "gpu-node-3.cluster.local"
