"""Draft-model proposer: its drafts are the draft model's own greedy continuation.

The reference is a second copy of the draft model (the same preset weights)
that recomputes every sequence from its first token for each drafted token,
with no cache carried between tokens; the proposer must draft exactly those
tokens while it keeps, rolls back and reuses its own caches across steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from model_run_helpers import torch_backends

from backplane.core.errors import ConfigError
from backplane.core.forward_context import forward_context, plan_step
from backplane.core.packing import build_batch_metadata
from backplane.engine.spec_decode.draft import DraftModelProposer
from backplane.engine.spec_decode.proposer import ProposalRequest, Proposer
from backplane.models.base import build_model
from backplane.models.presets import VOCAB_SIZE, build_preset, preset_config
from backplane.models.registry import model_class

FAMILIES = ("attention", "ssm", "mla", "delta")
PAGE = 4


def _backends() -> dict[str, Any]:
    return torch_backends(FAMILIES)


class _Reference:
    """Greedy generation by recomputing the whole sequence for every token."""

    def __init__(self, preset: str) -> None:
        self.backends = _backends()
        self.model = build_preset(preset, backends=self.backends).model
        self.backends = {f: self.backends[f] for f in self.model.families}

    @torch.no_grad()
    def greedy(self, tokens: list[int], n: int) -> list[int]:
        seq = list(tokens)
        out = []
        for _ in range(n):
            pages = list(range(1, 2 + len(seq) // PAGE))
            self.model.allocate_caches(
                num_pages=len(pages) + 1,
                page_size=PAGE,
                num_slots=2,
                dtype=torch.float32,
                device="cpu",
            )
            batch = build_batch_metadata([len(seq)], [0], [pages], PAGE)
            with forward_context(batch, plan_step(self.backends, batch)):
                hidden = self.model(torch.tensor(seq), batch.positions)
                logits = self.model.compute_logits(hidden[-1:])
            tok = int(logits.argmax(-1))
            out.append(tok)
            seq.append(tok)
        return out


def _proposer(preset: str, k: int, max_num_seqs: int = 4) -> DraftModelProposer:
    backends = _backends()
    draft = build_preset(preset, backends=backends).model
    return DraftModelProposer(
        draft,
        backends,
        num_speculative_tokens=k,
        target_vocab_size=VOCAB_SIZE,
        max_num_seqs=max_num_seqs,
        max_model_len=64,
        page_size=PAGE,
    )


def _req(rid: str, tokens: list[int], max_tokens: int) -> ProposalRequest:
    return ProposalRequest(
        request_id=rid,
        token_ids=np.asarray(tokens, dtype=np.int32),
        max_tokens=max_tokens,
        num_verified_tokens=len(tokens) - 1,
    )


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-next", "tiny-nemotron-h"])
def test_drafts_equal_the_draft_models_greedy_continuation_across_steps(preset):
    k = 3
    proposer = _proposer(preset, k)
    assert isinstance(proposer, Proposer)
    ref = _Reference(preset)
    rng = np.random.default_rng(5)
    seqs = {
        "a": rng.integers(0, 256, 9).tolist(),
        "b": rng.integers(0, 256, 2).tolist(),
        "c": rng.integers(0, 256, 14).tolist(),
    }
    for step in range(4):
        ids = list(seqs)
        limits = {rid: k if rid != "b" or step != 1 else 1 for rid in ids}
        drafts = proposer.propose([_req(r, seqs[r], limits[r]) for r in ids])
        for rid, draft in zip(ids, drafts, strict=True):
            assert draft == ref.greedy(seqs[rid], limits[rid]), (preset, step, rid)
        # Commit as verification would: "a" keeps its whole draft plus a token of the
        # target's, "b" one draft token then a different token, "c" rejects at once.
        seqs["a"] = seqs["a"] + drafts[0] + [int(rng.integers(0, 256))]
        seqs["b"] = seqs["b"] + drafts[1][:1] + [(drafts[1][-1] + 1) % 256]
        seqs["c"] = seqs["c"] + [(drafts[2][0] + 7) % 256]
    proposer.release(["a", "b", "c"])
    assert not proposer.cache.sequences
    # Everything given back: a fresh request may use every slot again.
    drafts = proposer.propose([_req(str(i), seqs["a"], 1) for i in range(4)])
    assert drafts == [ref.greedy(seqs["a"], 1)] * 4


def test_a_request_with_max_tokens_zero_gets_no_draft():
    proposer = _proposer("tiny-llama", 2)
    drafts = proposer.propose([_req("a", [1, 2, 3], 0), _req("b", [4, 5], 2)])
    assert drafts[0] == []
    assert drafts[1] == _Reference("tiny-llama").greedy([4, 5], 2)
    assert "a" not in proposer.cache.sequences


def test_a_draft_model_of_another_vocabulary_is_refused():
    backends = _backends()
    config = preset_config("tiny-llama")
    config["vocab_size"] = VOCAB_SIZE + 64
    draft = build_model(
        model_class(config.architecture), config, backends, dtype=torch.float32, device="cpu"
    )
    with pytest.raises(ConfigError, match=r"vocabulary of 384 tokens, the target model 320"):
        DraftModelProposer(
            draft,
            backends,
            num_speculative_tokens=2,
            target_vocab_size=VOCAB_SIZE,
            max_num_seqs=1,
            max_model_len=32,
        )


def test_more_sequences_than_the_draft_cache_holds_is_an_error_saying_what_to_do():
    proposer = _proposer("tiny-llama", 1, max_num_seqs=1)
    proposer.propose([_req("a", [1, 2], 1)])
    with pytest.raises(ConfigError, match="max_num_seqs"):
        proposer.propose([_req("b", [1, 2], 1)])


def test_common_prefix_from_a_known_start_equals_a_scan_from_the_first_token():
    from backplane.engine.spec_decode.own_cache import common_prefix

    rng = np.random.default_rng(4)
    for _ in range(300):
        tokens = rng.integers(0, 3, int(rng.integers(0, 12)))
        cached = [int(t) for t in tokens[: int(rng.integers(0, len(tokens) + 1))]]
        cached += rng.integers(0, 3, int(rng.integers(0, 4))).tolist()
        want = 0
        while want < min(len(cached), len(tokens)) and cached[want] == tokens[want]:
            want += 1
        # any start up to the true prefix gives the same answer
        for start in range(want + 1):
            assert common_prefix(cached, tokens, start=start) == want
