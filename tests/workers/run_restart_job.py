"""A one-process job for tests/test_run_hang.py's restarts: steps 0..STEPS-1, a checkpoint each.

    python run_restart_job.py ROOT MODE STEPS

It resumes from the step committed last. MODE: kill_once (on the first attempt, after committing
step 1, it SIGKILLs itself: a lost process), exception (a ValueError at step 1, every attempt),
none. Prints ``resumed from N`` / ``reached N``.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from ckptguard import Checkpointer

root, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
ck = Checkpointer(root)
state = {"w": torch.zeros(3)}
resumed = ck.load(state)
print(f"resumed from {resumed}", flush=True)
for step in range(0 if resumed is None else resumed + 1, steps):
    state["w"] += 1
    if mode == "exception" and step == 1:
        raise ValueError(f"bad label at step {step}")
    ck.save(step, state)
    print(f"reached {step}", flush=True)
    if mode == "kill_once" and step == 1 and resumed is None:
        os.kill(os.getpid(), signal.SIGKILL)
ck.close()
