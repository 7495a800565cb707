"""Checkpointer on NFS-like storage with stale client caches: 50 saves in a row on a 2-node job.

Node 0 uses sshfs mount A and node 1 mount B of one directory, each with its own stale
name/attribute caches (tests/support/beds/sshfs.py). In the same bed the OLMo-style protocol and
the "global rank 0 does the directory work" patch from OLMo #894 fail
(tests/crash/test_beds.py::test_olmo_style_fails_on_stale_shared_storage with 5 s caches,
::test_global_rank0_patch_fails_on_stale_shared_storage with 15 s caches); here
ckptguard must not fail once, with either window. Every 5th save re-saves the previous
step with overwrite=True (a restarted run), the case that broke the patch with 5 s caches,
and after every save all ranks load the newest step (node 1 reads what node 0 published).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.support.beds.sshfs import BedUnavailable, stale_shared_storage
from tests.support.jobs import run_job
from tests.support.results import job_results
from tests.support.workers import CAMPAIGN_JOB

SAVES = 50
KEEP = 3


@pytest.mark.slow
@pytest.mark.sshfs
@pytest.mark.parametrize("cache_timeout", [5, pytest.param(15, marks=pytest.mark.long)])
def test_fifty_saves_in_a_row_two_nodes_on_two_stale_mounts(tmp_path: Path, cache_timeout: int) -> None:
    try:
        cm = stale_shared_storage(2, cache_timeout=cache_timeout)
        bed = cm.__enter__()
    except BedUnavailable as e:
        pytest.skip(f"sshfs bed unavailable: {e}")
    try:
        t0 = time.monotonic()
        job = run_job(
            CAMPAIGN_JOB,
            [
                "consecutive",
                "--gen",
                "1000",
                "--trials",
                str(SAVES),
                "--overwrite-every",
                "5",
                "--load-every",
                "1",
                "--keep-last",
                str(KEEP),
            ],
            nnodes=2,
            nproc_per_node=2,
            node_env=bed.node_env("CKPT_ROOT", "ckpt"),
            env={"CKPT_SCRATCH": str(tmp_path)},
            timeout=170,
        )
        seconds = time.monotonic() - t0
        truth = bed.server_dir / "ckpt"
        on_server = sorted(os.listdir(truth))
        control = {d: sorted(os.listdir(truth / ".ckptguard" / d)) for d in ("staging", "trash")}
        latest = json.loads((truth / "latest").read_text())
    finally:
        cm.__exit__(None, None, None)
    assert job.ok, job.output()
    evs = job_results(job)
    saved = [e for e in evs if e.get("event") == "saved"]
    print(
        f"\n{SAVES} saves on 2 nodes x 2 ranks, sshfs caches {cache_timeout} s: job {seconds:.1f} s, "
        f"save {min(e['dur'] for e in saved):.2f}-{max(e['dur'] for e in saved):.2f} s"
    )
    assert all(e["domains"] == [[0, 1, 2, 3]] for e in evs if e.get("event") == "start")  # the probe saw one domain
    assert not [e for e in evs if e.get("event") == "save-failed"]
    assert len(saved) == SAVES * 4  # every save returned on every rank
    last_gen = {}
    for e in evs:
        if e.get("event") == "saving" and e["rank"] == 0:
            last_gen[e["step"]] = e["gen"]
    newest = max(last_gen)
    expected = list(range(newest - KEEP + 1, newest + 1))
    assert all(e["step"] in e["committed"] for e in saved)
    final = [e for e in evs if e.get("event") == "loaded" and e["what"] == "final"]
    assert sorted({e["step"] for e in final}) == expected and len(final) == KEEP * 4
    for e in final:  # bitwise, and the version saved last (overwrites included)
        assert e["ok"] and e["gen"] == last_gen[e["step"]], e
    after_save = [e for e in evs if e.get("event") == "loaded" and e["what"] == "after-save"]
    assert len(after_save) == SAVES * 4  # after each save every rank loaded the step just saved, bitwise
    for e in after_save:
        assert e["ok"] and not e["warned"] and e["gen"] == 1000 + e["i"], e
    # The truth on the server: exactly the retained checkpoints, `latest` on the newest, no garbage.
    steps_on_server = [n for n in on_server if n.startswith("step-")]
    assert len(steps_on_server) == KEEP and sorted(int(n[5:13]) for n in steps_on_server) == expected
    assert latest["step"] == newest
    assert control == {"staging": [], "trash": []}
