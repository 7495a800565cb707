"""save() arguments whose check can differ between ranks are refused on every rank at once, with the
same error naming the rank and the cause (a real torchrun job: gloo, 3 processes); so is a load of
another step on one rank. Before, the rank that got a NaN in metadata= raised alone and the others
went on to pair with the next save; a load of different steps read different checkpoints."""

from __future__ import annotations

from pathlib import Path

from tests.support.jobs import run_job
from tests.support.results import results_by_rank
from tests.support.workers import WORKERS

WORKER = WORKERS / "refusal_job.py"

#: What each case's error names besides the rank (the cause).
CAUSES = {
    "metadata_nan": ("InvalidArgumentError", "nan"),
    "metadata_inf": ("InvalidArgumentError", "inf"),
    "metadata_key": ("InvalidArgumentError", "keys must be str"),
    "metadata_deep": ("InvalidArgumentError", "nested more than"),
    "files_missing": (None, "absent"),
    "files_kind": ("UnsupportedValueError", "must be a local path"),
    "state_key": ("UnsupportedValueError", "state keys must be non-empty strings"),
    "state_tensor": ("UnsupportedValueError", "sparse"),
    "step_differs": ("ReplicatedValueError", "step="),
    "step_negative": ("InvalidArgumentError", "step must be a non-negative int"),
    "async_metadata_nan": ("InvalidArgumentError", "nan"),
    "load_step_differs": ("ReplicatedValueError", "step=0 on rank 1"),
}


def test_a_save_argument_wrong_on_one_rank_is_refused_on_every_rank_at_once(tmp_path: Path) -> None:
    world = 3
    job = run_job(WORKER, [str(tmp_path / "ck"), str(tmp_path)], nproc_per_node=world, timeout=240)
    assert job.ok, job.output()
    results = results_by_rank(job, world)
    for case, (cls, cause) in CAUSES.items():
        seen = [next(r for r in results[rank] if r.get("case") == case) for rank in range(world)]
        classes = {r["error"] for r in seen}
        assert len(classes) == 1 and None not in classes, (case, seen)
        if cls is not None:
            assert classes == {cls}, (case, seen)
        for r in seen:  # the other ranks' errors name rank 1; its own, the cause
            assert cause in r["message"] and (r["rank"] == 1 or "rank 1" in r["message"]), (case, r)
            assert r["seconds"] < 30, (case, r)  # the collective timeout is 60 s
    for rank in range(world):
        after = next(r for r in results[rank] if r.get("case") == "after")
        assert after["steps"] == [0, 100], after  # nothing of a refused save committed, no rank out of step
