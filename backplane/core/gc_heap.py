"""Keep the start-up heap out of the garbage collector's full passes while engines serve.

CPython's cyclic collector runs a full (oldest-generation) pass once enough
objects have survived the younger ones, and a full pass visits every tracked
object in the process: the model's modules, the tokenizer, the compiled
kernels and the imported libraries, hundreds of thousands of objects that
live as long as the engine. A serving loop hands out thousands of objects a
step that survive a step or two (outputs waiting for their readers), so full
passes come every few dozen steps and each one stops every thread for tens to
hundreds of milliseconds. :func:`freeze_startup_heap` moves what exists once
an engine is built into the collector's permanent generation (``gc.freeze``),
so a full pass visits only what was made since; :func:`released_startup_heap`
unfreezes it while an engine is released, whose own cycles a collection must
still be able to free.

The freeze is process-wide and shared by the loops that serve at the same time:
each loop holds it from its start, and gives it up around its engine's release
(:func:`released_startup_heap`), after which it is renewed for the loops still
serving.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["freeze_startup_heap", "released_startup_heap"]

_lock = threading.Lock()
#: serving loops that hold the freeze
_holders = 0


def freeze_startup_heap() -> None:
    """Collect, then freeze every object the collector tracks (see the module docstring).

    Call when a serving loop starts, its engine built; pair each call with one
    :func:`released_startup_heap`. Once the heap is frozen, the collection of a
    later call visits only what was made since.
    """
    global _holders
    with _lock:
        _holders += 1
        gc.collect()
        gc.freeze()


@contextmanager
def released_startup_heap() -> Iterator[None]:
    """Give up one loop's hold on the freeze, with the heap unfrozen for the block.

    Release the loop's engine in the block: its shutdown collects the cycles it
    leaves behind, which a frozen heap would keep. Afterwards the heap is frozen
    again while other loops still hold the freeze.
    """
    global _holders
    with _lock:
        held = _holders > 0
        _holders = max(_holders - 1, 0)
        gc.unfreeze()
    try:
        yield
    finally:
        with _lock:
            if held and _holders:
                gc.collect()
                gc.freeze()
