"""MTP proposer: the target's own multi-token-prediction layers draft from its hidden states.

Step 0 of a sequence of length ``L`` runs the MTP layer at position ``L - 2``
on the target's hidden state there (:attr:`ProposalContext.hidden_states`,
the state the last token was sampled from) and the embedding of the last token
``token_ids[L - 1]``; it predicts the token at ``L``. Each further draft token
runs the layer (the next one, cycling, when there are several) on the
previous step's output and the embedding of the token it just drafted, one
position on.

The MTP attention layers keep a cache of their own per sequence (pages from
:class:`~backplane.engine.spec_decode.own_cache.OwnCache`), holding one entry
per position the layer has run at: every prompt position ``i`` but the last,
every step-0 entry, and the entries of drafted tokens the target went on to
accept. MTP layers are trained attending over the whole sequence (the layer
run at every position ``i`` on ``h_i`` and the embedding of token ``i + 1``),
so the prompt's entries are made too: the engine keeps the target's hidden
states of each prefill chunk (:attr:`ProposalContext.prefill_states`) and
the proposer runs the layer over them, as one chunk per sequence, before the
sequence's next step 0. An entry stays valid while the token it was fed is
still the sequence's token at the following position; the cache is cut at
the first one that is not. Entries are stored densely and carry their own
positions (for the rotary embedding), so positions the layer never ran at
(prompt positions read from the prefix cache, which were not recomputed, and
decode steps without a draft) are simply not attended to: drafts are then
less likely to be accepted, never wrong, since verification decides what is
kept.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from backplane.core.errors import ConfigError
from backplane.core.forward_context import forward_context, plan_step
from backplane.core.packing import build_batch_metadata
from backplane.engine.spec_decode.own_cache import SequenceCache, allocate_own_cache
from backplane.engine.spec_decode.proposer import ProposalContext, ProposalRequest
from backplane.engine.spec_decode.step_graphs import chained_draft_graphs, replay_drafts
from backplane.models.base import CausalLM
from backplane.models.mtp import MultiTokenPredictor

__all__ = ["MTPProposer"]

logger = logging.getLogger(__name__)


class MTPProposer:
    """Drafts tokens with the target's MTP layers (``model.mtp``, see
    :func:`backplane.models.mtp.attach_mtp`), greedily.

    :param target: the target model, its MTP layers attached and loaded.
    :param backends: ``{family: backend object}`` of the target (the MTP layers use its
        attention or MLA family).
    :param num_speculative_tokens: ``k``, the most tokens drafted per sequence.
    :param max_num_seqs: the most sequences drafted for at once.
    :param max_model_len: the longest sequence (tokens), drafts included.
    :param page_size: tokens per page of the MTP layers' KV cache.
    :param cuda_graphs: replay the drafting steps from graphs captured now (see
        :mod:`~backplane.engine.spec_decode.step_graphs`); on a CPU they are eager stand-ins.
    :raises ConfigError: when the target has no MTP layers attached, or more than one.
    """

    method = "mtp"

    def __init__(
        self,
        target: CausalLM,
        backends: dict[str, Any],
        *,
        num_speculative_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        page_size: int = 16,
        cuda_graphs: bool = False,
    ) -> None:
        mtp = getattr(target, "mtp", None)
        if not isinstance(mtp, MultiTokenPredictor):
            raise ConfigError(
                f"speculative method 'mtp' needs {type(target).__name__}'s multi-token-prediction "
                "layers loaded (load the model with mtp=True); use 'ngram' or 'draft_model' for "
                "a model without them"
            )
        if mtp.num_layers != 1:
            raise ConfigError(
                f"speculative method 'mtp' drafts with one MTP layer; this checkpoint has "
                f"{mtp.num_layers}, which is not supported yet (use 'draft_model' or 'ngram')"
            )
        self.mtp = mtp
        families = {f for _, m in mtp.cached_layers() for f in m.families}
        self.backends = {f: backends[f] for f in families}
        self.num_speculative_tokens = num_speculative_tokens
        self.cache, self.caches = allocate_own_cache(
            mtp,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            num_speculative_tokens=num_speculative_tokens,
            page_size=page_size,
        )
        self.device = next(mtp.parameters()).device
        #: per request: the position of each cache entry (``SequenceCache.tokens`` holds
        #: the token each entry was fed)
        self._positions: dict[str, list[int]] = {}
        #: every drafting step as captured graphs (``None``: every step eagerly)
        self.graphs = chained_draft_graphs(
            self._graph_step,
            self.backends,
            enabled=cuda_graphs,
            num_speculative_tokens=num_speculative_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            page_size=page_size,
            hidden_size=target.hidden_size,
            dtype=next(mtp.parameters()).dtype,
            device=self.device,
        )

    def _graph_step(
        self, step: int, ids: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.mtp(ids, pos, hidden, step)
        return out, self.mtp.compute_logits(out, step)

    def propose(
        self, requests: Sequence[ProposalRequest], context: ProposalContext | None = None
    ) -> list[list[int]]:
        """Draft up to ``min(k, request.max_tokens)`` tokens per request, greedily.

        :param requests: the decoding sequences.
        :param context: the target's hidden state each request's last token was sampled
            from (row ``i`` for ``requests[i]``), and those of the positions its prefill
            computed (run through the MTP layer into its cache first, also for a
            request with ``max_tokens == 0``).
        :return: one draft per request.
        :raises ValueError: without hidden states, or with a row count other than the requests'.
        """
        drafts: list[list[int]] = [[] for _ in requests]
        if context is not None and context.prefill_states is not None:
            self._absorb(requests, context.prefill_states)
        active = [i for i, r in enumerate(requests) if r.max_tokens > 0 and len(r.token_ids) >= 2]
        if not active:
            return drafts
        if context is None or context.hidden_states is None:
            raise ValueError("the MTP proposer needs the target's hidden states in its context")
        hidden_rows = context.hidden_states
        if hidden_rows.shape[0] != len(requests):
            raise ValueError(
                f"the MTP proposer got {hidden_rows.shape[0]} hidden states for "
                f"{len(requests)} requests; give one row per request"
            )
        seqs = {i: self._rolled_back(requests[i]) for i in active}
        # A sequence whose cache is empty has no context yet: the packer takes it as a
        # prefill, which comes before the decodes.
        order = sorted(active, key=lambda i: len(seqs[i].tokens) > 0)
        hidden = hidden_rows[torch.as_tensor(order, device=hidden_rows.device)].to(self.device)
        tokens = [int(requests[i].token_ids[-1]) for i in order]
        positions = [len(requests[i].token_ids) - 2 for i in order]
        replayed = self._replayed(order, requests, seqs, tokens, positions, hidden)
        if replayed is not None:
            for i, got in zip(order, replayed, strict=True):
                drafts[i].extend(got)
            return drafts
        for step in range(self.num_speculative_tokens):
            hidden, drafted = self._forward(step, order, requests, seqs, tokens, positions, hidden)
            for i, t in zip(order, drafted, strict=True):
                drafts[i].append(t)
            keep = [j for j, i in enumerate(order) if requests[i].max_tokens > step + 1]
            if not keep:
                break
            order = [order[j] for j in keep]
            hidden = hidden[torch.as_tensor(keep, device=hidden.device)]
            tokens = [drafted[j] for j in keep]
            positions = [positions[j] + 1 for j in keep]
        return drafts

    def release(self, request_ids: Iterable[str]) -> None:
        """Give back the pages of requests that went away.

        :param request_ids: the requests gone.
        """
        for rid in request_ids:
            self.cache.release(rid)
            self._positions.pop(rid, None)

    def _rolled_back(self, request: ProposalRequest) -> SequenceCache:
        """The request's cache cut at its first entry whose token the sequence no longer holds
        (or at the position step 0 is about to run at)."""
        rid = request.request_id
        seq = self.cache.get(rid)
        positions = self._positions.setdefault(rid, [])
        token_ids = request.token_ids
        last = len(token_ids) - 2
        keep = min(seq.checked, len(positions))
        while keep < len(positions):
            pos = positions[keep]
            if pos >= last or int(token_ids[pos + 1]) != seq.tokens[keep]:
                break
            keep += 1
        seq.cut(keep)
        del positions[keep:]
        seq.checked = keep
        return seq

    @torch.no_grad()
    def _absorb(
        self,
        requests: Sequence[ProposalRequest],
        states: Sequence[tuple[np.ndarray, torch.Tensor] | None],
    ) -> None:
        """Run the MTP layer at the prefill positions handed over and keep their entries.

        Position ``p`` runs on the target's hidden state there and the embedding of
        ``token_ids[p + 1]``, as in training. A sequence's entries from its first such
        position on are replaced (a recomputed prefill). One forward for all sequences,
        each its positions as one chunk after the entries it keeps.

        :param requests: the requests.
        :param states: per request, ``(positions, hidden)`` or ``None``.
        """
        if len(states) != len(requests):
            raise ValueError(
                f"the MTP proposer got prefill states for {len(states)} of {len(requests)} "
                "requests; give one entry (or None) per request"
            )
        chunks = []
        for i, st in enumerate(states):
            if st is None:
                continue
            req = requests[i]
            pos, rows = st
            # the last position has no next token yet: it is step 0's
            ok = pos < len(req.token_ids) - 2
            if not ok.any():
                continue
            pos, rows = pos[ok], rows[torch.as_tensor(ok, device=rows.device)]
            seq = self._rolled_back(req)
            positions = self._positions[req.request_id]
            keep = sum(1 for p in positions if p < int(pos[0]))
            seq.cut(keep)
            del positions[keep:]
            tokens = np.asarray(req.token_ids)[pos + 1].tolist()
            chunks.append((seq, positions, pos.tolist(), tokens, rows))
        if not chunks:
            return
        # a chunk of more than one token is an extend; one token on cached context a decode,
        # which the packer takes after them
        chunks.sort(key=lambda c: len(c[2]) == 1 and len(c[0].tokens) > 0)
        cached = [len(c[0].tokens) for c in chunks]
        tables = [
            self.cache.reserve(c[0], n + len(c[2])) for c, n in zip(chunks, cached, strict=True)
        ]
        batch = build_batch_metadata(
            [len(c[2]) for c in chunks],
            cached,
            tables,
            self.cache.page_size,
            state_slots=[c[0].slot for c in chunks],
            device=self.device,
        )
        ids = torch.tensor([t for c in chunks for t in c[3]], dtype=torch.int64, device=self.device)
        pos = torch.tensor([p for c in chunks for p in c[2]], dtype=torch.int64, device=self.device)
        hidden = torch.cat([c[4].to(self.device) for c in chunks])
        with forward_context(batch, plan_step(self.backends, batch)):
            self.mtp(ids, pos, hidden, 0)
        for seq, positions, p, t, _ in chunks:
            seq.tokens.extend(t)
            positions.extend(p)

    def _replayed(
        self,
        order: list[int],
        requests: Sequence[ProposalRequest],
        seqs: dict[int, SequenceCache],
        tokens: list[int],
        positions: list[int],
        hidden: torch.Tensor,
    ) -> list[list[int]] | None:
        """Every step replayed from the graphs (see :func:`~.step_graphs.replay_drafts`),
        or ``None`` to run them eagerly; step ``s`` runs at position ``positions + s``."""
        drafted = replay_drafts(
            self.graphs, self.cache, order, requests, seqs, tokens, positions, hidden
        )
        if drafted is not None:
            k = self.num_speculative_tokens
            for i, p in zip(order, positions, strict=True):
                self._positions[requests[i].request_id].extend(p + s for s in range(k))
        return drafted

    @torch.no_grad()
    def _forward(
        self,
        step: int,
        order: list[int],
        requests: Sequence[ProposalRequest],
        seqs: dict[int, SequenceCache],
        tokens: list[int],
        positions: list[int],
        hidden: torch.Tensor,
    ) -> tuple[torch.Tensor, list[int]]:
        """One MTP step, one token per sequence; returns its output rows and greedy tokens."""
        cached = [len(seqs[i].tokens) for i in order]
        tables = [self.cache.reserve(seqs[i], c + 1) for i, c in zip(order, cached, strict=True)]
        batch = build_batch_metadata(
            [1] * len(order),
            cached,
            tables,
            self.cache.page_size,
            state_slots=[seqs[i].slot for i in order],
            device=self.device,
        )
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        # The entries are dense in the cache; the rotary embedding takes the true positions.
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        with forward_context(batch, plan_step(self.backends, batch)):
            out = self.mtp(ids, pos, hidden, step)
            logits = self.mtp.compute_logits(out, step)
        for i, t, p in zip(order, tokens, positions, strict=True):
            seqs[i].tokens.append(t)
            self._positions[requests[i].request_id].append(p)
        return out, logits.argmax(dim=-1).tolist()
