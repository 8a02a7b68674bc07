"""Speculative decoding end to end on hybrid models: the engine with n-gram drafts.

Nemotron-H (Mamba2) and Qwen3-Next (gated delta rule) verify drafts as extend
chunks; each sequence's conv and recurrent states must end at its last
accepted token, so every token equals that of the same engine decoding
without speculation. The prompts repeat the model's own continuation, so
drafts are proposed often and accepted in part: accepted runs and rejections
in the middle of a chunk both happen.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import run_requests

from backplane.engine.engine import Engine
from backplane.engine.sampling.params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_tokens=64, page_size=4)


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Token ids of every request, stepping the engine until all finish."""
    return run_requests(engine, prompts, params, check_invariants=False)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("model", ["tiny-nemotron-h", "tiny-qwen3-next"])
def test_hybrid_tokens_equal_decoding_without_speculation(model: str) -> None:
    """Greedy and seeded tokens with n-gram speculation equal those without, on models whose
    Mamba2 / delta-rule states must be rolled back to the last accepted draft."""
    plain = Engine(model=model, **ENGINE)
    spec = Engine(model=model, speculative_config=NGRAM, **ENGINE)
    rng = np.random.default_rng(5)
    vocab = min(plain.vocab_size, 96)
    start = rng.integers(1, vocab, size=6).tolist()
    # the model's own continuation, repeated in the prompt: n-gram drafts of it are accepted
    # for a while, then rejected where the longer context changes the model's choice
    cont = _run(plain, [start], [SamplingParams(max_tokens=12, temperature=0.0)])[0]
    prompts = [start + cont + start, (start + cont) * 2 + start[:3], start + cont + start]
    params = [
        SamplingParams(max_tokens=20, temperature=0.0),
        SamplingParams(max_tokens=20, temperature=0.0),
        SamplingParams(max_tokens=16, temperature=0.8, seed=11),
    ]
    want = _run(plain, prompts, params)
    got = _run(spec, prompts, params)
    assert got == want
    stats = spec.spec.stats
    # drafts were verified, some accepted and some rejected: states were kept mid-chunk
    assert stats.verified_seqs > 0
    assert 0 < stats.accepted_tokens < stats.draft_tokens
