"""The MTP proposer attends over the whole prompt, as the MTP layer does in training.

After a prompt of ``P`` tokens is prefilled (in one step or in chunks) and
its first token sampled, the proposer's first draft must equal the MTP layer
run over the whole sequence from scratch: at every position ``i < P`` on the
target's hidden state there (from one full forward of the target) and the
embedding of token ``i + 1``, with causal attention over all of them; its last
row drafts. Speculation with MTP must also keep plain decoding's tokens with
prefix caching and preemption.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import run_requests
from model_run_helpers import torch_backends

from backplane.core.forward_context import forward_context, plan_step
from backplane.core.packing import build_batch_metadata
from backplane.engine.engine import Engine
from backplane.engine.sampling import SamplingParams
from backplane.models.presets import build_preset

FAMILIES = ("attention", "ssm", "mla", "delta")
PAGE = 4
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=2, page_size=PAGE)
MTP = {"method": "mtp", "num_speculative_tokens": 1}


def _reference(preset: str, seq: list[int]) -> torch.Tensor:
    """Draft logits of the MTP layer over ``seq`` (prompt + the first sampled token):
    a full target forward over the prompt, then the MTP layer over positions
    ``0 .. P - 1`` fed tokens ``1 .. P``, one causal chunk from an empty cache.

    :param preset: the model.
    :param seq: the prompt's tokens and the first sampled one.
    :return: ``[vocab]`` float32 logits of the last position.
    """
    backends = torch_backends(FAMILIES)
    # the preset's fixed-seed weights: the engine's model is built from the same
    lm = build_preset(preset, backends=backends, mtp=True).model
    p = len(seq) - 1
    pages = list(range(1, 2 + p // PAGE))
    kw = dict(num_pages=len(pages) + 1, page_size=PAGE, num_slots=2, dtype=torch.float32)
    lm.allocate_caches(**kw, device="cpu")
    lm.mtp.allocate_caches(**kw, device="cpu")
    batch = build_batch_metadata([p], [0], [pages], PAGE)
    with torch.no_grad():
        with forward_context(batch, plan_step(backends, batch)):
            hidden = lm(torch.tensor(seq[:p]), batch.positions)[:p]
        with forward_context(batch, plan_step(backends, batch)):
            out = lm.mtp(torch.tensor(seq[1:]), batch.positions, hidden)
            return lm.mtp.compute_logits(out[-1:])[0]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("max_num_tokens", [64, 8], ids=["one-chunk", "chunked"])
@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-qwen3-next"])
def test_first_draft_equals_the_mtp_layer_over_the_whole_prompt(preset, max_num_tokens):
    engine = Engine(model=preset, speculative_config=MTP, max_num_tokens=max_num_tokens, **ENGINE)
    proposer = engine.spec.proposer
    seen: list[tuple[list[int], list[int], torch.Tensor]] = []
    logits: list[torch.Tensor] = []
    compute_logits = proposer.mtp.compute_logits
    propose = proposer.propose

    def spy_logits(hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        out = compute_logits(hidden, step)
        logits.append(out.clone())
        return out

    def spy_propose(requests, context=None):
        before = len(logits)
        drafts = propose(requests, context)
        if drafts[0]:
            seen.append((requests[0].token_ids.tolist(), drafts[0], logits[before][0]))
        return drafts

    proposer.mtp.compute_logits = spy_logits
    proposer.propose = spy_propose
    prompt = np.random.default_rng(5).integers(1, 256, size=19).tolist()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0))
    while not seen and engine.has_unfinished_requests():
        engine.step()
    assert seen, "the request never got a draft"
    # the proposer's cache holds one entry per prompt position, the last step 0's
    positions = list(proposer._positions[rid])
    while engine.has_unfinished_requests():
        engine.step()
    seq, draft, got = seen[0]
    assert seq[: len(prompt)] == prompt and len(seq) == len(prompt) + 1
    want = _reference(preset, seq)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert draft == [int(want.argmax())]
    assert positions == list(range(len(prompt)))


@pytest.mark.usefixtures("one_torch_thread")
def test_mtp_with_prefix_caching_and_preemption_keeps_plain_decoding():
    kw = dict(ENGINE, max_num_seqs=4, max_num_tokens=64, num_kv_pages=24)
    kw["enable_prefix_caching"] = True
    plain = Engine(model="tiny-deepseek-v3", **kw)
    spec = Engine(model="tiny-deepseek-v3", speculative_config=MTP, **kw)
    rng = np.random.default_rng(8)
    base = rng.integers(1, 256, size=6).tolist()
    prompts = [base * 2 + rng.integers(1, 50, size=i % 3 + 1).tolist() for i in range(6)]
    params = [SamplingParams(max_tokens=14 + i, temperature=0.0) for i in range(6)]
    want = run_requests(plain, prompts, params)
    assert run_requests(spec, prompts, params) == want
    assert spec.scheduler.stats.preemptions > 0
    assert spec.spec.stats.draft_tokens > 0
    # again from a warm prefix cache: the positions it served were not computed
    again = [p + o for p, o in zip(prompts, want, strict=True)]
    assert run_requests(spec, again, params) == run_requests(plain, again, params)
