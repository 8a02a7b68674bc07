"""The cached Triton launcher inside a compile-only pass: it compiles, launches nothing, and
its fast path is back to the bare driver call once the pass is over.

A stand-in kernel records what the launcher asks of it (``warmup``, the compile
Triton queues in its asynchronous mode, and the driver's ``run``), and a stand-in
for Triton's ``AsyncCompileMode`` lets :func:`~backplane.core.compile_ahead.compile_only`
run on this CPU-only machine.
"""

from __future__ import annotations

import threading

import pytest
import torch

from backplane.core import compile_ahead, launch

pytest.importorskip("triton", reason="triton is not installed")


class FakeMode:
    """Stands in for Triton's ``AsyncCompileMode``."""

    def __init__(self, executor, *, ignore_errors=False):  # noqa: ANN001
        self.executor = executor

    def __enter__(self):  # noqa: ANN204
        return self

    def __exit__(self, *exc):  # noqa: ANN002, ANN204
        return None


class FakeCompiled:
    """A compiled kernel: its driver call records the launch."""

    def __init__(self, calls: list) -> None:
        self.calls = calls
        self.function = "function"
        self.packed_metadata = "metadata"

    def _init_handles(self) -> None:
        pass

    def run(self, g0, g1, g2, stream, function, metadata, launch_md, enter, exit_, *args):  # noqa: ANN001, ANN002, ANN201, PLR0913
        self.calls.append(("run", (g0, g1, g2), args))


class FakeKernel:
    """A ``triton.jit`` stand-in: ``warmup`` records the request and returns the compiled kernel."""

    arg_names = ["x", "n", "BLOCK"]

    def __init__(self) -> None:
        self.calls: list = []
        self.compiled = FakeCompiled(self.calls)
        self.__name__ = "fake_kernel"

    @staticmethod
    def fn(x, n, BLOCK=16):  # noqa: ANN001, ANN205, N803
        raise AssertionError("the stand-in's body never runs")

    def warmup(self, *args, grid, **options):  # noqa: ANN002, ANN003, ANN201
        self.calls.append(("warmup", grid, args))
        return self.compiled

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        return lambda *args, **meta: self.calls.append(("launch", grid, args))


@pytest.fixture
def launcher(monkeypatch: pytest.MonkeyPatch) -> launch.KernelLauncher:
    """A launcher with the fast path on (no key check, no interpreter), as on a GPU."""
    monkeypatch.setattr(compile_ahead, "_async_compile_mode", lambda: FakeMode)
    monkeypatch.setattr(compile_ahead, "_cuda_ready", lambda: True)
    monkeypatch.setattr(launch, "CHECK", False)
    monkeypatch.setattr(launch, "_direct_launch_supported", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 0, raising=False)
    made = launch.KernelLauncher(FakeKernel())
    made._interpret = made._always_slow = False
    return made


def _launch(launcher: launch.KernelLauncher, n: int = 7) -> None:
    launcher(("key",), (3,), ("x", n), 0, BLOCK=32)


def test_a_launch_in_a_compile_only_pass_compiles_and_launches_nothing(launcher) -> None:  # noqa: ANN001
    calls = launcher.kernel.calls
    with compile_ahead.compile_only(workers=1):
        _launch(launcher)
        # the caller's follow-up lookup finds nothing to keep: nothing was loaded
        assert launcher.lookup(("key",), 0) is None
    assert calls == [("warmup", (3,), ("x", 7, 32))]
    assert launcher._cache == {}
    # the real launch asks for the same compile (Triton's cache has it now) and runs it
    _launch(launcher)
    assert calls[1:] == [("warmup", (3,), ("x", 7, 32)), ("run", (3, 1, 1), ("x", 7, 32))]


def test_kept_kernels_are_held_during_a_pass_and_bare_again_after(launcher) -> None:  # noqa: ANN001
    calls = launcher.kernel.calls
    _launch(launcher)
    hit = launcher.lookup(("key",), 0)
    assert hit is not None and hit.run is hit.direct
    calls.clear()
    other_thread: list[bool] = []
    with compile_ahead.compile_only(workers=1):
        assert hit.run is not hit.direct
        hit.launch(2, 1, 1, 0, "x", 7)  # a call site's own kept kernel
        _launch(launcher)  # a cached key
        assert calls == []
        # another thread, outside any pass, still launches
        t = threading.Thread(target=lambda: other_thread.append(hit.launch(5, 1, 1, 0, "y", 1)))
        t.start()
        t.join()
    assert calls == [("run", (5, 1, 1), ("y", 1, 32))] and other_thread == [None]
    # the serving fast path is the driver call itself again
    assert hit.run is hit.direct
    hit.launch(4, 1, 1, 0, "x", 7)
    assert calls[-1] == ("run", (4, 1, 1), ("x", 7, 32))


def test_nothing_changes_outside_a_pass(launcher) -> None:  # noqa: ANN001
    calls = launcher.kernel.calls
    with compile_ahead.startup_window():
        _launch(launcher)
        _launch(launcher)
    assert [c[0] for c in calls] == ["warmup", "run", "run"]
    assert launcher.lookup(("key",), 0).run is launcher.lookup(("key",), 0).direct


def test_a_kernel_kept_while_another_thread_compiles_only_is_held(launcher) -> None:  # noqa: ANN001
    """A kernel first launched (outside any pass) while a pass runs elsewhere is held too."""
    entered, leave = threading.Event(), threading.Event()

    def pass_elsewhere() -> None:
        with compile_ahead.compile_only(workers=1):
            entered.set()
            leave.wait(5)

    t = threading.Thread(target=pass_elsewhere)
    t.start()
    try:
        assert entered.wait(5)
        _launch(launcher)
        hit = launcher.lookup(("key",), 0)
        assert hit.run is not hit.direct
        assert launcher.kernel.calls[-1][0] == "run"  # this thread is not in a pass
    finally:
        leave.set()
        t.join()
    assert hit.run is hit.direct
