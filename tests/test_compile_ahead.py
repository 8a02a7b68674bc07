"""Compiling ahead at start-up: only inside a start-up window, once per key, launching nothing.

The thread pool and Triton's ``AsyncCompileMode`` need a CUDA device; here a stand-in
mode class records what the code asks of it, and the real answer on this machine
(no CUDA) is checked too: nothing is compiled ahead.
"""

from __future__ import annotations

import contextlib
import logging
import time

import pytest
import torch

from backplane.core import compile_ahead


class FakeMode:
    """Stands in for Triton's ``AsyncCompileMode``: records the executor and the exit."""

    made: list[FakeMode] = []

    def __init__(self, executor, *, ignore_errors=False):  # noqa: ANN001
        self.executor = executor
        self.ignore_errors = ignore_errors
        self.exited = False
        FakeMode.made.append(self)

    def __enter__(self):  # noqa: ANN204
        return self

    def __exit__(self, *exc):  # noqa: ANN002, ANN204
        self.exited = True


class FakeKernel:
    """A ``triton.jit`` stand-in recording launches and compile-only requests."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def warmup(self, *args, grid, **meta):  # noqa: ANN002, ANN003, ANN201
        self.calls.append(("warmup", args, {"grid": grid, **meta}))

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        return lambda *args, **meta: self.calls.append(("launch", args, {"grid": grid, **meta}))


@pytest.fixture
def async_triton(monkeypatch: pytest.MonkeyPatch) -> type[FakeMode]:
    """As on a CUDA machine whose Triton compiles asynchronously."""
    FakeMode.made = []
    monkeypatch.setattr(compile_ahead, "_async_compile_mode", lambda: FakeMode)
    monkeypatch.setattr(compile_ahead, "_cuda_ready", lambda: True)
    monkeypatch.setattr(compile_ahead, "_DONE", set())
    return FakeMode


def test_nothing_is_compiled_ahead_outside_a_start_up_window(async_triton) -> None:  # noqa: ANN001
    assert not compile_ahead.in_startup_window()
    assert not compile_ahead.ahead_of(lambda: pytest.fail("no key outside a window"))
    with compile_ahead.startup_window():
        assert compile_ahead.in_startup_window()
    assert not compile_ahead.in_startup_window()


def test_nothing_is_compiled_ahead_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setattr(compile_ahead, "_DONE", set())
    with compile_ahead.startup_window():
        assert not compile_ahead.ahead_of(lambda: "key")


def test_each_key_is_compiled_ahead_once(async_triton) -> None:  # noqa: ANN001
    with compile_ahead.startup_window():
        assert compile_ahead.ahead_of(lambda: "a")
        assert not compile_ahead.ahead_of(lambda: "a")
        assert compile_ahead.ahead_of(lambda: "b")
        with compile_ahead.compile_only(workers=2):
            # no compile-ahead inside another one
            assert not compile_ahead.ahead_of(lambda: "c")
    with compile_ahead.startup_window():
        assert not compile_ahead.ahead_of(lambda: "a")


def test_launches_compile_only_inside_compile_only(async_triton) -> None:  # noqa: ANN001
    kernel = FakeKernel()
    compile_ahead.launch(kernel, (2, 3), "x", 7, BLOCK=16)
    assert not compile_ahead.compiling_only()
    with compile_ahead.compile_only(workers=2):
        assert compile_ahead.compiling_only()
        compile_ahead.launch(kernel, [4], "y", 8, BLOCK=32)
    assert not compile_ahead.compiling_only()
    assert kernel.calls == [
        ("launch", ("x", 7), {"grid": (2, 3), "BLOCK": 16}),
        ("warmup", ("y", 8), {"grid": (4,), "BLOCK": 32}),
    ]
    (mode,) = async_triton.made
    assert mode.exited and mode.ignore_errors
    assert mode.executor._max_workers == 2


def test_run_ahead_logs_a_failure_and_records_its_time(async_triton, caplog) -> None:  # noqa: ANN001
    def broken() -> None:
        assert compile_ahead.compiling_only()
        raise ValueError("no such kernel")

    with compile_ahead.startup_window() as details, caplog.at_level(logging.WARNING):
        compile_ahead.run_ahead("the test's kernels", broken)
        compile_ahead.record("autotune timing", 1.5)
    assert "compiling the test's kernels ahead failed (ValueError: no such kernel)" in caplog.text
    assert details[compile_ahead.AHEAD_DETAIL] >= 0.0
    assert details["autotune timing"] == 1.5
    assert not compile_ahead.compiling_only()
    # without a window, nothing is recorded and nothing fails
    compile_ahead.record("autotune timing", 1.0)


def test_the_signature_sees_what_launches_specialise_on() -> None:
    base = torch.zeros(64, dtype=torch.float32)
    same = compile_ahead.signature(torch.ones(64), 3, None)
    assert compile_ahead.signature(base, 3, None) == same
    assert compile_ahead.signature(base.half(), 3, None) != same
    assert compile_ahead.signature(torch.zeros(48), 3, None) != same
    assert compile_ahead.signature(base[1:], 3, None) != compile_ahead.signature(base[:-1], 3, None)
    assert compile_ahead.signature(base, 4, None) != same


def test_a_pass_is_possible_inside_a_window_outside_another_pass(async_triton) -> None:  # noqa: ANN001
    assert not compile_ahead.can_compile_ahead()
    with compile_ahead.startup_window():
        assert compile_ahead.can_compile_ahead()
        # unlike ahead_of, no key is spent: a later step may ask again
        assert compile_ahead.can_compile_ahead()
        with compile_ahead.compile_only(workers=1):
            assert not compile_ahead.can_compile_ahead()
    assert compile_ahead._DONE == set()


def test_holds_are_entered_inside_the_pass_and_left_before_its_wait(
    async_triton, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    events: list[str] = []

    class Mode(FakeMode):
        def __exit__(self, *exc):  # noqa: ANN002, ANN204
            events.append("wait for the compiles")

    @contextlib.contextmanager
    def hold():  # noqa: ANN202
        events.append(f"hold, compiling only: {compile_ahead.compiling_only()}")
        yield
        events.append("release")

    monkeypatch.setattr(compile_ahead, "_async_compile_mode", lambda: Mode)
    monkeypatch.setattr(compile_ahead, "_HOLDS", [])
    compile_ahead.hold_while_compiling_only(hold)
    with compile_ahead.compile_only(workers=1):
        events.append("pass")
    assert events == [
        "hold, compiling only: True",
        "pass",
        "release",
        "wait for the compiles",
    ]


def test_attempt_logs_a_failing_part_and_says_so(caplog) -> None:  # noqa: ANN001
    def broken(n: int) -> None:
        raise KeyError(n)

    with caplog.at_level(logging.WARNING):
        assert not compile_ahead.attempt("decode batch 8", broken, 8)
        assert compile_ahead.attempt("decode batch 4", lambda n: None, 4)
    assert "compiling ahead: decode batch 8 failed (KeyError: 8)" in caplog.text
    assert "batch 4" not in caplog.text


def test_the_environment_can_turn_compiling_ahead_off(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cached = compile_ahead._async_compile_mode
    try:
        for value, on in (("0", False), ("1", True)):
            monkeypatch.setenv(compile_ahead.ENV, value)
            cached.cache_clear()
            assert (cached() is not None) == on
    finally:
        cached.cache_clear()


def _busy(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU, as compiling a kernel does."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def test_the_disk_cache_is_warm_while_every_compile_asked_for_was_a_load(
    async_triton, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    monkeypatch.setattr(compile_ahead, "_TALLY", compile_ahead._Tally())
    assert not compile_ahead.disk_cache_warm()  # nothing asked for yet

    def one_pass(*jobs: float) -> None:
        with compile_ahead.compile_only(workers=2):
            pool = async_triton.made[-1].executor
            futures = [pool.submit(_busy, s) for s in jobs]
        assert all(f.done() for f in futures)

    one_pass(0.0, 0.0)
    assert compile_ahead.disk_cache_warm()
    one_pass(0.0, 2 * compile_ahead.LOADED_CPU_S)
    assert not compile_ahead.disk_cache_warm()
    # one compile says the cache was not warm for this start-up, whatever comes later
    one_pass(0.0)
    assert not compile_ahead.disk_cache_warm()
    assert compile_ahead.compiles() == (5, 1)
