"""A torchrun worker for saves in flight when a rank dies or the process group or process goes away.

Scenarios (argv[1]): ``destroy`` (a background save, then destroy_process_group and exit at
once), ``dead_rank`` (rank 1 is SIGKILLed inside a background save; rank 0 waits),
``stalled_rank`` (rank 1 stops itself inside a save; rank 0 must fail within the
control group's timeout), ``out_of_step`` (rank 1 is interrupted at the start of a save rank 0 goes
into, then loads), ``agreed_interrupt`` (rank 1 is interrupted inside an agreed step of a load,
then both save and load on). Each rank prints ``RESULT <json>``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time

import torch
import torch.distributed as dist

import ckptguard
from ckptguard import _faults

from tests.support.results import emit_result


def result(**kw: object) -> None:
    emit_result(**kw)


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1 << 16,), float(step))}


def scenario_destroy(args: argparse.Namespace) -> None:
    ck = ckptguard.Checkpointer(args.root)
    ck.save(1, state(1))
    ck.save(2, state(2), blocking=False)
    dist.destroy_process_group()  # the save must be finished first, not torn down with the group
    result(done=True)


def scenario_dead_rank(args: argparse.Namespace) -> None:
    ck = ckptguard.Checkpointer(args.root)
    ck.save(1, state(1))
    if dist.get_rank() == 1:
        _faults.arm("before_write:1:kill")
    else:
        # torchrun SIGTERMs the other workers as soon as it sees rank 1 die: on a loaded machine that
        # came before rank 0 had written the error it got (a CI run saw no result at all). Ignored here,
        # rank 0 reports; torchrun's SIGKILL still follows its grace period if rank 0 ever hangs.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ck.save(2, state(2), blocking=False)
    started = time.monotonic()
    try:
        ck.wait()
        result(error=None)
    except BaseException as e:
        result(
            error=type(e).__name__,
            checkpoint_error=isinstance(e, ckptguard.CheckpointError),
            seconds=time.monotonic() - started,
            message=str(e)[:300],
        )


def scenario_stalled_rank(args: argparse.Namespace) -> None:
    ck = ckptguard.Checkpointer(args.root, collective_timeout_s=args.timeout)
    ck.save(1, state(1))
    started = time.monotonic()
    pid_file = f"{args.root}.stalled-pid"
    if dist.get_rank() == 1:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 kills it once it has reported
    try:
        ck.save(2, state(2))
        result(error=None)
    except BaseException as e:
        result(
            error=type(e).__name__,
            checkpoint_error=isinstance(e, ckptguard.CheckpointError),
            seconds=time.monotonic() - started,
        )
    # The stalled peer never answers again: end it, so that the job ends now and not at the test's timeout.
    with contextlib.suppress(OSError, ValueError), open(pid_file) as f:
        os.kill(int(f.read()), signal.SIGKILL)
    os._exit(0)  # do not wait for the stalled peer at shutdown


def scenario_out_of_step(args: argparse.Namespace) -> None:
    """Rank 1 is interrupted (a Ctrl-C it catches) where the others do not agree on it: at the start
    of a save that rank 0 goes into. Rank 1 then loads."""
    ck = ckptguard.Checkpointer(args.root, collective_timeout_s=args.timeout)
    ck.save(1, state(1))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if dist.get_rank() == 1:
        _faults.arm("save_start:1:interrupt")
    started = time.monotonic()
    outcome: dict[str, object] = {}
    try:
        ck.save(2, state(2))
        outcome["save"] = None
    except BaseException as e:
        outcome["save"] = type(e).__name__
    _faults.arm("")
    if dist.get_rank() == 1:
        template = state(0)
        try:
            outcome["load"] = ck.load(template)
        except BaseException as e:
            outcome["load"] = type(e).__name__
            outcome["message"] = str(e)[:400]
    result(seconds=time.monotonic() - started, **outcome)
    os._exit(0)  # the groups are out of step: do not wait for them at shutdown


def scenario_agreed_interrupt(args: argparse.Namespace) -> None:
    """Rank 1 is interrupted inside a load's step that every rank agrees on (right after placing its
    bytes): both ranks raise there, stay in step, and save and load on."""
    ck = ckptguard.Checkpointer(args.root, collective_timeout_s=args.timeout)
    ck.save(1, state(1))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if dist.get_rank() == 1:
        _faults.arm("after_place:1:interrupt")
    outcome: dict[str, object] = {}
    try:
        outcome["load"] = ck.load(state(0))
    except BaseException as e:
        outcome["load"] = type(e).__name__
    _faults.arm("")
    ck.save(2, state(2))
    template = state(0)
    outcome["next_load"] = ck.load(template)
    outcome["value"] = float(template["w"][0])
    result(**outcome)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("root")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    globals()[f"scenario_{args.scenario}"](args)


if __name__ == "__main__":
    main()
