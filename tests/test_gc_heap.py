"""The start-up heap is frozen while a serving loop runs and unfrozen around an engine's release."""

from __future__ import annotations

import gc
import weakref

import pytest

from backplane.core import gc_heap


class _Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _no_freeze_left():
    gc_heap._holders = 0
    gc.unfreeze()
    yield
    gc_heap._holders = 0
    gc.unfreeze()


def _cycle(keep: list) -> weakref.ref:
    """A cycle kept alive by ``keep`` until the test clears it."""
    node = _Node()
    keep.append(node)
    return weakref.ref(node)


def test_a_frozen_cycle_survives_collections_until_its_loop_releases_the_heap():
    keep: list = []
    ref = _cycle(keep)
    gc_heap.freeze_startup_heap()
    assert gc.get_freeze_count() > 0
    keep.clear()  # garbage now, made before the freeze
    gc.collect()
    assert ref() is not None  # made before the freeze: full passes no longer visit it
    with gc_heap.released_startup_heap():
        assert gc.get_freeze_count() == 0
        gc.collect()  # what an engine's shutdown does
        assert ref() is None
    assert gc.get_freeze_count() == 0


def test_the_heap_is_frozen_again_while_another_loop_still_serves():
    keep: list = []
    ref = _cycle(keep)
    gc_heap.freeze_startup_heap()
    gc_heap.freeze_startup_heap()
    keep.clear()
    with gc_heap.released_startup_heap():
        gc.collect()
        assert ref() is None  # the released engine's cycles are freed
    assert gc.get_freeze_count() > 0  # the other loop keeps its freeze
    with gc_heap.released_startup_heap():
        pass
    assert gc.get_freeze_count() == 0
    assert gc_heap._holders == 0


def test_a_release_without_a_freeze_leaves_the_count_at_zero():
    with gc_heap.released_startup_heap():
        pass
    assert gc_heap._holders == 0
    assert gc.get_freeze_count() == 0


def test_an_async_engine_freezes_while_it_serves_and_thaws_when_shut_down():
    from backplane import AsyncLLM

    keep: list = []
    ref = _cycle(keep)
    engine = AsyncLLM(
        "tiny-llama", device="cpu", max_num_seqs=4, max_num_tokens=64, kv_memory="16MiB"
    )
    try:
        keep.clear()
        assert gc.get_freeze_count() > 0
        assert gc_heap._holders == 1
        gc.collect()
        assert ref() is not None
    finally:
        engine.shutdown()
    assert gc_heap._holders == 0
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None
