"""FlashInfer's JIT modules built on a background thread, while the engine starts.

FlashInfer compiles a module with ``nvcc`` the first time a kernel of it runs
(cached on disk under ``$FLASHINFER_WORKSPACE_BASE``). On a cold machine the
Mamba2 ``selective_state_update`` module was built inside the first decode
graph's capture, after the memory profiling. A backend that knows which module
it will need calls :func:`start` as soon as it does (the SSM backend: when it
first describes a layer's cache, right after the weights are read); the build
then runs beside the memory profiling and the prefill graphs' captures, mostly
in ``nvcc`` subprocesses. The first use calls :func:`wait`: it blocks until the
build is over, and after a failed build it logs the error once and lets the
caller build on use, as FlashInfer would have without this.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["BackgroundBuild", "start", "wait"]

_builds: dict[Hashable, BackgroundBuild] = {}
_lock = threading.Lock()


class BackgroundBuild:
    """One build on a daemon thread (a process may exit while ``nvcc`` still runs).

    :param name: what is built, for the log.
    :param build: builds and loads the module; its result is dropped (FlashInfer
        keeps loaded modules in its own caches).
    """

    def __init__(self, name: str, build: Callable[[], Any]) -> None:
        self.name = name
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._done = threading.Event()
        self._reported = False
        self._thread = threading.Thread(
            target=self._run, args=(build,), name=f"flashinfer-jit {name}", daemon=True
        )
        self._thread.start()

    def _run(self, build: Callable[[], Any]) -> None:
        start = time.perf_counter()
        try:
            build()
        except BaseException as exc:  # noqa: BLE001 - reported by wait(); the use builds instead
            self.error = exc
        finally:
            self.seconds = time.perf_counter() - start
            self._done.set()

    def done(self) -> bool:
        """Whether the build is over (built or failed)."""
        return self._done.is_set()

    def wait(self) -> bool:
        """Block until the build is over.

        :return: ``True`` when it built; ``False`` when it failed (logged as a
            warning the first time), and the caller builds on use.
        """
        if not self._done.is_set():
            start = time.perf_counter()
            self._done.wait()
            logger.info(
                "waited %.2f s for the FlashInfer build of %s",
                time.perf_counter() - start,
                self.name,
            )
        if self.error is None:
            return True
        if not self._reported:
            self._reported = True
            logger.warning(
                "building the FlashInfer module %s in the background failed (%s: %s); "
                "it is built on first use instead",
                self.name,
                type(self.error).__name__,
                self.error,
            )
        return False


def start(key: Hashable, name: str, build: Callable[[], Any]) -> BackgroundBuild:
    """Start building module ``key`` in the background, unless it was started before.

    :param key: identifies the module (its FlashInfer specialisation).
    :param name: what is built, for the log.
    :param build: builds and loads it.
    :return: the build (the earlier one for a key seen before).
    """
    with _lock:
        job = _builds.get(key)
        if job is None:
            job = _builds[key] = BackgroundBuild(name, build)
            logger.debug("building the FlashInfer module %s in the background", name)
        return job


def wait(key: Hashable) -> bool:
    """Wait for the background build of ``key``, if one was started.

    :param key: as given to :func:`start`.
    :return: ``True`` when there was none or it built, ``False`` when it failed
        (see :meth:`BackgroundBuild.wait`).
    """
    job = _builds.get(key)
    return True if job is None else job.wait()
