"""Tensor parallelism on two GPUs (NCCL): two ranks with CUDA graphs (decode and piecewise, the
all-reduces captured inside them) against transformers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import test_e2e  # noqa: E402
from test_e2e import ARCHS, assert_matches, hf_greedy, make_requests  # noqa: E402

from backplane import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

hf_model = test_e2e.hf_model


def _two_gpus() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")


def _llm(path: str, graphs: str, **kw: Any) -> LLM:
    return LLM(
        path,
        device="cuda",
        dtype="float32",
        page_size=16,
        max_num_seqs=4,
        max_num_tokens=64,
        num_kv_pages=64,
        cuda_graphs=graphs,
        tensor_parallel_size=2,
        **kw,
    )


@pytest.mark.parametrize("arch", list(ARCHS))
def test_two_gpus_with_graphs_equal_transformers(hf_model, arch):
    _two_gpus()
    model, path = hf_model(arch)
    prompts, max_tokens = make_requests(seed=len(arch))
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    llm = _llm(path, "full_and_piecewise")
    try:
        graph_modes = llm.engine.executor.driver.graph_mode
        outs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert graph_modes.captures, "no graph was captured: the collectives were not tested inside one"
    ties = 0
    for i, (p, m, got) in enumerate(zip(prompts, max_tokens, outs, strict=True)):
        want, margins = hf_greedy(arch, model, p, m)
        ties += assert_matches(got, want, margins, f"{arch} TP=2 on GPUs, request {i}")
    assert ties <= 1, f"{ties} requests ended in near-ties: the comparison is too weak"
