"""MTP proposer: drafts equal the MTP layer recomputed from scratch over the entries it keeps.

The reference keeps its own list of the entries the MTP layer has run at
(position, the token it was fed, the hidden state it read), drops those whose
token the sequence no longer holds, and recomputes every drafted token with a
fresh cache over all kept entries in one chunk. The proposer, which keeps a
cache across steps, batches sequences and rolls back on rejection, must draft
the same tokens.
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
from backplane.engine.spec_decode.mtp import MTPProposer
from backplane.engine.spec_decode.proposer import ProposalContext, ProposalRequest, Proposer
from backplane.models.presets import build_preset

FAMILIES = ("attention", "ssm", "mla", "delta")
PAGE = 4


def _backends() -> dict[str, Any]:
    return torch_backends(FAMILIES)


class _Reference:
    """The MTP layer over every kept entry, recomputed from a fresh cache for each token."""

    def __init__(self, preset: str) -> None:
        backends = _backends()
        self.model = build_preset(preset, backends=backends, mtp=True).model
        self.backends = backends
        self.entries: dict[str, list[tuple[int, int, torch.Tensor]]] = {}

    @torch.no_grad()
    def _run(self, entries: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
        n = len(entries)
        pages = list(range(1, 2 + n // PAGE))
        self.model.mtp.allocate_caches(
            num_pages=len(pages) + 1, page_size=PAGE, num_slots=2, dtype=torch.float32, device="cpu"
        )
        batch = build_batch_metadata([n], [0], [pages], PAGE)
        pos = torch.tensor([e[0] for e in entries])
        ids = torch.tensor([e[1] for e in entries])
        hidden = torch.stack([e[2] for e in entries])
        with forward_context(batch, plan_step(self.backends, batch)):
            return self.model.mtp(ids, pos, hidden)[-1]

    def propose(self, rid: str, tokens: list[int], hidden: torch.Tensor, k: int) -> list[int]:
        last = len(tokens) - 2
        kept = []
        for pos, tok, h in self.entries.get(rid, []):
            if pos >= last or tokens[pos + 1] != tok:
                break
            kept.append((pos, tok, h))
        entry = (last, tokens[-1], hidden)
        draft = []
        for _ in range(k):
            kept.append(entry)
            out = self._run(kept)
            tok = int(self.model.mtp.compute_logits(out[None]).argmax(-1))
            draft.append(tok)
            entry = (entry[0] + 1, tok, out)
        self.entries[rid] = kept
        return draft


def _req(rid: str, tokens: list[int], max_tokens: int) -> ProposalRequest:
    return ProposalRequest(
        request_id=rid,
        token_ids=np.asarray(tokens, dtype=np.int32),
        max_tokens=max_tokens,
        num_verified_tokens=len(tokens) - 1,
    )


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-qwen3-next"])
def test_drafts_equal_the_mtp_layer_recomputed_over_its_kept_entries(preset, k):
    backends = _backends()
    target = build_preset(preset, backends=backends, mtp=True).model
    proposer = MTPProposer(
        target, backends, num_speculative_tokens=k, max_num_seqs=3, max_model_len=64, page_size=PAGE
    )
    assert isinstance(proposer, Proposer)
    ref = _Reference(preset)
    rng = np.random.default_rng(11)
    gen = torch.Generator().manual_seed(2)
    seqs = {"a": rng.integers(0, 256, 5).tolist(), "b": rng.integers(0, 256, 2).tolist()}
    seqs["c"] = list(seqs["a"])
    for step in range(5):
        ids = list(seqs)
        limits = {r: (1 if r == "c" and step == 2 else k) for r in ids}
        hidden = torch.randn(len(ids), target.hidden_size, generator=gen)
        drafts = proposer.propose(
            [_req(r, seqs[r], limits[r]) for r in ids], ProposalContext(hidden_states=hidden)
        )
        for j, rid in enumerate(ids):
            want = ref.propose(rid, seqs[rid], hidden[j], limits[rid])
            assert drafts[j] == want, (preset, k, step, rid)
        # "a" accepts every draft, "b" the first only, "c" none.
        seqs["a"] = seqs["a"] + drafts[0] + [int(rng.integers(0, 256))]
        seqs["b"] = seqs["b"] + drafts[1][:1] + [(drafts[1][-1] + 1) % 256]
        seqs["c"] = seqs["c"] + [(drafts[2][0] + 5) % 256]
    proposer.release(ids)
    assert not proposer.cache.sequences


def test_the_mtp_proposer_needs_mtp_layers_and_hidden_states():
    backends = _backends()
    plain = build_preset("tiny-qwen3-next", backends=backends).model
    with pytest.raises(ConfigError, match="mtp=True"):
        MTPProposer(plain, backends, num_speculative_tokens=1, max_num_seqs=1, max_model_len=16)
    target = build_preset("tiny-qwen3-next", backends=backends, mtp=True).model
    proposer = MTPProposer(
        target, backends, num_speculative_tokens=1, max_num_seqs=1, max_model_len=16
    )
    with pytest.raises(ValueError, match="hidden states"):
        proposer.propose([_req("a", [1, 2, 3], 1)])
