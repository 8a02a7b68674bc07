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


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(
    ("model", "spec"),
    [
        ("tiny-deepseek-v3", MTP),
        (
            "tiny-llama",
            {"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": 2},
        ),
    ],
)
def test_a_finished_or_aborted_request_gives_back_the_proposer_cache_in_its_last_step(model, spec):
    engine = Engine(model=model, speculative_config=spec, **ENGINE)
    cache = engine.spec.proposer.cache
    free = len(cache._free_pages), len(cache._free_slots)
    rng = np.random.default_rng(2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    done = engine.add_request(rng.integers(1, 256, size=9).tolist(), params)
    aborted = engine.add_request(rng.integers(1, 256, size=6).tolist(), params)
    finished: set[str] = set()
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        if steps == 4:
            # both have drafted by now: the proposer holds pages for them
            assert len(cache._free_pages) < free[0]
            assert engine.abort_request(aborted)
        finished |= {o.request_id for o in outs if o.finished}
    assert finished == {done, aborted}
    assert engine.spec.stats.draft_tokens > 0
    # no further step ran: the last one gave everything back
    assert (len(cache._free_pages), len(cache._free_slots)) == free
    assert not engine.spec._hidden and not engine.spec._known
