"""Per-phase wall time of saves and loads, and the GC pause around them."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator

_gc_lock = threading.Lock()
_gc_depth = 0
_gc_was_enabled = True


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic GC during a save or load (reference-counted: background saves nest with the caller's).

    A save allocates many small objects (plans, write items, manifest rows); with
    a large heap (a model, its optimizer), each generation-2 collection they
    trigger walks everything, which cost ~10% of a save of 20,000 tensors. The
    pause lasts one save; reference counting frees everything acyclic meanwhile.
    """
    global _gc_depth, _gc_was_enabled
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_enabled:
                gc.enable()


class PhaseTimer:
    """Wall time per phase of the last save or load (``Checkpointer.last_save_stats``)."""

    def __init__(self, show_progress: bool = False) -> None:
        self.seconds: dict[str, float] = {}
        self.bytes = 0
        self.blocked = 0.0  # how long save() kept the caller waiting
        self.staged_bytes = 0  # load: verified in host memory, then copied into place
        self.verified_only_bytes = 0  # load: beyond load_memory_bytes, verified, then read again into place
        self.spilled_bytes = 0  # load: of those, read again from a local spill file, not from storage
        self.show_progress = show_progress

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def __repr__(self) -> str:
        parts = ", ".join(f"{k} {v:.3f}s" for k, v in self.seconds.items())
        return f"{self.total:.3f}s ({parts}), caller blocked {self.blocked:.3f}s, {self.bytes} bytes on this rank"
