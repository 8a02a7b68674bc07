"""Prefix reuse of hybrid models on a CUDA GPU: auto-selected backends, CUDA graphs, overlap.

The same check as ``tests/test_hybrid_prefix.py`` with the engine's GPU defaults
(asynchronous scheduling, CUDA graphs, the backends ``auto`` picks): requests
that share a cached prefix start from a restored recurrent-state snapshot and
give the tokens and logprobs of the same engine with prefix caching off.
"""

from __future__ import annotations

import numpy as np
import pytest

from backplane import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PAGE = 16


def _run(model: str, caching: bool, prompts: list[list[int]]) -> tuple[list, LLM]:
    llm = LLM(
        model,
        device="cuda",
        dtype="float32",
        page_size=PAGE,
        max_num_seqs=4,
        max_num_tokens=64,
        kv_memory="256MiB",  # fixed: sized from free memory, tests sharing the GPU collide
        enable_prefix_caching=caching,
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts[:1], [params])  # the shared prefix is cached first
    outs += llm.generate(prompts[1:], [params] * (len(prompts) - 1))
    return outs, llm


@pytest.mark.parametrize("model", ["tiny-nemotron-h", "tiny-qwen3-next"])
def test_cached_prefix_on_gpu_matches_no_caching(model: str) -> None:
    rng = np.random.default_rng(3)
    base = rng.integers(1, 96, size=70).tolist()
    prompts = [base] + [base + rng.integers(1, 96, size=n).tolist() for n in (5, 19, 33)]
    got, llm = _run(model, True, prompts)
    want, _ = _run(model, False, prompts)
    assert sum(o.metrics.prompt_tokens_reused for o in got) >= 3 * 64
    assert llm.engine.kv_manager.snapshots.restored >= 3
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        gc, wc = g.outputs[0], w.outputs[0]
        assert list(gc.token_ids) == list(wc.token_ids), f"request {i}"
        gl = [d[t].logprob for d, t in zip(gc.logprobs, gc.token_ids, strict=True)]
        wl = [d[t].logprob for d, t in zip(wc.logprobs, wc.token_ids, strict=True)]
        np.testing.assert_allclose(gl, wl, atol=1e-3, err_msg=f"request {i}")
    kv = llm.engine.kv_manager
    assert kv.num_used_pages == 0 and kv.num_live_slots == 0
