"""Model-based test of the checkpoint protocol: hypothesis drives two writing jobs and a read-only
reader (real worker processes) through saves, loads, reads, deletes, tags, retention, takeovers,
SIGKILLs, SIGSTOPs and S3 faults, and audits the root against a model after every step
(tests/support/model/, docs/crash-consistency.md "Model-based test").

The CI slice: a fixed seed, a bounded number of examples and steps per backend, one pool of
workers for both. The long run with fresh seeds is tools/model_run.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.stateful import get_state_machine_test

from tests.support.beds.s3 import CREDENTIALS, S3Bed
from tests.support.model.drivers import Backend, S3Backend, WorkerPool
from tests.support.model.machine import MACHINES, PosixModelMachine, S3ModelMachine, use_harness

CI_SEED = 20
# Regression tests pasted from tools/model_run.py name these (and `replay`, `pool`, `s3` below).
MACHINE_CLASSES = (PosixModelMachine, S3ModelMachine)
EXAMPLES = {"posix": 4, "s3": 3}  # an S3 step costs ~3x a POSIX one (moto, the proxy, retries)


def ci_settings(backend: str) -> settings:
    return settings(max_examples=int(os.environ.get("CKPTGUARD_MODEL_EXAMPLES", EXAMPLES[backend])),
                    stateful_step_count=int(os.environ.get("CKPTGUARD_MODEL_STEPS", "25")),
                    deadline=None, database=None, print_blob=False, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path_factory.mktemp("model-logs"))
    try:
        yield p
    finally:
        p.close()


@contextlib.contextmanager
def replay(backend: Backend, pool: WorkerPool) -> Iterator[None]:
    """For a counterexample pasted from tools/model_run.py: the machine's harness on ``backend``."""
    with use_harness(backend, pool):
        yield


def _run(backend: Backend, pool: WorkerPool) -> None:
    with use_harness(backend, pool) as h:
        try:
            seed(CI_SEED)(get_state_machine_test(MACHINES[backend.name], settings=ci_settings(backend.name)))()
        except BaseException as e:
            # A kill's or stall's timing is part of a step, so hypothesis's replay of a failing sequence
            # may not fail again (it then reports the run as flaky): name every violation seen.
            raise AssertionError("violations: " + "\n".join(h.violations or ["none"])) from e
    assert not h.violations, h.violations
    assert h.counts["audits"] > 0 and h.counts["actions"] > 0, h.counts


def test_model_posix(pool: WorkerPool, tmp_path: Path) -> None:
    _run(Backend(tmp_path), pool)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Bed]:
    pytest.importorskip("moto")
    from tests.support.beds.s3 import s3_bed

    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)  # for the auditor, in this process (the workers get them from the pool)
    try:
        with s3_bed(seed=CI_SEED) as bed:
            yield bed
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_model_s3(s3: S3Bed, pool: WorkerPool, tmp_path: Path) -> None:
    _run(S3Backend(tmp_path, s3), pool)


def test_model_catches_a_library_that_loses_data(pool: WorkerPool, tmp_path: Path) -> None:
    """The checks fire: writers that delete a data file of another committed step after each save
    (worker.py's sabotage) are caught by the audit."""
    with use_harness(Backend(tmp_path), pool) as h:
        h.sabotage = "lose-data"
        test = get_state_machine_test(MACHINES["posix"], settings=settings(
            ci_settings("posix"), max_examples=10, phases=[Phase.generate]))
        with pytest.raises(BaseException):  # noqa: B017 - hypothesis wraps it (flaky replays too)
            seed(CI_SEED)(test)()
    assert any("does not load as saved" in v or "unreadable" in v for v in h.violations), h.violations
