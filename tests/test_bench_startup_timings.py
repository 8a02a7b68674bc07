"""The engine's start-up timing record: phases nest without double counting, land where
the work is, and the captures and warm-up steps report their parts."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from backplane.engine.worker.graph.capture import capture_buckets
from backplane.engine.worker.startup_timings import (
    StartupTimings,
    active_timings,
    recording,
    startup_detail,
    startup_phase,
    timed_startup_method,
)
from backplane.engine.worker.warmup import step_kind, warmup_steps


def test_nested_phase_is_taken_out_of_the_outer_one() -> None:
    timings = StartupTimings()
    start = time.perf_counter()
    with timings.phase("outer"):
        time.sleep(0.05)
        with timings.phase("inner"):
            time.sleep(0.15)
    wall = time.perf_counter() - start
    assert timings.phases["inner"] >= 0.15
    assert 0.05 <= timings.phases["outer"] < 0.15
    assert timings.total == pytest.approx(timings.phases["outer"] + timings.phases["inner"])
    assert timings.total <= wall


def test_a_phase_entered_twice_adds_up_and_details_stay_apart() -> None:
    timings = StartupTimings()
    for _ in range(2):
        with timings.phase("capture"), timings.detail("capture decode"):
            time.sleep(0.03)
    assert timings.phases["capture"] >= 0.06
    assert timings.details["capture decode"] >= 0.06
    # a detail is a part of a phase, not a phase of its own
    assert set(timings.phases) == {"capture"}
    assert timings.total == pytest.approx(timings.phases["capture"])


def test_module_helpers_time_into_the_active_record_only() -> None:
    with startup_phase("nowhere"), startup_detail("nowhere"):
        pass
    assert active_timings() is None
    timings = StartupTimings()
    with recording(timings):
        assert active_timings() is timings
        with startup_phase("weight load"), startup_detail("read"):
            time.sleep(0.02)
    assert active_timings() is None
    assert timings.phases["weight load"] >= 0.02 and timings.details["read"] >= 0.02
    assert "nowhere" not in timings.phases


class _Worker:
    def __init__(self, timings: Any) -> None:
        self.startup_timings = timings

    @timed_startup_method("graph capture")
    def build(self, seconds: float) -> str:
        time.sleep(seconds)
        with startup_phase("compile"):
            time.sleep(seconds)
        return "built"


def test_timed_startup_method_times_its_body_and_what_it_calls() -> None:
    timings = StartupTimings()
    assert _Worker(timings).build(0.03) == "built"
    assert 0.03 <= timings.phases["graph capture"] < 0.06
    assert timings.phases["compile"] >= 0.03
    # without a record the method runs as it would
    assert _Worker(None).build(0.0) == "built"


def test_capture_buckets_time_the_first_bucket_apart() -> None:
    timings = StartupTimings()
    slept = {8: 0.06, 4: 0.01, 2: 0.01, 1: 0.01}

    def capture_one(bucket: int) -> None:
        time.sleep(slept[bucket])
        if bucket == 2:
            raise RuntimeError("no graph for 2")

    failed: dict[int, str] = {}
    with recording(timings):
        capture_buckets(
            slept, capture_one, pool=None, label="decode batch", failed=failed, grown={}
        )
    assert set(failed) == {2}
    first = timings.details["capture decode batch 8 (first)"]
    rest = timings.details["capture decode batchs (rest)"]
    assert first >= 0.06 and 0.03 <= rest < 0.06


def test_warm_up_step_kinds() -> None:
    steps = warmup_steps(max_num_tokens=8192, max_num_seqs=8, max_model_len=1024, page_size=16)
    kinds = [step_kind(s) for s in steps]
    # prompts of 16, 48, 128 and 1024 tokens fresh, the first three also after one page;
    # one decode at 128, 256, 512 and 1024 tokens of context; then seven decodes at once
    assert kinds == ["prefill"] * 7 + ["decode"] * 4 + ["mixed"]


def test_engine_attributes_its_start_up_to_the_phases(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import backplane.models as models
    from backplane.engine.engine import Engine

    real_load = models.load_model

    def slow_load(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.3)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(models, "load_model", slow_load)
    caplog.set_level(logging.INFO, logger="backplane.engine.engine")
    start = time.perf_counter()
    engine = Engine(model="tiny-llama", device="cpu", num_kv_pages=8, max_num_seqs=2)
    wall = time.perf_counter() - start
    try:
        timings = engine.startup_timings
        phases = timings.phases
        assert phases["weight load"] >= 0.3
        assert phases["backend selection"] < 0.3
        for name in ("memory profiling", "cache allocation", "graph capture", "kernel warm-up"):
            assert name in phases
        assert phases["engine setup"] >= 0 and phases["other"] >= 0
        assert timings.total <= wall
        # the phases cover the construction: what is left out is the test's own overhead
        assert timings.total >= 0.9 * wall - 0.05
        line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up ")]
        assert len(line) == 1 and "weight load" in line[0]
    finally:
        engine.shutdown()


def test_decode_captures_run_one_warm_up_forward_per_bucket() -> None:
    from backplane.engine.worker.graph.decode import DecodeGraphs

    calls: list[int] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        calls.append(int(x.shape[0]))
        return x * 2

    buckets = [1, 2, 4, 8]
    graphs = DecodeGraphs(forward, buckets, cuda=False)

    @contextlib.contextmanager
    def make_inputs(bucket: int) -> Iterator[tuple[torch.Tensor]]:
        yield (torch.ones(bucket),)

    graphs.capture(make_inputs)
    # one warm-up run and the capture run per bucket, largest first; a second warm-up
    # run would be a whole forward more per bucket at every start-up
    assert calls == [b for b in sorted(buckets, reverse=True) for _ in range(2)]
    assert all(graphs.has(b) for b in buckets)
    for b in buckets:
        assert torch.equal(graphs.replay(b), torch.full((b,), 2.0))
