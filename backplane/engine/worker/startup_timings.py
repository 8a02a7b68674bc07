"""Wall time per start-up phase of an engine, measured where the work happens.

Start-up is a handful of steps (select backends, load weights, profile memory,
allocate caches, capture graphs, warm kernels up, build the scheduler) whose
costs differ by orders of magnitude between a warm and a cold kernel cache.
:class:`StartupTimings` keeps the seconds of each, filled with
``time.perf_counter`` around the steps themselves, so that a slow start-up
says where its time went (one INFO line at the end of start-up, and
``backplane bench startup``).

* :meth:`StartupTimings.phase` times a phase. Phases nest: a phase entered
  inside another is taken out of the outer one's seconds, so the phases never
  count a second twice and their sum is the time they cover.
* :meth:`StartupTimings.detail` times a part of a phase without taking it out
  (the graph captures of one kind, the warm-up steps): a breakdown beside the
  phases, not added to them.
* :func:`recording` makes a record the active one for the code it wraps, and
  :func:`startup_phase` / :func:`startup_detail` time into the active record,
  or do nothing without one: code deep in the start-up path (the graph
  captures, the warm-up steps) reports its time without being handed the record.
* :func:`timed_startup_method` wraps a worker's start-up method: it activates the
  worker's ``startup_timings`` and times the method as one phase.

Each phase ends with a device synchronisation on CUDA, so that kernels queued
by one phase are not paid for by the next.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "StartupTimings",
    "active_timings",
    "recording",
    "startup_detail",
    "startup_phase",
    "timed_startup_method",
]

P = ParamSpec("P")
R = TypeVar("R")

_ACTIVE: contextvars.ContextVar[StartupTimings | None] = contextvars.ContextVar(
    "backplane_startup_timings", default=None
)


class StartupTimings:
    """Seconds per start-up phase (own time, nested phases taken out) and per detail.

    :param device: the device whose queued work a phase waits for before it
        ends (CUDA only; ``None`` or a CPU device waits for nothing).
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        #: phase -> seconds of its own (phases nested in it excluded), in first-entered order
        self.phases: dict[str, float] = {}
        #: detail -> seconds (parts of phases, not added to them)
        self.details: dict[str, float] = {}
        # seconds spent in phases nested in each open phase, innermost last
        self._nested: list[float] = []

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the wrapped code as phase ``name`` (added to what the phase already has).

        :param name: the phase, e.g. ``"weight load"``.
        :return: a context manager.
        """
        start = time.perf_counter()
        self._nested.append(0.0)
        try:
            yield
        finally:
            self._sync()
            elapsed = time.perf_counter() - start
            inner = self._nested.pop()
            self.phases[name] = self.phases.get(name, 0.0) + max(0.0, elapsed - inner)
            if self._nested:
                self._nested[-1] += elapsed

    @contextlib.contextmanager
    def detail(self, name: str) -> Iterator[None]:
        """Time the wrapped code as detail ``name`` (added to what it already has).

        :param name: the detail, e.g. ``"capture: decode batch"``.
        :return: a context manager.
        """
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.details[name] = self.details.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` measured elsewhere to phase ``name``.

        :param name: the phase.
        :param seconds: wall seconds (a negative figure counts as zero).
        """
        self.phases[name] = self.phases.get(name, 0.0) + max(0.0, seconds)

    def add_detail(self, name: str, seconds: float) -> None:
        """Add ``seconds`` measured elsewhere to detail ``name``.

        :param name: the detail.
        :param seconds: wall seconds.
        """
        self.details[name] = self.details.get(name, 0.0) + seconds

    @property
    def total(self) -> float:
        """Seconds of every phase together."""
        return sum(self.phases.values())

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy: ``{"phases": {...}, "details": {...}, "total": s}``.

        :return: the seconds, rounded to microseconds.
        """
        return {
            "phases": {k: round(v, 6) for k, v in self.phases.items()},
            "details": {k: round(v, 6) for k, v in self.details.items()},
            "total": round(self.total, 6),
        }

    def summary(self) -> str:
        """One line for the log: the total, then each phase with its seconds.

        :return: e.g. ``"start-up 3.21 s: weight load 1.50 s, graph capture 1.20 s, ..."``.
        """
        parts = ", ".join(f"{name} {secs:.2f} s" for name, secs in self.phases.items())
        line = f"start-up {self.total:.2f} s: {parts}"
        if self.details:
            line += " (" + ", ".join(f"{k} {v:.2f} s" for k, v in self.details.items()) + ")"
        return line


def active_timings() -> StartupTimings | None:
    """The record that :func:`recording` made active here, or ``None``.

    :return: the active record.
    """
    return _ACTIVE.get()


@contextlib.contextmanager
def recording(timings: StartupTimings) -> Iterator[StartupTimings]:
    """Make ``timings`` the active record while the wrapped code runs.

    :param timings: the record :func:`startup_phase` and :func:`startup_detail` fill.
    :return: a context manager yielding ``timings``.
    """
    token = _ACTIVE.set(timings)
    try:
        yield timings
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def startup_phase(name: str) -> Iterator[None]:
    """Time the wrapped code as phase ``name`` of the active record (nothing without one).

    :param name: the phase.
    :return: a context manager.
    """
    timings = _ACTIVE.get()
    with timings.phase(name) if timings is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def startup_detail(name: str) -> Iterator[None]:
    """Time the wrapped code as detail ``name`` of the active record (nothing without one).

    :param name: the detail.
    :return: a context manager.
    """
    timings = _ACTIVE.get()
    with timings.detail(name) if timings is not None else contextlib.nullcontext():
        yield


def timed_startup_method(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a worker's start-up method: time it as phase ``name`` of its record.

    The method's object keeps its record as ``startup_timings``; while the
    method runs that record is the active one, so phases and details entered
    deeper in the call (warm-up, graph capture) land in it too. An object
    without the attribute runs the method untimed.

    :param name: the phase.
    :return: the decorator.
    """

    def wrap(method: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(method)
        def timed(*args: P.args, **kwargs: P.kwargs) -> R:
            timings = getattr(args[0], "startup_timings", None) if args else None
            if not isinstance(timings, StartupTimings):
                return method(*args, **kwargs)
            with recording(timings), timings.phase(name):
                return method(*args, **kwargs)

        return timed

    return wrap
