"""Work that must not stop halfway in the main thread.

Python runs signal handlers in the main thread, between any two bytecodes: a Ctrl-C
(KeyboardInterrupt), or a SIGTERM handler that raises, can land inside a thread pool's bookkeeping
(a worker started but not recorded: never told to stop, so a later join waits forever), inside the
wait for threads that still write the caller's memory (abandoned: they write on after the old bytes
were put back), or halfway through putting back or placing a load's bytes (a state half old, half
new). Inside :func:`signals_deferred` such signals are noted and delivered once the work is done.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

#: The signals whose Python handlers are held back: those that raise into Python code.
_HELD = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Run the body to its end; a SIGINT or SIGTERM whose handler is a Python function is handled
    once it has (KeyboardInterrupt then raised here). A no-op outside the main thread, where no
    handler runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[tuple[int, FrameType | None]] = []
    previous: dict[int, Any] = {}
    early: BaseException | None = None

    def note(signum: int, frame: FrameType | None) -> None:
        noted.append((signum, frame))

    for sig in _HELD:
        try:
            handler = signal.getsignal(sig)
            if callable(handler) and handler is not note:
                previous[sig] = handler
                signal.signal(sig, note)
        except (ValueError, RuntimeError, TypeError):  # not the main interpreter, or shutting down
            break
        except BaseException as e:  # a signal handled before its handler was replaced
            early = early or e
    try:
        yield
    finally:
        late: BaseException | None = None
        for sig, handler in previous.items():
            try:
                signal.signal(sig, handler)
            except BaseException as e:  # restore every handler whatever happens
                late = late or e
        try:
            for signum, frame in noted:
                previous[signum](signum, frame)
        finally:
            if early is not None:
                raise early
            if late is not None:
                raise late
