"""A plain (no torchrun) child for `ckptguard run` tests.

Modes (argv[1]):
  ``output``   writes stdout and stderr interleaved: partial lines, a carriage-return progress
               bar, bytes that are not UTF-8, whether each stream is a terminal, no final newline.
  ``signals``  handles SIGTERM (prints, exits 7) and leaves SIGINT to Python (KeyboardInterrupt,
               a ``finally`` that prints, death by SIGINT); prints ``ready`` and waits.
  ``save-and-fail ROOT N``  commits steps 1..N to ROOT (a rank-local Checkpointer; path or s3://),
               then raises.
  ``touch PATH`` creates PATH and exits 0 (shows that the child ran).
"""

from __future__ import annotations

import os
import signal
import sys
import time


def output() -> None:
    out, err = sys.stdout.buffer, sys.stderr.buffer
    out.write(f"stdout isatty={os.isatty(1)} stderr isatty={os.isatty(2)}\n".encode())
    out.flush()
    for i in range(200):
        out.write(b"line %d of stdout\n" % i)
        if i % 7 == 0:
            err.write(b"warning %d on stderr\n" % i)
            err.flush()
        if i % 50 == 0:
            out.flush()
    out.write(b"partial ")
    out.flush()
    time.sleep(0.05)
    out.write(b"line\n")
    for pct in (0, 50, 100):
        err.write(b"\rprogress %3d%%" % pct)
        err.flush()
    err.write(b"\n\xff\xfe not utf-8 \x1b[31mred\x1b[0m\n")
    out.write(b"no final newline")
    out.flush()
    err.flush()


def signals() -> None:
    def on_term(signum: int, _frame: object) -> None:
        print(f"child got signal {signum}", flush=True)
        sys.exit(7)

    signal.signal(signal.SIGTERM, on_term)
    try:  # "ready" inside the try: a signal right after it still finds the cleanup armed
        print("ready", flush=True)
        # Short sleeps: a signal handled between a sleep's last check and its system call does not
        # cut that sleep short (CPython's time.sleep), so one long sleep could outlast the test's
        # timeout; the next short one raises it (a 60 s hang once in CI).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        print("cleanup ran", flush=True)


def save_and_fail(root: str, steps: int) -> None:
    import torch

    import ckptguard

    with ckptguard.Checkpointer(root, process_group="local") as ck:
        for step in range(1, steps + 1):
            ck.save(step, {"w": torch.full((16,), float(step))})
    raise RuntimeError(f"training diverged after step {steps}")


def main() -> None:
    mode = sys.argv[1]
    if mode == "output":
        output()
    elif mode == "signals":
        signals()
    elif mode == "save-and-fail":
        save_and_fail(sys.argv[2], int(sys.argv[3]))
    elif mode == "touch":
        open(sys.argv[2], "w").close()
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
