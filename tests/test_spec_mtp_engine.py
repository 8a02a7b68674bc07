"""Speculative decoding with the model's MTP layers in the engine: the same tokens as without.

The MTP layers are loaded only when speculation asks for them; the drafts
they make from the target's hidden states are verified like any other, so
greedy and seeded tokens equal plain decoding's.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import run_requests as _run

from backplane.core.errors import ConfigError
from backplane.engine.engine import Engine
from backplane.engine.sampling import SamplingParams
from backplane.engine.spec_decode.mtp import MTPProposer

ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_tokens=64, page_size=4)
MTP = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.mark.usefixtures("one_torch_thread")
def test_mtp_tokens_equal_decoding_without_speculation():
    rng = np.random.default_rng(8)
    prompts = [rng.integers(1, 256, size=n).tolist() for n in (7, 2, 12)]
    params = [
        SamplingParams(max_tokens=14, temperature=0.0),
        SamplingParams(max_tokens=9, temperature=0.0),
        SamplingParams(max_tokens=10, temperature=0.8, seed=3),
    ]
    plain = Engine(model="tiny-deepseek-v3", **ENGINE)
    spec = Engine(model="tiny-deepseek-v3", speculative_config=MTP, **ENGINE)
    assert getattr(plain.model, "mtp", None) is None
    assert isinstance(spec.spec.proposer, MTPProposer)
    assert _run(spec, prompts, params) == _run(plain, prompts, params)
    assert spec.spec.stats.draft_tokens > 0


def test_mtp_on_a_model_without_mtp_layers_is_refused():
    with pytest.raises(ConfigError, match="multi-token-prediction"):
        Engine(model="tiny-llama", speculative_config=MTP, **ENGINE)
