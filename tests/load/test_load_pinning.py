"""A load larger than ``load_memory_bytes`` reads what it verified, even when retention deletes the
checkpoint between the verifying pass and the placing one: the files stay open (POSIX), or the
verified bytes come from a local spill (object stores, and files beyond the descriptor limit).
The outcome is the checkpoint whole, or an error with the caller's state untouched; never a mix."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptguard.dcp.writer as writer_module
from ckptguard import Checkpointer, CheckpointError

from tests.support.jobs import REPO

FILES = 300  # more data files than a load kept open before (256)


def _state(step: int, n: int = FILES) -> dict[str, Any]:
    return {"model": {f"p{i}": torch.full((64,), float(step * 1000 + i)) for i in range(n)}}


def _retire_before_placing(reader: Checkpointer, retire: Callable[[], None]) -> None:
    """Run ``retire`` (another job's save with keep_last=1) once the reader has verified everything
    and just before it places it: between the two passes of the load."""
    comm = reader._session.comm
    original = comm.step

    def step(what: str, *args: Any, **kwargs: Any) -> Any:
        if what.startswith("copy step"):
            retire()
        return original(what, *args, **kwargs)

    comm.step = step  # type: ignore[method-assign]


def _check_whole_or_untouched(reader: Checkpointer, step: int, expected: dict[str, Any]) -> None:
    out = {"model": {k: torch.zeros_like(t) for k, t in expected["model"].items()}}
    try:
        loaded = reader.load(out, step=step)
    except CheckpointError:
        assert not any(t.any() for t in out["model"].values()), "a failed load changed the caller's state"
        raise
    assert loaded == step
    bad = [k for k, t in out["model"].items() if not torch.equal(t, expected["model"][k])]
    assert not bad, f"{len(bad)} of {len(out['model'])} tensors differ from step {step}: {bad[:5]}"


@pytest.fixture
def many_files(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A checkpoint of one file per tensor, as a checkpoint of many ranks loaded by fewer has."""
    monkeypatch.setattr(writer_module, "_MIN_BYTES_PER_FILE", 1)
    yield


def test_retention_between_the_passes_of_a_load_of_many_files(tmp_path: Path, many_files: None) -> None:
    root = tmp_path / "ckpt"
    with Checkpointer(root, keep_last=1, io_threads=FILES) as writer:
        writer.save(1, _state(1))
        assert sum(1 for p in (root / "step-00000001").rglob("*") if p.is_file()) > FILES
        with Checkpointer(root, read_only=True, load_memory_bytes=0) as reader:

            def retire() -> None:
                writer.save(2, _state(2))
                writer._saves.wait_cleanup()
                assert not (root / "step-00000001").exists()

            _retire_before_placing(reader, retire)
            _check_whole_or_untouched(reader, 1, _state(1))


_SPILL_SCRIPT = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (320, 320))  # fewer descriptors than data files
    sys.path.insert(0, sys.argv[2])
    import pytest
    from tests.load import test_load_pinning as t
    import ckptguard.dcp.writer as w
    w._MIN_BYTES_PER_FILE = 1
    from pathlib import Path
    from ckptguard import Checkpointer
    import ckptguard.dcp.reader as r
    root = Path(sys.argv[1])
    with Checkpointer(root, keep_last=1, io_threads=t.FILES) as writer:
        writer.save(1, t._state(1))
        with Checkpointer(root, read_only=True, load_memory_bytes=0) as reader:
            def retire():
                writer.save(2, t._state(2))
                writer._saves.wait_cleanup()
                assert not (root / "step-00000001").exists()
            t._retire_before_placing(reader, retire)
            t._check_whole_or_untouched(reader, 1, t._state(1))
            assert reader.last_load_stats.spilled_bytes > 0, "nothing was spilled"
    print("OK")
""")


def test_files_beyond_the_descriptor_limit_are_read_again_from_the_spill(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    out = subprocess.run(
        [sys.executable, "-c", _SPILL_SCRIPT, str(tmp_path / "ckpt"), str(REPO)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


# -- object stores: a second pass never fetches again ------------------------------------------------

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")

from tests.support.beds.s3 import S3Bed, s3_bed_in_env  # noqa: E402


@pytest.fixture(scope="module")
def bed() -> Iterator[S3Bed]:
    with s3_bed_in_env(seed=22) as b:
        yield b


def test_s3_retention_between_the_passes_never_reads_the_deleted_objects(bed: S3Bed) -> None:
    bucket = bed.make_bucket(f"ckpt-{uuid.uuid4().hex[:12]}")
    url = f"s3://{bucket}/root"
    state = {"model": {f"p{i}": torch.full((4096,), float(1000 + i)) for i in range(40)}}
    with Checkpointer(url, keep_last=1) as writer:
        writer.save(1, state)
        with Checkpointer(url, read_only=True, load_memory_bytes=0) as reader:

            def retire() -> None:
                writer.save(2, {"model": {k: t + 1 for k, t in state["model"].items()}})
                writer._saves.wait_cleanup()
                listed = bed.client(direct=True).list_objects_v2(Bucket=bucket, Prefix="root/").get("Contents", [])
                assert not [o["Key"] for o in listed if "step-00000001" in o["Key"] and "/data/" in o["Key"]]

            _retire_before_placing(reader, retire)
            _check_whole_or_untouched(reader, 1, state)
            assert reader.last_load_stats.spilled_bytes > 0


# -- read in place: the old bytes come back unless every rank agreed ---------------------------------


def test_a_corrupt_item_puts_back_the_items_already_read_in_place(tmp_path: Path) -> None:
    """Within the budget items are read straight into the caller's tensors; a corrupt item after
    them puts every one of them back, parameters (requires_grad) included."""
    from tests.support.manifests import flip_last_byte

    root = tmp_path / "ckpt"
    model = torch.nn.Linear(64, 64)
    saved = {"model": model.state_dict(), "extra": {f"t{i}": torch.full((1000,), float(i)) for i in range(50)}}
    with Checkpointer(root) as ck:
        ck.save(1, saved)
        flip_last_byte(root, 1, "extra.t49")
        fresh = torch.nn.Linear(64, 64)
        before = {k: v.clone() for k, v in fresh.state_dict().items()}
        out = {"model": fresh, "extra": {f"t{i}": torch.full((1000,), -1.0) for i in range(50)}}
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            ck.load(out, step=1)
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())
        assert all(bool((t == -1).all()) for t in out["extra"].values())


def test_tied_destinations_load_equal(tmp_path: Path) -> None:
    """Two keys naming one tensor (tied weights) are not read in place: both get the saved bytes."""
    shared = torch.arange(512.0)
    with Checkpointer(tmp_path / "ckpt") as ck:
        ck.save(1, {"a": shared, "b": shared.clone(), "c": shared[:256]})
        dest = torch.zeros(512)
        out = {"a": dest, "b": dest, "c": dest[:256]}
        assert ck.load(out) == 1
        assert torch.equal(dest, shared)


def test_the_default_budget_verifies_first_while_the_page_cache_holds_the_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default on POSIX a state the page cache can hold is verified first and read again into place
    from the files kept open (nothing held in host memory); a state too large for it is read once up
    to 256 MiB, the rest verified first; the object store default is a share of MemAvailable."""
    import ckptguard.dcp.loadmemory as memory_module
    from ckptguard.dcp.loadmemory import auto_memory_bytes

    assert 0 < auto_memory_bytes(4) < auto_memory_bytes(1)
    state = {"a": torch.arange(10_000.0), "b": torch.ones(3, 5)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with Checkpointer(tmp_path / "ckpt") as ck:
        ck.save(1, state)
        out = {"a": torch.zeros(10_000), "b": torch.zeros(3, 5)}
        assert ck.load(out) == 1 and all(torch.equal(out[k], state[k]) for k in state)
        stats = ck.last_load_stats
        assert stats is not None and stats.verified_only_bytes == nbytes and stats.staged_bytes == 0
        assert stats.spilled_bytes == 0
        # A host whose available memory could not keep the state between the passes: read once.
        monkeypatch.setattr(memory_module, "available_bytes", lambda: nbytes)
        out = {"a": torch.zeros(10_000), "b": torch.zeros(3, 5)}
        assert ck.load(out) == 1 and all(torch.equal(out[k], state[k]) for k in state)
        stats = ck.last_load_stats
        assert stats is not None and stats.staged_bytes == nbytes and stats.verified_only_bytes == 0


def test_the_default_two_pass_load_fills_every_kind_of_destination(tmp_path: Path) -> None:
    """Verified first, then read into place: a non-contiguous destination, a lossless widening, a tensor
    nested in a list next to plain objects, and a parameter that requires grad all come back exact."""
    weight = torch.arange(12.0).reshape(3, 4)
    state = {
        "w": weight,
        "h": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "nested": {"xs": [torch.ones(5), {"k": 7, "s": "text"}]},
        "p": torch.nn.Parameter(torch.full((4,), 3.0)),
    }
    with Checkpointer(tmp_path / "ckpt") as ck:
        ck.save(1, state)
    out = {
        "w": torch.zeros(4, 3).t(),
        "h": torch.zeros(2),
        "nested": {"xs": [torch.zeros(5), {"k": 0, "s": ""}]},
        "p": torch.nn.Parameter(torch.zeros(4)),
    }
    assert not out["w"].is_contiguous()
    with Checkpointer(tmp_path / "ckpt", read_only=True) as reader:
        assert reader.load(out) == 1
        stats = reader.last_load_stats
        assert stats is not None and stats.verified_only_bytes > 0
    assert torch.equal(out["w"], weight) and torch.equal(out["h"], torch.tensor([1.5, -2.0]))
    assert torch.equal(out["nested"]["xs"][0], torch.ones(5)) and out["nested"]["xs"][1] == {"k": 7, "s": "text"}
    assert torch.equal(out["p"].detach(), torch.full((4,), 3.0)) and out["p"].requires_grad


@pytest.mark.parametrize(
    "how",
    [
        "truncate",
        "overwrite",
        "overwrite keeping mtime",
        "mapped and written",
        "written through a mapping already dirty",
    ],
)
def test_a_file_changed_in_place_between_the_passes_is_a_torn_load_never_a_fallback(tmp_path: Path, how: str) -> None:
    """Bytes changed in place after they were verified (never by ckptguard) are found in the second
    pass, once destinations may hold part of the step: a TornLoadError, also for a file cut short
    (never a CorruptCheckpointError: load() would fall back to an older step, leaving bytes of the
    rejected one in the state). The last case moves neither mtime nor ctime (a shared mapping whose
    page is already dirty and writable writes without a fault), so a second read is never trusted from
    unchanged file times: it is hashed again, always."""
    import mmap

    from ckptguard import TornLoadError

    root = tmp_path / "ckpt"
    with Checkpointer(root) as writer:
        writer.save(1, _state(1, 8))
        writer.save(2, _state(2, 8))
    data = sorted(p for p in (root / "step-00000002").rglob("*.bin"))[0]
    with contextlib.ExitStack() as stack:
        mapped: mmap.mmap | None = None
        if how == "written through a mapping already dirty":
            f = stack.enter_context(open(data, "r+b"))
            mapped = stack.enter_context(mmap.mmap(f.fileno(), 0))
            mapped[0:1] = mapped[0:1]  # the page is now dirty and writable: later writes move no timestamp
            time.sleep(2.5)  # its ctime now older than any "settled" window a trusting second read might use
        reader = stack.enter_context(Checkpointer(root, read_only=True, load_memory_bytes=0))

        def damage() -> None:
            before = data.stat()
            if how == "truncate":
                os.truncate(data, before.st_size // 2)
            elif mapped is not None:
                mapped[:64] = b"\xff" * 64
            elif how == "mapped and written":
                with open(data, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
                    m[:64] = b"\xff" * 64
            else:
                with open(data, "r+b") as f:
                    f.write(b"\xff" * 64)
                if how == "overwrite keeping mtime":
                    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))

        _retire_before_placing(reader, damage)
        out = {"model": {k: torch.zeros_like(t) for k, t in _state(2, 8)["model"].items()}}
        with pytest.raises(TornLoadError, match="modified in place during this load"):
            reader.load(out)  # step=None: a corrupt newest step would fall back to step 1


def test_a_file_changed_in_place_among_many_is_torn_and_every_placing_thread_stops(
    tmp_path: Path, many_files: None
) -> None:
    """The second pass places the files on several threads at once: one file changed in place among
    many is still a TornLoadError, and no placing thread outlives the load that raised it."""
    import threading

    from ckptguard import TornLoadError

    root = tmp_path / "ckpt"
    with Checkpointer(root, io_threads=16) as writer:
        writer.save(1, _state(1, 64))
        writer.save(2, _state(2, 64))
    files = sorted((root / "step-00000002").rglob("*.bin"))
    assert len(files) > 4, f"{len(files)} data files: the second pass would not run on several threads"
    victim = files[len(files) // 2]
    with Checkpointer(root, read_only=True, load_memory_bytes=0, io_threads=4) as reader:

        def damage() -> None:
            with open(victim, "r+b") as f:
                f.write(b"\xff" * 64)

        _retire_before_placing(reader, damage)
        out = {"model": {k: torch.zeros_like(t) for k, t in _state(2, 64)["model"].items()}}
        with pytest.raises(TornLoadError, match="modified in place during this load"):
            reader.load(out)
        left = [t.name for t in threading.enumerate() if t.name.startswith("ckptguard-place")]
        assert not left, f"placing threads still running after the load raised: {left}"


def _mapping_of(address: int) -> tuple[str, dict[str, str]]:
    """The permissions and the fields of the /proc/self/smaps entry that holds ``address``."""
    perms, fields, inside = "", {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                if inside:
                    break
                start, end = (int(x, 16) for x in head[0].split("-"))
                inside = start <= address < end
                perms = head[1]
            elif inside and ":" in head[0]:
                fields[head[0].rstrip(":")] = " ".join(head[1:])
    assert inside, f"no mapping holds {address:#x}"
    return perms, fields


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only")
def test_a_loads_host_memory_is_private_and_may_use_huge_pages() -> None:
    """The host memory of a load's staged items and saved old bytes is faulted in page by page while
    the load runs: private anonymous memory the kernel may back with transparent huge pages (a copy
    into it 2.5 GB/s here, against 0.9 GB/s into the shared mapping ``mmap.mmap(-1, n)`` makes)."""
    import numpy as np

    from ckptguard.dcp.readjob import Arena

    arena = Arena(8 << 20)
    try:
        held = np.frombuffer(arena.view, dtype=np.uint8)
        perms, fields = _mapping_of(held.ctypes.data)
        del held
        assert perms.endswith("p"), f"the arena is a {perms} mapping: shared, not private"
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read()
        if "[never]" not in thp and "THPeligible" in fields:
            assert fields["THPeligible"] == "1", f"THP is {thp.strip()!r}, yet the arena may not use it"
    finally:
        arena.close()


_INTERRUPT_SCRIPT = textwrap.dedent("""
    import faulthandler, os, random, signal, sys, threading, time
    import torch
    import ckptguard.dcp.writer as w
    from ckptguard import Checkpointer
    w._MIN_BYTES_PER_FILE = 1  # many data files: the reads and the second pass run on several threads
    root, budget, loads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    g = torch.Generator().manual_seed(0)
    saved = {f"t{i}": torch.randn(300_000 + 1000 * i, generator=g) for i in range(24)}
    saved["obj"] = {"k": 1}
    if not os.path.exists(root):
        with Checkpointer(root, io_threads=16) as ck:
            ck.save(1, saved)
    reader = Checkpointer(root, read_only=True, load_memory_bytes=budget)

    def fresh():
        out = {k: torch.full_like(v, -7.0) for k, v in saved.items() if k != "obj"}
        out["obj"] = {"k": -1}
        return out

    t0 = time.perf_counter(); reader.load(fresh(), step=1); took = time.perf_counter() - t0
    armed = [False]
    def once(*_):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt  # one Ctrl-C
    signal.signal(signal.SIGINT, once)
    rng = random.Random(budget)
    outcomes = {}
    for i in range(loads):
        out = fresh()
        faulthandler.dump_traceback_later(60, exit=True)  # a load that hangs fails the test
        armed[0] = True
        timer = threading.Timer(rng.uniform(0, took * 1.2), os.kill, (os.getpid(), signal.SIGINT))
        how = None
        # The signal may land anywhere from the timer's start to the handler's run: all of that is inside
        # the outer try, which the loop leaves only once the handler has run (armed is cleared).
        try:
            timer.start()
            try:
                reader.load(out, step=1)
                how = "loaded"
            except KeyboardInterrupt:
                how = "interrupted"
            timer.join()
            while armed[0]:
                time.sleep(0.001)
        except KeyboardInterrupt:
            timer.join()
            how = how or "interrupted"  # before the load began (the old state), or after it returned
        faulthandler.cancel_dump_traceback_later()
        new = [k for k in saved if k != "obj" and torch.equal(out[k], saved[k])]
        old = [k for k in saved if k != "obj" and bool((out[k] == -7.0).all())]
        if how == "loaded":
            assert len(new) == len(saved) - 1 and out["obj"] == {"k": 1}, f"load {i}: returned with {len(old)} old"
        else:
            assert len(new) in (0, len(saved) - 1) and len(new) + len(old) == len(saved) - 1, (
                f"load {i}: interrupted, state half placed: {len(new)} new, {len(old)} old")
            assert out["obj"] == ({"k": 1} if new else {"k": -1}), f"load {i}: tensors and objects disagree"
        time.sleep(0.05)
        left = [t.name for t in threading.enumerate() if t.name.startswith("ckptguard")]
        assert not left, f"load {i} ({how}): threads left: {left}"
        outcomes[how] = outcomes.get(how, 0) + 1
    reader.close()
    print("OK", outcomes)
""")


@pytest.mark.parametrize("budget", [0, 1 << 40], ids=["verify first", "in place"])
def test_a_ctrl_c_during_a_load_leaves_the_state_old_or_whole_and_no_thread_behind(tmp_path: Path, budget: int) -> None:
    """A Ctrl-C (KeyboardInterrupt) at a random moment of a load: the state is the old one (the old
    bytes put back once every reading thread stopped) or the whole step (the interrupt delivered once
    every byte agreed on is in place), never half; no load hangs, no thread is left: no worker started
    but unrecorded by the pool, no join abandoned while a thread still reads into place, no second pass
    cut halfway."""
    proc = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_SCRIPT, str(tmp_path / "ckpt"), str(budget), "40"],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
