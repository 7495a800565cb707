"""What the tests and the tools share (see docs/testbeds.md).

    jobs.py         launch real torchrun jobs (one agent per simulated node), collect every
                    rank's log, never leave a worker behind
    results.py      the ``RESULT {json}`` line workers print: emit_result / parse_results
    workers.py      where the worker scripts are; ckpt_job() runs tests/workers/ckpt_job.py
    beds/           storage beds: stale-caching sshfs mounts (sshfs.py), a small tmpfs
                    (diskfull.py); beds/workers/probe.py checks the launcher
    fixtures.py     pytest fixtures for the beds (registered by the root conftest.py)
    frameworks.py   the framework-integration tests: a 2-rank torchrun of a worker, the ranks'
                    JSONL records, a digest of model and optimizer state
    campaign.py     the crash-consistency campaign's engine: fault kinds, the checks that
                    call an outcome torn, lost, invented, stale or garbage, the report

Dependencies point one way: ``tests/`` and ``tools/`` import from here, this package imports
neither (nor anything under ``tools/``, ``bench/`` or ``examples/``). Everything imports it as
``tests.support``, with the repository root on ``sys.path``: pytest puts it there (for the
root ``conftest.py``), ``run_job`` puts it on the workers' ``PYTHONPATH``, and a script run
directly (``tools/campaign.py``, ``tests/baselines/measure.py``) inserts it once, at its top.
"""
