"""The model-based test of the checkpoint protocol (tests/crash/test_model_based.py, tools/model_run.py).

worker.py    a long-lived process holding one Checkpointer, driven over a pipe (one JSON
             line per command and per reply), so an action costs milliseconds, not a start-up
drivers.py   the driver side: spawn/command/kill/stop/continue workers (a warm spare makes a
             restart after SIGKILL cheap), the POSIX and S3 backends, the S3 fault kinds
model.py     what must be true: committed steps and their digests, what an action of unknown
             outcome may have left, tags; the audit that compares a root against it
machine.py   the hypothesis RuleBasedStateMachine: two writing jobs and a read-only reader,
             interleaved saves, loads, reads, deletes, tags, retention, takeovers, kills,
             stalls and S3 faults, audited after every step
"""
