"""The leak check: what an engine or scheduler must hold once its requests are done.

``conftest.py`` runs :func:`check_all` after every test; the randomised lifecycle
test calls :func:`assert_idle` itself. Schedulers and engines are found through
weak registries filled by wrappers of their constructors (:func:`install`), so
a test needs no fixture to be checked.
"""

from __future__ import annotations

import weakref
from typing import Any

_schedulers: weakref.WeakSet[Any] = weakref.WeakSet()
_engines: weakref.WeakSet[Any] = weakref.WeakSet()
_installed = False


def install() -> None:
    """Register every ``Scheduler`` and ``Engine`` built from now on (idempotent)."""
    global _installed
    if _installed:
        return
    from backplane.engine.engine import Engine
    from backplane.engine.sched import Scheduler

    for cls, registry in ((Scheduler, _schedulers), (Engine, _engines)):
        init = cls.__init__

        def wrapped(self, *args, __init=init, __registry=registry, **kwargs):
            __init(self, *args, **kwargs)
            __registry.add(self)

        wrapped.__wrapped__ = init  # type: ignore[attr-defined]
        wrapped.__doc__ = init.__doc__
        cls.__init__ = wrapped
    _installed = True


def live() -> tuple[list[Any], list[Any]]:
    """The schedulers and engines alive now."""
    return list(_schedulers), list(_engines)


def assert_idle(scheduler: Any, engine: Any = None) -> None:
    """Assert a scheduler (and its engine) hold nothing: no request, page, slot, claim or
    reservation; every page's reference count is zero.

    :param scheduler: a ``Scheduler``.
    :param engine: its ``Engine``, if any (no final output left to deliver, no step in flight).
    """
    live_ids = sorted(scheduler._requests)
    assert not live_ids, f"requests left in the scheduler: {live_ids[:8]}"
    assert not scheduler._running and not scheduler._waiting
    kv = scheduler.kv
    refs = kv.pool.ref_counts
    held = [int(p) for p in refs.nonzero()[0]]
    assert not held, f"pages still referenced: {held[:16]}"
    usable = kv.pool.num_usable
    assert kv.pool.num_free + kv.prefix.num_evictable == usable, "pages neither free nor cached"
    assert kv.num_live_slots == 0, f"state slots still held: {sorted(kv.slots._used)}"
    assert kv.slots.num_free == max(kv.slots.num_slots - 1, 0) - kv.slots.num_used
    assert kv._reserved_pages == 0 and kv._reserved_slots == 0, "reservations left"
    if kv.host is not None:
        assert kv.host.num_claimed() == 0, "host-tier pages still claimed"
    kv.check_invariants([])
    if engine is not None:
        left = sorted(engine._requests)
        assert not left, f"requests whose final output was never delivered: {left[:8]}"
        assert engine._inflight is None, "a step is still in flight"


def check_all() -> list[str]:
    """Check every live scheduler and engine; return one message per leak found."""
    problems = []
    engines = {id(e.scheduler): e for e in list(_engines) if hasattr(e, "scheduler")}
    for sched in list(_schedulers):
        if not hasattr(sched, "kv"):
            continue  # its constructor raised
        try:
            assert_idle(sched, engines.get(id(sched)))
        except AssertionError as exc:
            problems.append(str(exc))
    return problems


def forget_all() -> None:
    """Stop checking what exists now (after a leak was reported once)."""
    _schedulers.clear()
    _engines.clear()
