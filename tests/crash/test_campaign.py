"""The crash-consistency campaign, bounded for CI (tools/campaign.py runs it for longer).

Real torchrun jobs get real faults: SIGKILL of a rank at every phase of a save, at random
moments and in the middle of a load; a 2-node job on two stale-caching sshfs mounts; a
checkpoint damaged after commit; a filesystem that fills mid-save; two jobs on one root;
a stalled job whose lease is taken over; kills during overwrite and
rollback saves on two storage domains, SIGSTOP in latest/retention/lease renewal/release with a
takeover meanwhile, readers during retention, the caller's state after failed loads, restores
into non-empty and shared directories, per-rank values, exits with a background save in flight,
hostile checkpoints (tests/support/campaign_kinds.py). After each fault the restarted job must load the
newest committed checkpoint bitwise, no committed checkpoint may be lost and no staging
garbage may survive the next successful save (docs/crash-consistency.md).

The tests at the end are the smallest reproductions of library bugs the campaign found.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ckptguard import Checkpointer

from tests.support import campaign
from tests.support.beds.diskfull import small_filesystem
from tests.support.beds.sshfs import BedUnavailable
from tests.support.jobs import process_state, run_local
from tests.support.workers import CAMPAIGN_JOB

#: Injected faults per test, summed by test_campaign_total (the issue asks for >= 100 in CI).
FAULTS: dict[str, int] = {}

#: Trials of each kill kind: CI (every save phase once, one random moment, one load) and the long run
#: (`pytest -m long`), which repeats the same kinds with more trials on every layout. Kill trials cost a
#: torchrun job each (~9 s on 1 x 2 ranks, ~18 s on 2 x 2 on a 2-core machine); corruption and hostile
#: trials about a second, so those carry most of CI's 100 faults.
CI_KILLS = {"kill_phase": len(campaign.SAVE_PHASES), "kill_random": 1, "kill_load": 1}
LONG_KILLS = {"kill_phase": 28, "kill_random": 8, "kill_load": 4}
#: CI's kill layouts: 1 x 2 for most trials, one trial each on 2 x 2 with a shared root (mid_write) and on
#: 2 x 2 with node-local roots (before_publish: one storage domain published, the other not).
CI_KILL_LAYOUTS = ("single", "single", "shared", "single", "local")
CI_STALE_CACHE = 1
LONG_STALE_CACHE = 8


def _run(
    tmp_path: Path,
    plan: dict[str, int],
    seed: int,
    *,
    counted: bool = True,
    kill_layouts: tuple[str, ...] = campaign.KILL_LAYOUTS,
) -> object:
    """Run one part of the campaign; print its table; fail on any torn load, lost checkpoint or failure.
    ``counted``: its faults go into FAULTS (the CI total) under their kinds."""
    lines: list[str] = []
    c = campaign.Campaign(tmp_path, seed=seed, log=lines.append, kill_layouts=kill_layouts)
    t0 = time.monotonic()
    report = c.run(plan)
    table = report.table()
    print(f"\ncampaign {plan} seed {seed}: {time.monotonic() - t0:.0f} s\n{table}")
    (tmp_path / "report.json").write_text(json.dumps(report.to_json(), indent=2))
    detail = "\n".join([table, *report.problems[:20]])
    assert report.total("torn") == 0, detail
    assert report.total("lost") == 0, detail
    assert report.total("failures") == 0, detail
    for kind, n in plan.items():
        if counted:
            FAULTS[kind] = report.total("faults", kind)
        assert report.total("trials", kind) >= n, detail
    return report


def _check_kills(report: object, plan: dict[str, int]) -> None:
    for kind, n in plan.items():
        assert report.total("faults", kind) == n, report.table()  # every kill really happened
    phases = {sub.split()[0] for (kind, sub), t in report.tallies.items() if kind == "kill_phase" and t.faults}
    assert phases == set(campaign.SAVE_PHASES), phases


@pytest.mark.slow
def test_sigkill_at_every_phase_at_random_moments_and_during_load(tmp_path: Path) -> None:
    """SIGKILL one rank (kill_phase: every named phase once; kill_random: a timer thread at a random
    moment of a save; kill_load: in the middle of a load), on 1x2, 2x2-shared and 2x2 node-local
    layouts; each job is the restart of the previous trial."""
    layouts = {CI_KILL_LAYOUTS[i % len(CI_KILL_LAYOUTS)] for i in range(CI_KILLS["kill_phase"])}
    assert layouts == {"single", "shared", "local"}, layouts  # every layout gets a kill at a save phase
    report = _run(tmp_path, CI_KILLS, seed=11, kill_layouts=CI_KILL_LAYOUTS)
    _check_kills(report, CI_KILLS)


@pytest.mark.slow
@pytest.mark.long
def test_sigkill_at_every_phase_at_random_moments_and_during_load_long(tmp_path: Path) -> None:
    """The long run's kill trials: every phase four times, on every layout (the default 4-layout cycle)."""
    report = _run(tmp_path, LONG_KILLS, seed=31, counted=False)
    _check_kills(report, LONG_KILLS)


def _stale_cache(tmp_path: Path, n: int, seed: int, *, counted: bool = True) -> None:
    report = _run(tmp_path, {"stale_cache": n}, seed=seed, counted=counted)
    if any("bed unavailable" in p for p in report.problems):
        pytest.skip("; ".join(report.problems))
    assert report.total("faults", "stale_cache") == n, report.table()


@pytest.mark.slow
@pytest.mark.sshfs
def test_sigkill_on_stale_cache_shared_storage(tmp_path: Path) -> None:
    """Kills on a 2-node job whose nodes see one directory through two stale-caching sshfs mounts."""
    _stale_cache(tmp_path, CI_STALE_CACHE, seed=12)


@pytest.mark.slow
@pytest.mark.sshfs
@pytest.mark.long
def test_sigkill_on_stale_cache_shared_storage_long(tmp_path: Path) -> None:
    """The long run's stale-cache kills: at save phases, at random moments and during loads."""
    _stale_cache(tmp_path, LONG_STALE_CACHE, seed=32, counted=False)


@pytest.mark.slow
def test_corruption_after_commit(tmp_path: Path) -> None:
    """Bit flips, truncation, zero-filled blocks, deleted and extra files in the newest checkpoint:
    load(step=None) falls back (or loads, if harmless) bitwise, verify flags every damage."""
    report = _run(tmp_path, {"corruption": 55}, seed=13)
    for damage in campaign.DAMAGES:
        assert report.tallies[("corruption", damage)].faults == 11, report.table()


@pytest.mark.slow
def test_disk_full_mid_save(tmp_path: Path) -> None:
    """The root on a small tmpfs, filled to a random few bytes short of the next save."""
    report = _run(tmp_path, {"disk_full": 16}, seed=14)
    if any("bed unavailable" in p for p in report.problems):
        pytest.skip("; ".join(report.problems))
    # A fill can leave just enough room for the save: that trial checks, but injects nothing.
    assert report.total("faults", "disk_full") >= 12, report.table()


@pytest.mark.slow
def test_two_jobs_on_one_root_and_a_stolen_lease(tmp_path: Path) -> None:
    """Two jobs started at once: one is refused, naming the holder. A stalled holder whose lease was
    taken over is fenced off when it wakes up. `latest` never moves backwards."""
    report = _run(tmp_path, {"two_jobs": 1, "takeover": 1}, seed=15)
    assert report.total("faults", "two_jobs") == 1 and report.total("faults", "takeover") == 1, report.table()


@pytest.mark.slow
def test_kills_during_overwrite_and_rollback_saves_on_two_storage_domains(tmp_path: Path) -> None:
    """SIGKILL during save(overwrite=True) and during the saves after a rollback, on two simulated nodes
    with private roots; judged in commit order (newest = committed last, `latest` by its seq)."""
    report = _run(tmp_path, {"kill_overwrite": 1, "kill_rollback": 1}, seed=16)
    assert report.total("faults", "kill_overwrite") == 1 and report.total("faults", "kill_rollback") == 1, (
        report.table()
    )


@pytest.mark.slow
@pytest.mark.long
def test_a_resumed_campaign_in_the_same_workdir_starts_on_fresh_roots(tmp_path: Path) -> None:
    """Every campaign run works on roots of its own: with fixed root names a later run with the same
    --workdir would restart its kill chain on the earlier run's committed steps ("steps [21, 22] are
    committed but no job ever saved them") and its corruption job on the earlier run's damaged
    checkpoints. Two runs, one workdir: the second must see nothing of the first."""
    plan = {"kill_phase": 1, "corruption": 2}
    _run(tmp_path, plan, seed=21, counted=False)
    _run(tmp_path, plan, seed=22, counted=False)


#: The stop points test_reliability does not cover (it stops after publish and after commit).
CI_STOP_POINTS = ("latest-cas", "retention", "renewal-cas", "release", "mid_write")


@pytest.mark.slow
def test_sigstop_in_latest_retention_lease_renewal_and_release_with_a_takeover(tmp_path: Path) -> None:
    """A job stopped (SIGSTOP) inside the compare-and-swap of `latest`, in retention, inside a lease
    renewal's compare-and-swap, in close() and mid-write; another job takes the root over; the first,
    resumed, changes nothing of the second's (`tools/campaign.py --kinds stop` runs every point)."""
    from tests.support import campaign_kinds

    c = campaign.Campaign(tmp_path, seed=17, log=print)
    campaign_kinds.stops(c, len(CI_STOP_POINTS), points=CI_STOP_POINTS)
    report = c.report
    print(report.table())
    detail = "\n".join([report.table(), *report.problems[:20]])
    assert report.total("failures") == 0 and report.total("torn") == 0 and report.total("lost") == 0, detail
    FAULTS["stop"] = report.total("faults", "stop")
    assert FAULTS["stop"] == len(CI_STOP_POINTS), detail


@pytest.mark.slow
def test_readers_failed_loads_restores_per_rank_values_async_exits_and_hostile_checkpoints(tmp_path: Path) -> None:
    """A read_only reader while the writer retires or overwrites what it reads; the caller's state after
    failed loads (strict=False too); files= restores into non-empty and shared directories; per-rank
    values of every size; exit and destroy_process_group with a background save in flight; hostile
    checkpoints (FIFOs, symlinks, oversized lengths, deep nesting) under a timeout."""
    plan = {"reader": 4, "load_state": 4, "restore": 4, "per_rank": 6, "async_exit": 5, "hostile": 11}
    report = _run(tmp_path, plan, seed=18)
    for kind in ("load_state", "restore", "per_rank", "async_exit", "hostile"):
        assert report.total("faults", kind) == plan[kind], report.table()


def test_campaign_total() -> None:
    """The issue's bar for CI: at least 100 injected faults across all kinds (when every part ran)."""
    if set(FAULTS) != set(campaign.KINDS):
        pytest.skip(f"only {sorted(FAULTS)} ran in this session")
    assert sum(FAULTS.values()) >= 100, FAULTS


# -- the checks are not vacuous -------------------------------------------------------------------


def _ev(event: str, rank: int = 0, **kw: object) -> dict:
    return {"event": event, "rank": rank, **kw}


def _restart_events(steps: list[int], loaded: list[dict], garbage: dict | None = None) -> dict[int, list[dict]]:
    evs = [
        _ev("start", steps=steps, domains=[[0, 1]]),
        *loaded,
        _ev("saving", step=99, gen=9),
        _ev("saved", step=99, gen=9, committed=[*steps, 99]),
        _ev("garbage", root="/r", **{"staging": [], "trash": [], **(garbage or {})}),
    ]
    return {0: evs, 1: []}


def _loaded(step: int, gen: int, what: str = "newest", ok: bool = True) -> dict:
    return _ev(
        "loaded", what=what, step=step, gen=gen, ok=ok, bad=[] if ok else ["tensors.big"], warned=[], extra_files=[]
    )


def _judge(steps: list[int], loaded: list[dict], history: object, garbage: dict | None = None) -> object:
    trial = campaign.Trial("kill_phase", "test")
    topo = campaign.Topo("single", 1, 2, [Path("/r")], [Path("/r")], (0,))
    campaign.check_restart(trial, _restart_events(steps, loaded, garbage), topo, history)
    return trial


def test_restart_checks_flag_torn_lost_invented_and_garbage() -> None:
    """The driver's verdicts on synthetic events: a campaign that can only pass proves nothing."""
    hist = campaign.History(committed=[3, 4, 5], attempted={3: 1, 4: 1, 5: 2, 6: 2})
    ok = _judge([3, 4, 5], [_loaded(5, 2), _loaded(4, 1, "older"), _loaded(3, 1, "older")], hist)
    assert not ok.problems
    committed_after_kill = _judge([4, 5, 6], [_loaded(6, 2), _loaded(5, 2, "older"), _loaded(4, 1, "older")], hist)
    assert not committed_after_kill.problems  # step 6 was in flight; retention may then drop step 3
    lost = _judge([4, 5], [_loaded(5, 2), _loaded(4, 1, "older")], hist)
    assert lost.lost and not lost.torn  # 3 is among the 3 newest of old and new: it must still be there
    newest_lost = _judge([3, 4], [_loaded(4, 1), _loaded(3, 1, "older")], hist)
    assert newest_lost.lost
    invented = _judge([3, 4, 5, 7], [_loaded(7, 2)], hist)
    assert invented.torn  # nobody ever saved step 7
    torn = _judge([3, 4, 5], [_loaded(5, 2, ok=False)], hist)
    assert torn.torn
    stale = _judge([3, 4, 5], [_loaded(5, 1)], hist)
    assert stale.torn  # step 5 holds job 1's data, but job 2 saved it last
    fallback = _judge([3, 4, 5], [_loaded(4, 1)], hist)
    assert fallback.problems and not fallback.torn  # load(step=None) must return the newest
    garbage = _judge([3, 4, 5], [_loaded(5, 2)], hist, {"staging": ["step-00000006.ab"]})
    assert garbage.problems


def test_ordered_restart_checks_flag_lost_reordered_and_wrong_versions() -> None:
    """The commit-order checks of kill_overwrite/kill_rollback on synthetic events."""
    from tests.support import campaign_kinds as kinds

    def judge(steps: list[int], loaded: list[dict], hist: object) -> campaign.Trial:
        trial = campaign.Trial("kill_rollback", "test")
        kinds.check_restart_ordered(trial, _restart_events(steps, loaded), hist)  # type: ignore[arg-type]
        return trial

    # Rolled back to 10 from [10, 20, 30]; the save of 11 was cut by the kill.
    hist = kinds.OrderedHistory([10, 20, 30], {10: {1}, 20: {1}, 30: {1}, 11: {2}}, inflight=(11, 2, False))
    assert not judge([10, 20, 30], [_loaded(30, 1)], hist).problems  # not committed: nothing changed
    # Committed: retention (keep_last=3) retires the abandoned 20 first.
    assert not judge([10, 30, 11], [_loaded(11, 2)], hist).problems
    assert judge([20, 30, 11], [_loaded(11, 2)], hist).lost  # 10 is on the current line: kept before 20
    assert judge([10, 20], [_loaded(20, 1)], hist).lost  # 30 gone and nothing newer committed
    assert judge([10, 20, 30], [_loaded(20, 1)], hist).problems  # load() must return 30, committed last
    assert judge([20, 10, 30], [_loaded(30, 1)], hist).problems  # commit order changed
    ow = kinds.OrderedHistory([10, 20], {10: {1}, 20: {1, 3}}, inflight=(20, 3, True))
    assert not judge([10, 20], [_loaded(20, 1)], ow).problems  # the overwrite did not land: the old version
    assert not judge([10, 20], [_loaded(20, 3)], ow).problems  # it landed: the new one
    assert judge([10, 20], [_loaded(20, 2)], ow).torn  # a version nobody saved at that step
    assert kinds.retained([10, 20, 30], 11, 3) == {10, 30, 11}
    assert kinds.retained([10, 30, 11], 12, 3) == {10, 11, 12}


def test_corruption_checks_flag_a_missed_damage_and_wrong_bytes() -> None:
    topo = campaign.Topo("shared", 1, 2, [Path("/r")], [Path("/r")], (0,))
    damage = {
        "trial": 0,
        "step": 8,
        "what": "bitflip data/rank00000_0.bin byte 3 bit 1",
        "verify_intact": False,
        "cli": {"rc": 1, "flagged": [8], "target_listed": True},
    }
    evs = {
        r: [_ev("fallback", r, trial=0, target=8, loaded=7), {**_loaded(7, 5, "after-damage"), "rank": r, "trial": 0}]
        for r in range(2)
    }
    good = campaign.Trial("corruption", "bitflip")
    campaign.check_damage(good, damage, evs, topo, gen=5)
    assert not good.problems
    missed = campaign.Trial("corruption", "bitflip")
    campaign.check_damage(missed, {**damage, "verify_intact": True}, evs, topo, gen=5)
    assert missed.problems
    # An extra file: verify warns and keeps the step intact (rc 0), as the load that gives it agrees.
    extra = {**damage, "kind": "extra", "what": "extra NOTES.txt", "problems": ["extra"], "verify_intact": True}
    harmless = campaign.Trial("corruption", "extra")
    campaign.check_damage(harmless, {**extra, "cli": {"rc": 0, "flagged": [], "target_listed": True}}, evs, topo, 5)
    assert not harmless.problems
    flagged = campaign.Trial("corruption", "extra")
    campaign.check_damage(flagged, {**extra, "verify_intact": False}, evs, topo, gen=5)
    assert flagged.problems
    evs[1][1] = {**evs[1][1], "ok": False, "bad": ["model"]}
    torn = campaign.Trial("corruption", "bitflip")
    campaign.check_damage(torn, damage, evs, topo, gen=5)
    assert torn.torn


# -- library bugs found by the campaign (regression tests) ---------------------------------------


def test_fallback_leaves_no_files_of_the_rejected_checkpoint(tmp_path: Path) -> None:
    """Found by corruption trials: files= artifacts were restored file by file; when one file of
    the newest checkpoint turned out corrupt, load fell back to the previous step, but the files
    already restored from the newest one stayed in the destination, a mix of two checkpoints
    (with several ranks, every rank got the leftovers)."""
    with Checkpointer(tmp_path / "ckpt") as ck:
        src = tmp_path / "offload"
        src.mkdir()
        (src / "b.bin").write_bytes(b"step 1")
        ck.save(1, {"x": torch.ones(1)}, files={"aux": src})
        (src / "a-new.bin").write_bytes(b"only in step 2")
        (src / "b.bin").write_bytes(b"step 2")
        ck.save(2, {"x": torch.ones(1)}, files={"aux": src})
        (Path(ck.root) / "step-00000002" / "files" / "rank00000" / "aux" / "b.bin").write_bytes(b"rot!!!")
        dest = tmp_path / "restored"
        with pytest.warns(UserWarning, match="falling back"):
            assert ck.load({"x": torch.zeros(1)}, files={"aux": dest}) == 1
        assert (dest / "b.bin").read_bytes() == b"step 1"
        assert sorted(os.listdir(dest)) == ["b.bin"]  # a-new.bin of step 2 was left there


def test_lease_survives_a_transient_renewal_failure(tmp_path: Path) -> None:
    """Found by disk-full trials: the renewal thread recorded the first failed renewal as 'lease
    lost' and never retried, although the lease file still named the job; once the disk had been
    full for longer than TTL/4 (7.5 s by default), every later save failed with the fencing error,
    even after space was back."""
    try:
        cm = small_filesystem("4m", base=tmp_path)
        mnt = cm.__enter__()
    except BedUnavailable as e:
        pytest.skip(str(e))
    ck = None
    try:
        ck = Checkpointer(mnt / "ckpt", lease_ttl_s=1.0)  # renews every 0.25 s
        ck.save(1, {"x": torch.ones(10)})
        filler = mnt / "filler"
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        time.sleep(1.0)  # a few renewals fail while the disk is full
        filler.unlink()
        ck.save(2, {"x": torch.ones(10)})  # failed: "renewing the lease failed: [Errno 28] ..."
        assert ck.steps() == [1, 2]
    finally:
        if ck is not None:
            ck.close()
        cm.__exit__(None, None, None)


def test_a_new_checkpointer_per_save_keeps_saving(tmp_path: Path) -> None:
    """Found by disk-full trials (which re-open Checkpointers): two ranks, each of 60 saves made by a
    new Checkpointer on the same root, the previous one closed and dropped. DCP's plan cache was keyed
    by id(Checkpointer); CPython reuses a freed object's address, so a new Checkpointer could get an
    old one's id on one rank and not another: that rank used a cached plan, the others did not, and
    dcp.save failed (KeyError 'DomainSavePlanner:<id>:<hash>', or "TypeError: 'NoneType' object is
    not iterable") within 2-12 re-creations."""
    job = run_local(
        CAMPAIGN_JOB,
        ["recreate", "--gen", "1", "--trials", "60"],
        nproc=2,
        env={"CKPT_ROOT": str(tmp_path / "ckpt"), "CKPT_SCRATCH": str(tmp_path)},
        timeout=170,
    )
    assert job.ok, job.output()[-3000:]


_STALLED_CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    from ckptguard import Checkpointer, CheckpointError
    from ckptguard.storage.posix import PosixStorage
    ck = Checkpointer(sys.argv[1], lease_ttl_s=1.0)
    ck.save(1, {"x": torch.ones(4)})
    many = {f"t{i}": torch.full((64,), float(i)) for i in range(3000)}
    replace = PosixStorage.replace

    def stop_as_the_manifest_is_written(self, path, data):  # after the lease check, before the publish
        if "staging" in path and path.endswith("MANIFEST.json") and not os.environ.get("STOPPED"):
            os.environ["STOPPED"] = "1"
            os.kill(os.getpid(), signal.SIGSTOP)
        return replace(self, path, data)
    PosixStorage.replace = stop_as_the_manifest_is_written
    print("READY", flush=True)
    sys.stdin.readline()
    try:
        ck.save(2, many)
        print("PUBLISHED", flush=True)
    except CheckpointError as e:
        print("FENCED", e, flush=True)
""")


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP): its state in /proc/PID/stat is T."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _stall_before_publish_and_take_over(tmp_path: Path) -> tuple[str, list[int]]:
    """A child process saves; stop it once its attempt's manifest is being written; let its lease
    expire; take the root over here; resume it. Returns its output and the steps committed after."""
    root = tmp_path / "ckpt"
    child = subprocess.Popen(
        [sys.executable, "-c", _STALLED_CHILD, str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().startswith("READY")
        child.stdin.write("go\n")
        child.stdin.flush()
        deadline = time.monotonic() + 60
        while not _stopped(child.pid):  # it stops itself as its attempt's manifest is written
            assert time.monotonic() < deadline and child.poll() is None, "the save never reached its manifest"
            time.sleep(0.01)
        assert not (root / "step-00000002").exists()
        time.sleep(1.5)  # the stopped process renews nothing: its lease (TTL 1 s) expires
        with Checkpointer(root, lease_wait_s=5) as owner:  # another job takes the root over
            child.send_signal(signal.SIGCONT)
            out = child.communicate(timeout=60)[0]
            return out, owner.steps(refresh=True)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_job_stalled_before_publish_does_not_publish_after_a_takeover(tmp_path: Path) -> None:
    """Found by takeover trials: a process saves and is stopped (SIGSTOP, as a frozen VM or an NFS
    write hanging in fsync would stop it) once its attempt's manifest is being written, after the
    lease check and before the rename that publishes. Its lease expires; another Checkpointer takes
    the root over. When the first process continued, it used to rename its attempt into place: a
    step of a job that no longer held the lease, committed in the new owner's root (whose own save
    of that step was then refused as "already committed")."""
    out, steps = _stall_before_publish_and_take_over(tmp_path)
    assert "FENCED" in out, out  # was: PUBLISHED
    assert steps == [1]


def test_a_job_fenced_off_inside_a_save_is_told_why(tmp_path: Path) -> None:
    """Same stall as above. The takeover moves the old holder's staging directory away, so its
    publish fails, but with "rank 0 failed on .../staging/step-00000002.<id>/.MANIFEST.json.tmp-<id>:
    FileNotFoundError: [Errno 2] No such file or directory": nothing says that another job took
    the root over (the save between two saves says "this job no longer holds the lease")."""
    out, _ = _stall_before_publish_and_take_over(tmp_path)
    assert "FENCED" in out and "lease" in out, out


_STALLED_EARLY_CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    from ckptguard import Checkpointer, CheckpointError, _faults
    from ckptguard.storage.posix import PosixStorage
    # A visibility timeout far beyond the test's: a wait that does not notice the takeover hangs the test.
    ck = Checkpointer(sys.argv[1], lease_ttl_s=1.0, visibility_timeout_s=600)
    ck.save(1, {"x": torch.ones(4)})

    def stop_once():
        if not os.environ.get("STOPPED"):
            os.environ["STOPPED"] = "1"
            os.kill(os.getpid(), signal.SIGSTOP)

    where = sys.argv[2]
    if where == "before_write":  # every rank: the attempt's directory created, nothing written
        _faults.arm("before_write:0:stop")
    elif where == "files_visible":  # the leader: the check that every rank's files are visible
        listing = PosixStorage.sizes_in
        def stale_then_stop(self, directory):  # whose first listing (NFS) is stale
            if "staging" in directory and not os.environ.get("STOPPED"):
                stop_once()
                return {}
            return listing(self, directory)
        PosixStorage.sizes_in = stale_then_stop
    elif where == "files_to_store":  # every rank: the attempt's directory seen, its files= not yet stored
        wait_visible = PosixStorage.wait_visible
        def seen_then_stop(self, *args, **kwargs):
            wait_visible(self, *args, **kwargs)
            stop_once()
        PosixStorage.wait_visible = seen_then_stop
    else:  # the leader, creating the attempt: right before its directory, or right after it (empty)
        mkdir = PosixStorage.make_dir_durable
        def stop_around(self, path):
            attempt = os.path.basename(path).startswith("step-00000002.")
            if attempt and where == "attempt_to_make":
                stop_once()
            mkdir(self, path)
            if attempt and where == "attempt_made":
                stop_once()
        PosixStorage.make_dir_durable = stop_around
    offload = os.path.join(sys.argv[3], "offload", "sub")  # a files= directory: made again below the attempt
    os.makedirs(offload)
    with open(os.path.join(offload, "state.bin"), "wb") as f:
        f.write(os.urandom(4096))
    try:
        ck.save(2, {"x": torch.full((4,), 2.0), "y": torch.zeros(1000)}, files={"offload": os.path.dirname(offload)})
        print("PUBLISHED", flush=True)
    except CheckpointError as e:
        print("FENCED", type(e).__name__, e, flush=True)
""")


@pytest.mark.parametrize(
    "where", ["attempt_to_make", "attempt_made", "before_write", "files_to_store", "files_visible"]
)
def test_a_job_stalled_early_in_a_save_leaves_nothing_in_the_new_owners_root(tmp_path: Path, where: str) -> None:
    """A job stopped early in a save, its lease taken over (the takeover moves the staging area away),
    then resumed. Stopped right before or right after it made its attempt's directory, it must not make
    the directory again in the new owner's staging area (with its parents) and write its whole checkpoint
    there before the commit's lease check refuses (gigabytes of another job's files filling the new
    owner's disk; a rank's files= artifacts likewise). Stopped while it waits for its attempt's files to
    be visible, it must not wait the whole visibility timeout (60 s by default) for files that can never
    come. It stops at once with the fence's error, and leaves nothing in the new owner's root."""
    root = tmp_path / "ckpt"
    child = subprocess.Popen(
        [sys.executable, "-c", _STALLED_EARLY_CHILD, str(root), where, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while process_state(child.pid) != "T":
            assert time.monotonic() < deadline and child.poll() is None, child.communicate()[0]
            time.sleep(0.02)
        time.sleep(1.5)  # the stopped process renews nothing: its lease (TTL 1 s) expires
        with Checkpointer(root, lease_wait_s=5) as owner:  # another job takes the root over
            child.send_signal(signal.SIGCONT)
            out = child.communicate(timeout=60)[0]  # was (waits): TimeoutExpired, the 600 s waited out
            assert "FENCED LeaseLostError" in out and "no longer holds the lease" in out, out
            assert owner.steps(refresh=True) == [1]
            left = [str(p.relative_to(root)) for p in (root / ".ckptguard" / "staging").rglob("*")]
            assert left == [], (left, out)  # was (attempt): the attempt with its data files
            owner.save(2, {"x": torch.full((4,), 3.0)})
            assert owner.read(2)["x"].tolist() == [3.0] * 4
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGCONT)
            child.kill()
            child.wait()
