"""What the scheduler hands to the rest of the engine: one step's sequences, typed.

The order of :attr:`SchedulerOutput.scheduled` is what input preparation relies
on (see :mod:`backplane.core.metadata`): prefill/extend sequences first, decode
sequences last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backplane.engine.request import Request

__all__ = ["ScheduledSeq", "SchedulerOutput"]


class ScheduledSeq:
    """One sequence of a step.

    :param request: the request.
    :param num_new_tokens: tokens computed this step (``token_buffer[num_cached_tokens:
        num_cached_tokens + num_new_tokens]``).
    :param num_cached_tokens: context already in the KV cache before this step.
    :param page_ids: ``int32`` page table holding ``num_cached_tokens + num_new_tokens``
        tokens (a view of the manager's table; valid until the next ``schedule``).
    :param state_slot: recurrent-state slot (0 when the model has no recurrent layers).
    :param is_prefill_chunk_final: the step computes the request's last uncomputed
        token, so a token is sampled from it.
    :param num_draft_tokens: speculative draft tokens computed after that last token
        (``request.spec_token_ids``), verified from the step's logits at each of the
        ``num_draft_tokens + 1`` positions.
    """

    __slots__ = (
        "request",
        "num_new_tokens",
        "num_cached_tokens",
        "page_ids",
        "state_slot",
        "is_prefill_chunk_final",
        "num_draft_tokens",
    )

    def __init__(
        self,
        request: Request,
        num_new_tokens: int,
        num_cached_tokens: int,
        page_ids: np.ndarray,
        state_slot: int,
        is_prefill_chunk_final: bool,
        num_draft_tokens: int = 0,
    ) -> None:
        self.request = request
        self.num_new_tokens = num_new_tokens
        self.num_cached_tokens = num_cached_tokens
        self.page_ids = page_ids
        self.state_slot = state_slot
        self.is_prefill_chunk_final = is_prefill_chunk_final
        self.num_draft_tokens = num_draft_tokens

    @property
    def is_decode(self) -> bool:
        """One new token on top of cached context (the metadata's decode definition)."""
        return self.num_new_tokens == 1 and self.num_cached_tokens > 0

    def __repr__(self) -> str:
        return (
            f"ScheduledSeq({self.request.request_id!r}, new={self.num_new_tokens}, "
            f"cached={self.num_cached_tokens}, pages={len(self.page_ids)}, "
            f"slot={self.state_slot}, final={self.is_prefill_chunk_final})"
        )


@dataclass
class SchedulerOutput:
    """What one step runs.

    :param scheduled: the sequences, prefill/extend first, decode last.
    :param num_prefill_seqs: how many leading entries of ``scheduled`` are prefill/extend.
    :param num_scheduled_tokens: total new tokens (never above ``max_num_tokens``).
    :param preempted: requests that lost their pages in this step (requeued).
    :param finished: requests that finished (in :meth:`Scheduler.update` or by
        :meth:`Scheduler.abort`) since the previous ``schedule`` or
        :meth:`Scheduler.pop_finished` call; each finished request is reported
        exactly once, here or by ``pop_finished``.
    :param state_saves: recurrent-state copies ``(live slot, snapshot slot)`` to
        issue before this step's forward, keeping states of cached prefixes.
    :param state_restores: recurrent-state copies ``(snapshot slot, live slot)`` to
        issue after the saves: admitted requests starting from a cached prefix.
    """

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_prefill_seqs: int = 0
    num_scheduled_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    state_restores: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_decode_seqs(self) -> int:
        """How many trailing entries of ``scheduled`` are decodes."""
        return len(self.scheduled) - self.num_prefill_seqs

    @property
    def is_empty(self) -> bool:
        """Nothing to run this step."""
        return not self.scheduled
