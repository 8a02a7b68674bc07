"""Per-request grammar matchers of one engine: the step's token bitmask, advanced on commit."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from backplane.engine.request import Request
from backplane.engine.sampling.rows import GrammarBitmask
from backplane.engine.sampling.structured import StructuredOutputsParams
from backplane.engine.structured_output.compiler import DEFAULT_CACHE_SIZE, GrammarCompiler
from backplane.engine.structured_output.vocabulary import import_xgrammar, tokenizer_info

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    """The grammars of an engine's live requests.

    The tokenizer description and the compiler are built on first use (a
    model that never sees a constrained request never imports xgrammar).
    :meth:`compile` may run on any thread; the rest runs on the engine loop.

    :param tokenizer: the model's tokenizer (Any: whatever its checkpoint's loader made).
    :param vocab_size: the model's vocabulary size (the logits' width).
    :param eos_token_ids: ids that end a sequence; a complete grammar allows only these.
    :param cache_size: most compiled grammars kept.
    :param pin_memory: build the step's bitmask in pinned host memory (the sampler's copy
        to a CUDA device then runs without holding the host).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
        pin_memory: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self.pin_memory = bool(pin_memory)
        self.vocab_size = int(vocab_size)
        self._eos = tuple(int(t) for t in eos_token_ids)
        self._cache_size = cache_size
        self._compiler: GrammarCompiler | None = None
        self._build_lock = threading.Lock()
        # request id -> xgrammar.GrammarMatcher (Any: xgrammar ships no type information)
        self._matchers: dict[str, Any] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar compiler (built on first use, once, from any thread)."""
        if self._compiler is None:
            with self._build_lock:
                if self._compiler is None:
                    info = tokenizer_info(self._tokenizer, self.vocab_size, self._eos)
                    self._compiler = GrammarCompiler(info, self._cache_size)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """Compile ``spec`` (or find it in the cache); safe off the engine loop.

        :param spec: the constraint.
        :return: the compiled grammar.
        :raises InvalidFieldError: it does not compile.
        """
        return self.compiler.compile(spec)

    def add(self, request_id: str, spec: StructuredOutputsParams) -> None:
        """Give a request a matcher at the start of its grammar.

        :param request_id: the request (each sample of ``n > 1`` is its own request).
        :param spec: its constraint.
        :raises InvalidFieldError: it does not compile.
        """
        compiled = self.compile(spec)
        self._matchers[request_id] = import_xgrammar().GrammarMatcher(compiled)

    def discard(self, request_id: str) -> None:
        """Forget a request's matcher (finished or aborted); no-op when it has none.

        :param request_id: the request.
        """
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def waits_for_tokens(self, reqs: Sequence[Request]) -> bool:
        """Whether a row of a step has a grammar and a token still in flight.

        Such a row's mask can be filled only once that token reached the host
        and its matcher took it, so the engine commits the step in flight before
        it samples this one (the forward needs neither and runs meanwhile).

        :param reqs: the step's sampling requests.
        :return: True when some request of ``reqs`` with a grammar has a pending token.
        """
        if not self._matchers:
            return False
        matchers = self._matchers
        return any(r.has_pending_token and r.request_id in matchers for r in reqs)

    def bitmask(self, reqs: Sequence[Request]) -> GrammarBitmask | None:
        """The allowed next tokens of the step's rows that have a grammar.

        Every matcher must have taken its request's committed tokens (the engine
        commits the step in flight before it samples a step where
        :meth:`waits_for_tokens` holds).

        :param reqs: the step's sampling requests, in row order.
        :return: the rows and their int32 bitmask on the host, or ``None`` when no row
            has a grammar.
        """
        if not self._matchers:
            return None
        rows = [i for i, r in enumerate(reqs) if r.request_id in self._matchers]
        if not rows:
            return None
        # every word of every row is written below; -1 (all allowed) is xgrammar's start
        words = (self.vocab_size + 31) // 32
        mask = torch.full((len(rows), words), -1, dtype=torch.int32, pin_memory=self.pin_memory)
        for j, i in enumerate(rows):
            self._fill(self._matchers[reqs[i].request_id], mask, j)
        return GrammarBitmask(np.asarray(rows, dtype=np.int64), mask)

    def _fill(self, matcher: Any, mask: torch.Tensor, row: int) -> None:
        """Write the tokens ``matcher`` allows next into row ``row`` of ``mask``."""
        if matcher.is_terminated():
            # complete (ignore_eos kept it going): only the end of sequence stays allowed
            mask[row].zero_()
            for t in self._eos:
                bit = 1 << (t % 32)
                mask[row, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit
        else:
            matcher.fill_next_token_bitmask(mask, row)

    def valid_draft_length(self, request_id: str, draft: Sequence[int]) -> int:
        """How many leading tokens of a draft the request's grammar takes.

        The matcher is advanced over the draft and rolled back, so it is left
        at the request's committed tokens.

        :param request_id: the request.
        :param draft: proposed next tokens.
        :return: the length of the longest prefix of ``draft`` the grammar allows
            (``len(draft)`` when the request has no grammar).
        """
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return len(draft)
        n = 0
        for t in draft:
            if matcher.is_terminated() or not matcher.accept_token(int(t)):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return n

    def draft_bitmask(
        self, request_id: str, draft: Sequence[int], width: int
    ) -> torch.Tensor | None:
        """The allowed tokens at every position of a verifying chunk.

        Row ``i`` is what the grammar allows after the committed tokens and
        ``draft[:i]`` (the mask of the target's logits at position ``i``);
        rows past ``len(draft)`` allow every token (their logits are not read).
        The matcher is advanced over the draft and rolled back.

        :param request_id: the request.
        :param draft: its draft tokens, every one allowed by the grammar in turn
            (:meth:`valid_draft_length` cut it so).
        :param width: rows wanted, at least ``len(draft) + 1``.
        :return: ``[width, ceil(vocab / 32)]`` int32 on the host, or ``None`` when the
            request has no grammar.
        :raises ValueError: the grammar refuses a draft token, or ``width`` is too small.
        """
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return None
        if width < len(draft) + 1:
            raise ValueError(f"width {width} leaves no row for the token after {len(draft)} drafts")
        mask = import_xgrammar().allocate_token_bitmask(width, self.vocab_size)
        taken = 0
        try:
            for i, t in enumerate(draft):
                self._fill(matcher, mask, i)
                if matcher.is_terminated() or not matcher.accept_token(int(t)):
                    raise ValueError(
                        f"request {request_id!r}: draft token {int(t)} at position {i} is not "
                        "allowed by its grammar; cut drafts with valid_draft_length first"
                    )
                taken += 1
            self._fill(matcher, mask, len(draft))
        finally:
            if taken:
                matcher.rollback(taken)
        return mask

    def accept(self, sampled: Mapping[str, int | Sequence[int]]) -> list[str]:
        """Advance the matchers of the requests that committed tokens.

        :param sampled: request id -> the token committed, or the tokens committed in
            order (a verified step commits its accepted drafts, then its sampled token).
        :return: the requests whose grammar these tokens completed (it took the end of
            sequence).
        """
        done: list[str] = []
        if not self._matchers:
            return done
        for rid, committed in sampled.items():
            matcher = self._matchers.get(rid)
            if matcher is None or matcher.is_terminated():
                continue
            tokens = (committed,) if isinstance(committed, (int, np.integer)) else committed
            for token in tokens:
                if matcher.is_terminated():
                    break  # past the end of sequence (ignore_eos): the request ends here
                if not matcher.accept_token(int(token)):
                    # the mask allowed only what the matcher takes: a bug, not a user error
                    logger.error(
                        "request %r: its grammar refused the sampled token %d; it goes on "
                        "unconstrained",
                        rid,
                        token,
                    )
                    self._matchers.pop(rid, None)
                    break
            if rid in self._matchers and matcher.is_terminated():
                done.append(rid)
        return done

    def sweep(self, live: Mapping[str, Request]) -> None:
        """Forget the matchers of requests that finished.

        :param live: the engine's requests by id.
        """
        for rid in [r for r in self._matchers if (q := live.get(r)) is None or q.is_finished]:
            del self._matchers[rid]

    def clear(self) -> None:
        """Forget every matcher (the engine shuts down)."""
        self._matchers.clear()
