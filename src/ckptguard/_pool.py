"""The thread pool of one read, write or listing: usable while the interpreter exits.

``concurrent.futures.ThreadPoolExecutor`` refuses new work once the interpreter has begun to exit
(``RuntimeError: cannot schedule new futures after interpreter shutdown``): a load in a thread the
script did not wait for, or a background save still running when the main thread returned, died
there with an "Exception in thread" traceback. Exiting is exactly when the threads that are still
running must be able to finish. Workers are daemon threads, so an idle pool (a ``Checkpointer``
never closed) never keeps the process alive; the caller waits for the work it submitted.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

from ckptguard._signals import signals_deferred

P = ParamSpec("P")
T = TypeVar("T")

_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class ExitSafePool(Executor):
    """``ThreadPoolExecutor``'s ``submit`` / ``map`` / ``shutdown`` / ``with``, at exit too."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max = max_workers
        self._prefix = thread_name_prefix
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        # A Ctrl-C between starting a worker and recording it would leave one that shutdown() never
        # tells to stop: its sentinel taken by that one, the join of another waits forever.
        with signals_deferred(), self._lock:
            if self._closed:
                raise RuntimeError("cannot submit to a pool that was shut down")
            self._queue.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                t = threading.Thread(target=self._work, name=f"{self._prefix}_{len(self._threads)}", daemon=True)
                t.start()
                self._threads.append(t)
        return future

    def _work(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            future, fn, args, kwargs = work
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:
                    future.set_exception(e)
                else:
                    future.set_result(result)
            del work, future, fn, args, kwargs  # no reference to a result kept while idle
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    work = self._queue.get_nowait()
                except queue.Empty:
                    break
                if work is not None:
                    work[0].cancel()
        for _ in threads:
            self._queue.put(None)
        if wait:
            for t in threads:
                if t is not threading.current_thread():
                    t.join()
