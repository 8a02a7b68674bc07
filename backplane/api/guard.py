"""One thread at a time in an :class:`~backplane.api.llm.LLM`: the guard and its error."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from backplane.core.errors import BackplaneError

__all__ = ["ConcurrentUseError", "ThreadGuard"]


class ConcurrentUseError(BackplaneError, RuntimeError):
    """Two threads used one :class:`LLM` at the same time.

    :class:`LLM` is driven by one thread at a time (calls from different
    threads one after the other are fine). To serve many callers at once, use
    :class:`~backplane.api.async_llm.AsyncLLM`, whose one loop drives the
    engine for every coroutine and thread.
    """


class ThreadGuard:
    """Lets one thread at a time into the engine; re-entrant for that thread.

    A second thread is refused with :class:`ConcurrentUseError` instead of
    waiting: two callers interleaving steps would each consume the other's
    outputs, so queueing them silently would still be wrong for streams.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0

    @contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        """Hold the guard for the block (re-entrant on the holding thread).

        :param what: the ``LLM`` method being called, for the error message.
        :raises ConcurrentUseError: another thread holds it.
        """
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        if not self._lock.acquire(blocking=False):
            raise ConcurrentUseError(
                f"LLM.{what} was called from thread {threading.current_thread().name!r} while "
                "another thread is using this LLM; an LLM serves one thread at a time. Use one "
                "LLM per thread, serialise the calls with a lock, or use "
                "backplane.api.AsyncLLM, which serves any number of threads and coroutines"
            )
        self._owner, self._depth = me, 1
        try:
            yield
        finally:
            self._owner, self._depth = None, 0
            self._lock.release()
