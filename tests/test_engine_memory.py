"""Engine memory: the KV budget arithmetic, shutdown releasing everything, ten engines in a row.

The budget is checked against hand-computed readings; shutdown is checked by
what it frees (the model object is collected, the device memory returns), not
by what it calls.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from backplane import LLM, SamplingParams
from backplane.core.errors import EngineClosedError
from backplane.engine.worker.memory import (
    SAFETY_MARGIN,
    DeviceMemory,
    decode_graph_bytes,
    kv_budget,
)

GiB = 1 << 30


def _mem(free: float, reserved: float = 0.0, allocated: float = 0.0, total: float = 80.0):
    return DeviceMemory(
        free=int(free * GiB),
        total=int(total * GiB),
        reserved=int(reserved * GiB),
        allocated=int(allocated * GiB),
    )


def test_kv_gets_the_utilisation_limit_less_what_the_engine_needs():
    start = _mem(free=79.0)  # 1 GiB of context / other use before the engine
    loaded = _mem(free=77.0, reserved=2.0, allocated=2.0)  # 2 GiB of weights
    now = _mem(free=76.5, reserved=2.5, allocated=2.0)  # profiling left 0.5 GiB cached
    b = kv_budget(
        utilization=0.5, start=start, loaded=loaded, now=now, activations=GiB, graphs=GiB // 2
    )
    assert b.weights == 2 * GiB and b.outside_torch == 0
    assert b.kv == int(40 * GiB) - 2 * GiB - GiB - GiB // 2 - SAFETY_MARGIN
    assert not b.capped
    assert "weights 2.0 GiB" in b.explain() or "weights 2 GiB" in b.explain()


def test_kv_never_exceeds_what_is_free():
    # another engine holds 60 GiB: the limit (0.9 x 80) would overcommit the device
    start = _mem(free=19.0, reserved=60.0, allocated=60.0)
    loaded = _mem(free=17.0, reserved=62.0, allocated=62.0)
    now = loaded
    b = kv_budget(utilization=0.9, start=start, loaded=loaded, now=now, activations=GiB, graphs=0)
    assert b.capped
    assert b.kv == 17 * GiB - GiB - SAFETY_MARGIN
    assert "capped" in b.explain()


def test_memory_outside_torch_counts_against_the_limit():
    start = _mem(free=79.0)
    loaded = _mem(free=76.0, reserved=2.0, allocated=2.0)  # 1 GiB more outside torch
    b = kv_budget(utilization=0.9, start=start, loaded=loaded, now=loaded, activations=0, graphs=0)
    assert b.outside_torch == GiB
    assert b.kv == int(72 * GiB) - 2 * GiB - GiB - SAFETY_MARGIN


def test_a_budget_never_goes_negative():
    start = _mem(free=79.0)
    loaded = _mem(free=9.0, reserved=70.0, allocated=70.0)
    b = kv_budget(utilization=0.1, start=start, loaded=loaded, now=loaded, activations=0, graphs=0)
    assert b.kv == 0


def test_decode_graph_bytes_are_each_buckets_float32_logits():
    assert decode_graph_bytes([1, 2, 4], 1000) == 7 * 1000 * 4


def test_shutdown_releases_the_model_and_refuses_work():
    llm = LLM("tiny-llama", device="cpu", max_model_len=64)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    before = llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
    model = weakref.ref(llm.engine.model)
    llm.add_request([4, 5, 6], params)  # unfinished work is dropped
    llm.shutdown()
    llm.shutdown()  # idempotent
    gc.collect()
    assert model() is None, "the model is still referenced after shutdown"
    assert llm.num_unfinished_requests == 0
    with pytest.raises(EngineClosedError, match="shut down"):
        llm.generate([[1, 2, 3]], params)
    with LLM("tiny-llama", device="cpu", max_model_len=64) as again:
        assert again.generate([[1, 2, 3]], params)[0].outputs[0].token_ids == before
        engine = again.engine
    assert engine.closed


@pytest.mark.gpu
def test_ten_engines_in_a_row_give_their_memory_back():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; torch.cuda.is_available() is False")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [np.arange(1, 40).tolist(), np.arange(5, 17).tolist()]
    first = None
    free = []
    for i in range(10):
        with LLM("tiny-llama", device="cuda", gpu_memory_utilization=0.5, max_model_len=256) as llm:
            out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            total = torch.cuda.mem_get_info()[1]
            # the engine stays within its share of the device, up to what the estimate of the
            # graph pool can miss (the KV cache is by far the largest part)
            assert torch.cuda.memory_reserved() <= 0.5 * total + (1 << 30)
            budget = llm.engine.kv_budget
            assert budget is not None and budget.kv > 0
        first = first or out
        assert out == first, f"engine {i} generated differently"
        # what stays is process-wide, not per engine (kernel workspaces, the graph pool's
        # bookkeeping): it must not grow from one engine to the next
        left = torch.cuda.memory_allocated()
        assert left < (512 << 20), f"engine {i} left {left / 2**20:.0f} MiB allocated"
        free.append(torch.cuda.mem_get_info()[0])
    # every engine after the first finds the device as the first one left it
    assert max(free) - min(free) < (256 << 20), [f / 2**30 for f in free]


@pytest.mark.parametrize(("model", "expected"), [("tiny-llama", 1024), ("tiny-nemotron-h", 256)])
def test_a_recurrent_model_keeps_the_smaller_default_sequence_limit(monkeypatch, model, expected):
    # a large GPU's default (1,024 sequences) would give a recurrent model 1,024 whole
    # states; the worker keeps such a model at 256 unless the user asks for more
    from backplane.engine.config import EngineConfig
    from backplane.engine.engine import Engine

    monkeypatch.setattr(EngineConfig, "_default_limits", lambda self: (1024, 8192))
    engine = Engine(model=model, device="cpu", num_kv_pages=64, backends={"attention": "torch"})
    try:
        assert engine.max_num_seqs == expected
        assert engine.scheduler.max_num_seqs == expected
    finally:
        engine.shutdown()
    asked = Engine(model=model, device="cpu", num_kv_pages=64, max_num_seqs=600)
    try:
        assert asked.max_num_seqs == 600
    finally:
        asked.shutdown()
