"""Draft-model proposer: a smaller model of the same vocabulary drafts greedily.

The draft model keeps a KV cache (and recurrent-state slots, for a hybrid
draft) of its own, handed out by :class:`~backplane.engine.spec_decode.own_cache.OwnCache`
outside the scheduler. Each step, for every sequence, it catches up on the
tokens the target committed since the last step (one ragged forward for all
sequences, prefills and extends first), then drafts ``k`` tokens greedily, one
batched single-token forward per further token. With graphs, the catch-up's
last token per sequence and every further step replay from one graph (see
:mod:`~backplane.engine.spec_decode.step_graphs`); only the tokens before a
sequence's last run eagerly (a new sequence, or one whose every draft was
accepted). The cache is rolled back to
the longest prefix it shares with the sequence (a rejected draft's keys and
values are simply overwritten later); a draft with recurrent state cannot undo
tokens, so after a rejection it recomputes that sequence from its start.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from backplane.core.errors import ConfigError
from backplane.core.forward_context import forward_context, plan_step
from backplane.core.hookspecs import FAMILIES
from backplane.core.packing import build_batch_metadata
from backplane.core.parallel import unsplit
from backplane.engine.spec_decode.config import SpeculativeConfig
from backplane.engine.spec_decode.own_cache import (
    SequenceCache,
    allocate_own_cache,
    common_prefix,
)
from backplane.engine.spec_decode.proposer import ProposalContext, ProposalRequest
from backplane.engine.spec_decode.step_graphs import chained_draft_graphs, replay_drafts
from backplane.models.base import CausalLM

__all__ = ["DraftModelProposer", "check_draft_vocabulary", "load_draft_proposer"]

logger = logging.getLogger(__name__)


def check_draft_vocabulary(draft: CausalLM, target_vocab_size: int, name: str = "") -> None:
    """Refuse a draft model whose vocabulary is not the target's.

    :param draft: the draft model.
    :param target_vocab_size: the target's vocabulary size.
    :param name: the draft's name or path, for the message.
    :raises ConfigError: when the sizes differ.
    """
    if draft.vocab_size != target_vocab_size:
        what = f" {name!r}" if name else ""
        raise ConfigError(
            f"speculative_config draft model{what} has a vocabulary of {draft.vocab_size} tokens, "
            f"the target model {target_vocab_size}; a draft model must share the target's "
            "tokenizer and vocabulary (pick a smaller model of the same family)"
        )


class DraftModelProposer:
    """Drafts tokens with a second, smaller model run greedily on its own caches.

    :param draft: the draft model (weights loaded).
    :param backends: ``{family: backend object}`` the draft runs on (those it uses).
    :param num_speculative_tokens: ``k``, the most tokens drafted per sequence.
    :param target_vocab_size: the target's vocabulary size (must equal the draft's).
    :param max_num_seqs: the most sequences drafted for at once.
    :param max_model_len: the longest sequence (tokens), drafts included.
    :param page_size: tokens per page of the draft's KV cache.
    :param cuda_graphs: replay the drafting steps from graphs captured now (see
        :mod:`~backplane.engine.spec_decode.step_graphs`); on a CPU they are eager stand-ins.
    :raises ConfigError: on a different vocabulary size.
    """

    method = "draft_model"

    def __init__(
        self,
        draft: CausalLM,
        backends: dict[str, Any],
        *,
        num_speculative_tokens: int,
        target_vocab_size: int,
        max_num_seqs: int,
        max_model_len: int,
        page_size: int = 16,
        cuda_graphs: bool = False,
    ) -> None:
        check_draft_vocabulary(draft, target_vocab_size)
        self.draft = draft
        self.backends = {f: backends[f] for f in draft.families}
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.cache, self.caches = allocate_own_cache(
            draft,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            num_speculative_tokens=num_speculative_tokens,
            page_size=page_size,
        )
        param = next(draft.parameters())
        self.device = param.device
        specs = draft.cache_specs(num_pages=1, page_size=page_size, num_slots=1, dtype=param.dtype)
        #: the per-slot (recurrent) cache tensors, cleared for a sequence that starts over
        self._state_tensors = [
            self.caches[layer][name]
            for layer, layer_specs in specs.items()
            for name, spec in layer_specs.items()
            if not spec.paged
        ]
        self._recurrent = bool(getattr(draft, "has_recurrent_state", False))
        #: the drafting steps as captured graphs (``None``: every step eagerly)
        self.graphs = chained_draft_graphs(
            self._graph_step,
            self.backends,
            enabled=cuda_graphs,
            num_speculative_tokens=num_speculative_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            page_size=page_size,
            device=self.device,
        )

    def _graph_step(
        self, step: int, ids: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[None, torch.Tensor]:
        return None, self.draft.compute_logits(self.draft(ids, pos))

    def propose(
        self, requests: Sequence[ProposalRequest], context: ProposalContext | None = None
    ) -> list[list[int]]:
        """Draft up to ``min(k, request.max_tokens)`` tokens per request, greedily.

        :param requests: the decoding sequences.
        :param context: unused (the draft reads only the token ids).
        :return: one draft per request.
        """
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, r in enumerate(requests) if r.max_tokens > 0 and len(r.token_ids)]
        if not active:
            return drafts
        seqs = {i: self._rolled_back(requests[i]) for i in active}
        # First forward: each sequence's uncached tokens, prefills / extends before decodes.
        feeds = {i: np.asarray(requests[i].token_ids[len(seqs[i].tokens) :]) for i in active}
        replayed = self._replayed(active, requests, seqs, feeds)
        if replayed is not None:
            for i, got in zip(active, replayed, strict=True):
                drafts[i].extend(got)
            return drafts
        order = sorted(active, key=lambda i: _is_decode(feeds[i], seqs[i]))
        tokens = self._forward(order, seqs, feeds)
        for i, t in zip(order, tokens, strict=True):
            drafts[i].append(t)
        for step in range(1, self.num_speculative_tokens):
            order = [i for i in order if requests[i].max_tokens > step]
            if not order:
                break
            feeds = {i: np.asarray([drafts[i][-1]]) for i in order}
            tokens = self._forward(order, seqs, feeds)
            for i, t in zip(order, tokens, strict=True):
                drafts[i].append(t)
        return drafts

    def release(self, request_ids: Iterable[str]) -> None:
        """Give back the pages and slots of requests that went away.

        :param request_ids: the requests gone.
        """
        for rid in request_ids:
            self.cache.release(rid)

    def _replayed(
        self,
        active: list[int],
        requests: Sequence[ProposalRequest],
        seqs: dict[int, SequenceCache],
        feeds: dict[int, np.ndarray],
    ) -> list[list[int]] | None:
        """Every step replayed from the graphs, fed each sequence's last uncached token
        (those before it run eagerly first, and ``feeds`` keeps only the last), or ``None``
        to run the steps eagerly (see :func:`~.step_graphs.replay_drafts`)."""
        graphs = self.graphs
        k = self.num_speculative_tokens
        if (
            graphs is None
            or any(requests[i].max_tokens < k for i in active)
            or graphs.bucket_for(len(active)) is None
        ):
            return None
        before = {i: feeds[i][:-1] for i in active if len(feeds[i]) > 1}
        if before:
            self._forward(
                sorted(before, key=lambda i: _is_decode(before[i], seqs[i])), seqs, before
            )
            for i in before:
                feeds[i] = feeds[i][-1:]
        fed = [int(feeds[i][0]) for i in active]
        # the draft's positions are its cache entries
        positions = [len(seqs[i].tokens) for i in active]
        return replay_drafts(graphs, self.cache, active, requests, seqs, fed, positions)

    def _rolled_back(self, request: ProposalRequest) -> SequenceCache:
        """The request's cache, cut to the prefix it shares with the sequence, the last token
        left out so that it is fed again (its logits give the first draft)."""
        seq = self.cache.get(request.request_id)
        same = common_prefix(seq.tokens, request.token_ids, start=seq.checked)
        keep = min(same, len(request.token_ids) - 1)
        if keep < len(seq.tokens) and self._recurrent:
            # A recurrent state holds every token it read: recompute from the start.
            keep = 0
        seq.cut(keep)
        seq.checked = keep
        return seq

    @torch.no_grad()
    def _forward(
        self, order: list[int], seqs: dict[int, SequenceCache], feeds: dict[int, np.ndarray]
    ) -> list[int]:
        """Run the draft over ``feeds`` (in ``order``) and return each sequence's greedy next token."""
        query_lens = [len(feeds[i]) for i in order]
        cached = [len(seqs[i].tokens) for i in order]
        tables = [
            self.cache.reserve(seqs[i], c + q)
            for i, c, q in zip(order, cached, query_lens, strict=True)
        ]
        for i, c in zip(order, cached, strict=True):
            if c == 0 and self._recurrent:
                self._clear_state(seqs[i].slot)
        batch = build_batch_metadata(
            query_lens,
            cached,
            tables,
            self.cache.page_size,
            state_slots=[seqs[i].slot for i in order],
            device=self.device,
        )
        ids = torch.from_numpy(np.concatenate([feeds[i] for i in order]).astype(np.int64))
        with forward_context(batch, plan_step(self.backends, batch)):
            hidden = self.draft(ids.to(self.device), batch.positions)
            last = torch.as_tensor(np.cumsum(query_lens) - 1, device=self.device)
            logits = self.draft.compute_logits(hidden[last])
        for i in order:
            seqs[i].tokens.extend(int(t) for t in feeds[i])
        return logits.argmax(dim=-1).tolist()

    def _clear_state(self, slot: int) -> None:
        # A sequence starting over must not read the previous occupant's state.
        for tensor in self._state_tensors:
            tensor[slot].zero_()


def _is_decode(feed: np.ndarray, seq: SequenceCache) -> bool:
    # the packer takes decodes (one token on cached context) after prefills and extends
    return len(feed) == 1 and len(seq.tokens) > 0


def load_draft_proposer(
    config: SpeculativeConfig,
    *,
    target: CausalLM,
    backends: dict[str, Any],
    max_num_seqs: int,
    max_model_len: int,
    page_size: int = 16,
    cuda_graphs: bool = False,
) -> DraftModelProposer:
    """Load ``config.model`` in the target's dtype on its device and wrap it as a proposer.

    :param config: a ``method="draft_model"`` configuration.
    :param target: the target model (for the dtype, device and vocabulary size).
    :param backends: ``{family: backend object}`` of the target; families the draft uses
        beyond them get the same-named backend where it runs here, else ``auto``'s choice.
    :param max_num_seqs: the most sequences drafted for at once.
    :param max_model_len: the longest sequence.
    :param page_size: tokens per page of the draft's KV cache.
    :param cuda_graphs: replay the drafting steps from captured graphs.
    :return: the proposer.
    :raises ConfigError: another method, a draft that does not load, or one of another vocabulary.
    """
    from backplane.models import load_model

    if config.method != "draft_model" or not config.model:
        raise ConfigError(
            f"load_draft_proposer takes method='draft_model' with a model, got {config.method!r}"
        )
    param = next(target.parameters())
    backends = _with_every_family(backends, param.device)
    # Whole even next to a target split over ranks: the driver runs it alone.
    with unsplit():
        loaded = load_model(
            config.model, dtype=param.dtype, device=param.device, backends=backends, progress=False
        )
        check_draft_vocabulary(loaded.model, target.vocab_size, config.model)
        logger.info(
            "draft model %s: %d layers, %d parameters",
            config.model,
            getattr(loaded.model, "num_layers", 0),
            sum(p.numel() for p in loaded.model.parameters()),
        )
        return DraftModelProposer(
            loaded.model,
            backends,
            num_speculative_tokens=config.num_speculative_tokens,
            target_vocab_size=target.vocab_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            page_size=page_size,
            cuda_graphs=cuda_graphs,
        )


def _with_every_family(backends: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``backends`` plus a backend for every other op family (a hybrid draft of an
    attention-only target needs the SSM and delta families too)."""
    from backplane.engine.selection import select_backends_for

    missing = [f for f in FAMILIES if f not in backends]
    if not missing:
        return dict(backends)
    names = {getattr(b, "name", None) for b in backends.values()}
    prefer = next(iter(names)) if len(names) == 1 else None
    extra = select_backends_for({}, missing, prefer=prefer, device=device.type)
    return {**extra, **backends}
