"""Speculative decoding with a draft model in the engine: the same tokens as without it.

With the target itself as its draft, every greedy draft token is the target's
own choice, so all of them must be accepted; with another model of the same
vocabulary (a hybrid one, whose states the draft recomputes after a
rejection) the tokens are still those of plain decoding.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import run_requests as _run

from backplane.core.errors import ConfigError
from backplane.engine.engine import Engine
from backplane.engine.sampling import SamplingParams
from backplane.engine.spec_decode.draft import DraftModelProposer

ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_tokens=64, page_size=4)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(1, 256, size=n).tolist() for n in (9, 3, 14)]


PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0),
    SamplingParams(max_tokens=9, temperature=0.0),
    SamplingParams(max_tokens=10, temperature=0.8, seed=5),
]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("draft", ["tiny-llama", "tiny-qwen3-next"])
def test_draft_model_tokens_equal_decoding_without_speculation(draft):
    plain = Engine(model="tiny-llama", **ENGINE)
    spec = Engine(
        model="tiny-llama",
        speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
        **ENGINE,
    )
    assert isinstance(spec.spec.proposer, DraftModelProposer)
    want = _run(plain, _prompts(), PARAMS)
    got = _run(spec, _prompts(), PARAMS)
    assert got == want
    stats = spec.spec.stats
    assert stats.verified_seqs > 0
    if draft == "tiny-llama":
        # the target drafting for itself: every greedy draft is the target's own argmax
        greedy = Engine(
            model="tiny-llama",
            speculative_config={
                "method": "draft_model",
                "model": draft,
                "num_speculative_tokens": 3,
            },
            **ENGINE,
        )
        _run(greedy, _prompts()[:2], PARAMS[:2])
        assert greedy.spec.stats.draft_tokens > 0
        assert greedy.spec.stats.acceptance_rate == 1.0
        assert greedy.scheduler.stats.steps < plain.scheduler.stats.steps


def test_a_draft_model_of_another_vocabulary_is_refused_at_start_up(tmp_path):
    transformers = pytest.importorskip("transformers")
    import hf_tiny

    transformers.Qwen3ForCausalLM(hf_tiny.qwen3()).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="vocabulary of 96 tokens, the target model 320"):
        Engine(
            model="tiny-llama",
            speculative_config={
                "method": "draft_model",
                "model": str(tmp_path),
                "num_speculative_tokens": 2,
            },
            **ENGINE,
        )
