"""Sampling in captured graphs draws exactly what the eager sampler draws.

:class:`SamplingHead` runs :meth:`Sampler.sample_tensors` on persistent
parameter buffers; these tests give it rows of every kind (greedy, plain
random, each filter, seeded) in a bucket wider than the rows, and compare each
token with the eager sampler's on the same logits. On CPU the "graphs" are
eager stand-ins (the buffers, variants and padding are the real thing); the
GPU test replays real CUDA graphs through the engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from graph_helpers import generate_eager_and_graphed

from backplane import SamplingParams
from backplane.engine.sampling import Sampler, SamplingRows
from backplane.engine.worker.graph.sampling_head import KINDS, SamplingHead

VOCAB = 97


def _rows(params: list[SamplingParams], seed: int) -> SamplingRows:
    rng = np.random.default_rng(seed)
    n = len(params)
    seeds = rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)
    offsets = rng.integers(0, 50, size=n).astype(np.int64)
    return SamplingRows(params, seeds, offsets)


MIXES = {
    "greedy": [SamplingParams(temperature=0.0)] * 3,
    "random": [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)] * 2,
    "filtered": [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.9, top_p=0.6),
        SamplingParams(temperature=1.3, min_p=0.2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.1),
    ],
}


def _head(device: str, buckets: list[int]) -> tuple[SamplingHead, dict[int, torch.Tensor]]:
    head = SamplingHead(Sampler(), max(buckets), torch.device(device), cuda=device == "cuda")
    logits = {}
    for b in buckets:
        logits[b] = torch.zeros(b, VOCAB, device=device)
        head.capture(b, logits[b])
    return head, logits


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_head_tokens_equal_the_eager_sampler(mix):
    head, logits = _head("cpu", [8])
    assert head.has(8) and not head.has(4)
    g = torch.Generator().manual_seed(3)
    params = MIXES[mix]
    for step in range(4):  # the buffers are refilled every step
        rows = _rows(params, step)
        assert head.kind(rows)[0] == mix
        logits[8].copy_(torch.randn(8, VOCAB, generator=g) * 3)
        got = head.sample(8, rows)
        want = Sampler().sample(logits[8][: len(params)].clone(), params, rows.seeds, rows.offsets)
        assert got.shape == (len(params),)
        assert got.tolist() == want.tolist()


def test_every_kind_is_captured_per_bucket():
    head, _ = _head("cpu", [1, 2, 4])
    assert sorted(head.graphs) == sorted((b, k) for b in (1, 2, 4) for k in KINDS)


def test_greedy_steps_copy_no_parameters():
    head, logits = _head("cpu", [4])
    head.params.fill_(-7)
    logits[4].copy_(torch.randn(4, VOCAB))
    got = head.sample(4, _rows(MIXES["greedy"], 0))
    assert (head.params == -7).all()
    assert got.tolist() == logits[4][:3].argmax(-1).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-nemotron-h", "tiny-qwen3-next"])
def test_sampled_generation_with_graphs_equals_eager(model):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; torch.cuda.is_available() is False")
    backends = {"attention": "torch", "ssm": "torch", "mla": "torch", "delta": "torch"}
    params = [
        SamplingParams(max_tokens=10, temperature=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=1.0, top_k=7, seed=12, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=1.2, top_p=0.7, min_p=0.05, ignore_eos=True),
    ]
    results = generate_eager_and_graphed(
        model, backends, dtype="float32", prompt_lens=(3, 17, 9, 28), max_tokens=10, params=params
    )
    assert results["full_and_piecewise"] == results["off"]
