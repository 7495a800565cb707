"""A one-process job for tests/runner/test_run_hang.py's restarts: steps 0..STEPS-1, a checkpoint each.

    python run_restart_job.py ROOT MODE STEPS

It resumes from the step committed last and prints ``resumed from N`` after the load and
``done`` at the end, nothing in between: each step sleeps ``JOB_STEP_S`` seconds, then saves, so
only the saves' heartbeats show progress. MODE: kill_once (on the first attempt, after committing
step 1, it SIGKILLs itself: a lost process), exception (a ValueError at step 1), none.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from ckptguard.runner import heartbeat


def _beat_while(busy: threading.Event) -> None:
    while busy.is_set():  # importing torch and opening the root are slow on a loaded machine, and silent
        heartbeat()
        time.sleep(0.5)


starting = threading.Event()
starting.set()
threading.Thread(target=_beat_while, args=(starting,), daemon=True).start()
import torch  # noqa: E402

from ckptguard import Checkpointer  # noqa: E402

root, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
ck = Checkpointer(root)
state = {"w": torch.zeros(3)}
resumed = ck.load(state)
starting.clear()
print(f"resumed from {resumed}", flush=True)
for step in range(0 if resumed is None else resumed + 1, steps):
    state["w"] += 1
    if mode == "exception" and step == 1:
        raise ValueError(f"bad label at step {step}")
    time.sleep(float(os.environ.get("JOB_STEP_S", "0")))
    ck.save(step, state)
    if mode == "kill_once" and step == 1 and resumed is None:
        os.kill(os.getpid(), signal.SIGKILL)
starting.set()  # closing waits for the last save's cleanup: silent too
threading.Thread(target=_beat_while, args=(starting,), daemon=True).start()
ck.close()
print("done", flush=True)
