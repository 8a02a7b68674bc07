"""The start-up steps' compile-only passes: the graph runner's over every bucket and the
warm-up steps before its first capture, the memory profiling's before it measures.

On this CPU-only machine a stand-in for Triton's ``AsyncCompileMode`` lets
:func:`~backplane.core.compile_ahead.compile_only` run; every model forward is
recorded with whether it ran inside the pass, so the order of the passes and
the captures is checked, and so is that a failing part leaves the rest running.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from backplane.core import compile_ahead
from backplane.core.forward_context import forward_context, plan_step
from backplane.engine.engine import Engine
from backplane.engine.sampling import Sampler
from backplane.engine.worker import warmup
from backplane.engine.worker.graph.mode import GraphMode
from backplane.engine.worker.graph.runner import CAPTURE_AHEAD_DETAIL, GraphModelRunner
from backplane.engine.worker.inputs import scratch_seq

PAGE = 4


class FakeMode:
    """Stands in for Triton's ``AsyncCompileMode``."""

    made = 0

    def __init__(self, executor, *, ignore_errors=False):  # noqa: ANN001
        FakeMode.made += 1

    def __enter__(self):  # noqa: ANN204
        return self

    def __exit__(self, *exc):  # noqa: ANN002, ANN204
        return None


@pytest.fixture
def async_triton(monkeypatch: pytest.MonkeyPatch) -> type[FakeMode]:
    """As on a CUDA machine whose Triton compiles asynchronously."""
    FakeMode.made = 0
    monkeypatch.setattr(compile_ahead, "_async_compile_mode", lambda: FakeMode)
    monkeypatch.setattr(compile_ahead, "_cuda_ready", lambda: True)
    monkeypatch.setattr(compile_ahead, "_DONE", set())
    return FakeMode


@pytest.fixture(scope="module")
def engine():
    made = Engine(
        model="tiny-llama",
        device="cpu",
        max_num_seqs=2,
        max_num_tokens=16,
        max_model_len=32,
        page_size=PAGE,
        num_kv_pages=40,
        cuda_graphs="off",
        backends={"attention": "torch"},
    )
    yield made
    made.shutdown()


class Forwards(list):
    """``(inside a compile-only pass, tokens)`` per model forward; a forward of a size in
    ``fail_at`` raises inside a pass."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_at: set[int] = set()


@pytest.fixture
def forwards(engine):
    """Every model forward from now on (see :class:`Forwards`)."""
    calls = Forwards()

    def record(module, args):  # noqa: ANN001, ANN202
        calls.append((compile_ahead.compiling_only(), len(args[0])))
        if compile_ahead.compiling_only() and len(args[0]) in calls.fail_at:
            raise ValueError(f"no kernel for {len(args[0])} tokens")

    handle = engine.model.register_forward_pre_hook(record)
    yield calls
    handle.remove()


def _runner(engine: Engine) -> GraphModelRunner:
    return GraphModelRunner(
        engine.model,
        engine.backends,
        engine.input_batch,
        mode=GraphMode.FULL_AND_PIECEWISE,
        max_num_tokens=16,
        max_num_seqs=2,
        max_model_len=32,
        page_size=PAGE,
        token_bucket_sizes=[8],
        decode_bucket_sizes=[1, 2],
    )


def _warm_up(engine: Engine, runner: GraphModelRunner, modes: list) -> None:
    """One warm-up step of 5 prompt tokens through the runner, as the worker runs it."""
    inputs = runner.prepare_inputs([scratch_seq(5, 0, PAGE)])
    modes.append((compile_ahead.compiling_only(), inputs.mode.bucket))
    with forward_context(inputs.metadata, plan_step(engine.backends, inputs.metadata)):
        runner.run(inputs)


# what the captures run on CPU: each piecewise bucket once (its warm-up), each decode
# bucket twice (warm-up and the stand-in capture), largest first
CAPTURES = [(False, 16), (False, 8), (False, 2), (False, 2), (False, 1), (False, 1)]


def test_every_bucket_and_the_warm_up_compile_in_one_pass_before_the_first_capture(
    async_triton, engine, forwards
) -> None:  # noqa: ANN001
    runner = _runner(engine)
    modes: list = []
    with compile_ahead.startup_window() as details:
        runner.capture(lambda: _warm_up(engine, runner, modes))
    # the pass: piecewise buckets, decode batches, then the warm-up step, padded to the
    # piecewise bucket it will replay in (5 tokens -> 8); then the captures
    assert forwards == [(True, 16), (True, 8), (True, 2), (True, 1), (True, 8), *CAPTURES]
    assert modes == [(True, 8)]
    assert async_triton.made == 1  # one pass for all of them
    assert details[CAPTURE_AHEAD_DETAIL] >= 0.0
    assert runner.piecewise.captured == {8, 16}
    assert set(runner.decode.graphs) == {1, 2}
    # the pass left the runner as it was: without the captures, nothing is a bucket
    runner.release()


def test_a_failing_part_of_the_pass_is_logged_and_the_rest_still_runs(
    async_triton, engine, forwards, caplog
) -> None:  # noqa: ANN001
    runner = _runner(engine)
    forwards.fail_at.add(16)

    def broken_warm_up() -> None:
        raise RuntimeError("warm-up refused")

    with compile_ahead.startup_window(), caplog.at_level(logging.WARNING):
        runner.capture(broken_warm_up)
    assert "piecewise bucket 16 failed (ValueError: no kernel for 16 tokens)" in caplog.text
    assert "the warm-up steps failed (RuntimeError: warm-up refused)" in caplog.text
    assert forwards == [(True, 16), (True, 8), (True, 2), (True, 1), *CAPTURES]
    assert runner.piecewise.failed == {} and runner.decode.failed == {}
    assert runner.piecewise.captured == {8, 16}
    runner.release()


def test_no_pass_outside_a_start_up_window_or_when_declined(async_triton, engine, forwards) -> None:  # noqa: ANN001
    for window, ahead in ((False, True), (True, False)):
        forwards.clear()
        runner = _runner(engine)
        warmed: list = []
        with compile_ahead.startup_window() if window else _nothing():
            runner.capture(lambda warmed=warmed: warmed.append(1), ahead=ahead)
        assert forwards == CAPTURES and warmed == []
        runner.release()
    assert async_triton.made == 0


def test_no_pass_without_cuda(monkeypatch: pytest.MonkeyPatch, engine, forwards) -> None:  # noqa: ANN001
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    runner = _runner(engine)
    with compile_ahead.startup_window() as details:
        runner.capture(lambda: pytest.fail("the warm-up runs in a pass only"))
    assert forwards == CAPTURES and details == {}
    runner.release()


def test_the_profiling_step_compiles_ahead_then_measures_and_samples_once(
    async_triton, engine, forwards, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: 0)
    sampler = Sampler()
    sampled: list[bool] = []
    sample = sampler.sample
    monkeypatch.setattr(
        sampler, "sample", lambda *a: (sampled.append(compile_ahead.compiling_only()), sample(*a))
    )
    limits = dict(max_num_tokens=16, max_num_seqs=2, max_model_len=32, page_size=PAGE)
    for ahead in (True, False):
        forwards.clear()
        sampled.clear()
        with compile_ahead.startup_window() as details:
            warmup.profile_step_peak(
                engine.model,
                engine.backends,
                engine.input_batch,
                sampler,
                **limits,
                num_slots=1,
                dtype=torch.float32,
                device=torch.device("cpu"),
                ahead=ahead,
            )
        if ahead:
            # compile-only first; the garbage logits of the pass are never sampled
            assert forwards == [(True, 16), (False, 16)]
            assert warmup.PROFILE_AHEAD_DETAIL in details
        else:
            assert forwards == [(False, 16)] and details == {}
        assert sampled == [False]
    # the engine's own caches go back to the model (the step bound scratch ones)
    engine.model.bind_caches(engine.caches)


def test_warm_up_forwards_run_every_step_past_a_failing_one(caplog) -> None:  # noqa: ANN001
    limits = dict(max_num_tokens=64, max_num_seqs=4, max_model_len=256, page_size=PAGE)
    steps = warmup.warmup_steps(**limits)
    seen: list[int] = []

    def prepare(seqs):  # noqa: ANN001, ANN202
        seen.append(sum(s.num_new_tokens for s in seqs))
        return len(seen)

    def execute(index):  # noqa: ANN001, ANN202
        if index == 2:
            raise RuntimeError("bad step")

    with caplog.at_level(logging.WARNING):
        warmup.warm_up_forwards(prepare, execute, **limits)
    assert seen == [sum(s.num_new_tokens for s in step) for step in steps]
    assert len(seen) > 3
    assert "bad step" in caplog.text


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_the_passes_follow_the_dtype_the_split_and_the_disk_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from backplane.engine.worker.device_worker import DeviceWorker

    worker = DeviceWorker.__new__(DeviceWorker)  # only its dtype and split are read
    worker.config = SimpleNamespace(tensor_parallel_size=1)
    tally = compile_ahead._Tally()
    monkeypatch.setattr(compile_ahead, "_TALLY", tally)
    worker.dtype = torch.bfloat16
    assert worker._compiles_ahead and worker._later_passes()
    tally.add(compiled=False)  # the profiling step loaded its kernels from the disk cache
    assert worker._compiles_ahead and not worker._later_passes()
    # a split model runs no pass: a part failing on one rank would desynchronise collectives
    worker.config.tensor_parallel_size = 2
    tally.add(compiled=True)
    assert not worker._compiles_ahead and not worker._later_passes()
    worker.config.tensor_parallel_size = 1
    tally.add(compiled=True)
    assert worker._later_passes()
    # float32: the library kernels' exact products are chosen around their launches
    worker.dtype = torch.float32
    assert not worker._compiles_ahead and not worker._later_passes()
