"""A one-process job for tests/test_run_hang.py's restarts: steps 0..STEPS-1, a checkpoint each.

    python run_restart_job.py ROOT MODE STEPS

It resumes from the step committed last. MODE: kill_once (on the first attempt, after committing
step 1, it SIGKILLs itself: a lost process), exception (a ValueError at step 1, every attempt),
quiet (prints nothing while it trains: 2.5 s per step, then a save), none. Prints ``resumed from
N`` / ``reached N``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from ckptguard.runner import heartbeat


def _beat_while(done: threading.Event) -> None:
    while not done.is_set():  # importing torch is slow on a loaded machine, and silent
        heartbeat()
        time.sleep(0.5)


imported = threading.Event()
threading.Thread(target=_beat_while, args=(imported,), daemon=True).start()
import torch  # noqa: E402

from ckptguard import Checkpointer  # noqa: E402

imported.set()
root, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
ck = Checkpointer(root)
state = {"w": torch.zeros(3)}
resumed = ck.load(state)
print(f"resumed from {resumed}", flush=True)
for step in range(0 if resumed is None else resumed + 1, steps):
    state["w"] += 1
    if mode == "exception" and step == 1:
        raise ValueError(f"bad label at step {step}")
    if mode == "quiet":
        time.sleep(2.5)  # only the saves' heartbeats show progress
    ck.save(step, state)
    if mode != "quiet":
        print(f"reached {step}", flush=True)
    if mode == "kill_once" and step == 1 and resumed is None:
        os.kill(os.getpid(), signal.SIGKILL)
ck.close()
print("done", flush=True)
