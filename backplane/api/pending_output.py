"""A running request's stream output, built by the stream's reader: :class:`PendingOutput`.

The engine loop hands each running request's output of a step over unbuilt, as what
the :class:`RequestOutput` shows at that step; the stream's reader builds it on its
own thread, and one that fell behind takes what piled up as one output
(:func:`coalesced`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from backplane.api.outputs import (
    Logprob,
    MetricsSnapshot,
    RequestOutput,
    streamed_completion,
    streamed_output,
)

__all__ = ["PendingOutput", "coalesced"]


class PendingOutput:
    """A running request's incremental output as of one step, built when its reader takes it.

    It holds what the output shows (counts into the request's append-only token
    and logprob lists, the text as of that step and the span of it that is new,
    the metrics snapshot), so :meth:`build` gives, on any thread and at any later
    time, the :class:`RequestOutput` that
    :meth:`~backplane.api.output_processor.OutputProcessor.update` would have built at
    that step.

    :param tracked: the request.
    :param start: its first token not handed out before this output.
    :param end: its tokens as of this output.
    :param num_logprobs: its logprob entries as of this output (``None`` when not asked for).
    :param text: its text as of this output.
    :param sent: the first character of ``text`` not handed out before.
    :param visible: the end of the text handed out with this output.
    :param prompt_logprobs: its prompt logprobs as of this output.
    :param metrics: its metrics snapshot (see ``output_processor._metrics``).
    """

    __slots__ = (
        "tracked",
        "start",
        "end",
        "num_logprobs",
        "text",
        "sent",
        "visible",
        "prompt_logprobs",
        "metrics",
    )

    #: a pending output is always one of a running request (finished ones are built at once)
    finished = False

    def __init__(
        self,
        tracked: Any,  # its TrackedRequest (output_processor imports this module)
        start: int,
        end: int,
        num_logprobs: int | None,
        text: str,
        sent: int,
        visible: int,
        prompt_logprobs: list[dict[int, Logprob] | None] | None,
        metrics: MetricsSnapshot,
    ) -> None:
        self.tracked = tracked
        self.start = start
        self.end = end
        self.num_logprobs = num_logprobs
        self.text = text
        self.sent = sent
        self.visible = visible
        self.prompt_logprobs = prompt_logprobs
        self.metrics = metrics

    @property
    def request_id(self) -> str:
        """The id the output carries."""
        return self.tracked.public_id

    def build(self) -> RequestOutput:
        """Build the output.

        :return: the :class:`RequestOutput` of the request as of the step it was made at.
        """
        t = self.tracked
        text = self.text
        # a running request has neither finish reason nor stop reason yet
        completion = streamed_completion(
            t.index,
            text,
            t.token_ids,
            t.logprobs,
            None,
            None,
            num_tokens=self.end,
            num_logprobs=self.num_logprobs,
        )
        return streamed_output(
            t.public_id,
            t.prompt_text,
            t.prompt,
            completion,
            self.prompt_logprobs,
            t.token_ids[self.start : self.end],
            text[self.sent : self.visible],
            self.metrics,
        )

    def delta(self) -> tuple[list[int], str]:
        """The tokens and text this output adds, without building it.

        :return: its ``new_token_ids`` and ``new_text``.
        """
        return self.tracked.token_ids[self.start : self.end], self.text[self.sent : self.visible]


def coalesced(outs: Sequence[RequestOutput | PendingOutput]) -> RequestOutput | PendingOutput:
    """One output in place of consecutive incremental outputs of one request.

    A stream whose reader falls behind the engine hands out what piled up as one
    output: the last of them, whose ``new_token_ids`` and ``new_text`` also hold
    what the earlier ones added. Everything else an output shows is as of its
    step, so the last one's is the latest; the deltas a reader concatenates are
    the same however the outputs were grouped. Running outputs not built yet
    stay unbuilt (:class:`PendingOutput`): only the one handed out is built.

    :param outs: outputs of one sample of one request in the order they were made,
        none finished but the last one (at least one output).
    :return: the last output, its deltas covering every one of ``outs``.
    """
    last = outs[-1]
    if len(outs) == 1:
        return last
    if all(type(o) is PendingOutput for o in outs):
        first = outs[0]
        assert isinstance(first, PendingOutput) and isinstance(last, PendingOutput)
        return PendingOutput(
            last.tracked,
            first.start,
            last.end,
            last.num_logprobs,
            last.text,
            first.sent,
            last.visible,
            last.prompt_logprobs,
            last.metrics,
        )
    tokens: list[int] = []
    texts: list[str] = []
    for o in outs[:-1]:
        if type(o) is PendingOutput:
            ids, text = o.delta()
        else:
            ids, text = o.new_token_ids, o.new_text
        tokens += ids
        texts.append(text)
    # a copy: a finished output is also what finished-request callbacks were given
    out = last.build() if type(last) is PendingOutput else copy.copy(last)
    tokens += out.new_token_ids
    texts.append(out.new_text)
    out.new_token_ids = tokens
    out.new_text = "".join(texts)
    return out
