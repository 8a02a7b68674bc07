"""What generation returns: :class:`RequestOutput` with one :class:`CompletionOutput` per sample.

The shape follows vLLM's, so code written for it reads the same fields
(``out.outputs[0].text``, ``out.prompt_token_ids``, ``finish_reason``,
``stop_reason``). The fields backplane had before (``out.text``,
``out.token_ids``, ``out.finish_reason``) stay readable as properties of the
first completion.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from backplane.engine.sampling import Logprob

__all__ = [
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "MetricsSnapshot",
    "RequestOutput",
    "defer_metrics",
    "metrics_from",
    "streamed_completion",
    "streamed_output",
]


@dataclass
class RequestMetrics:
    """Timing and cache statistics of one request (seconds, ``time.perf_counter`` clock).

    :param arrival_time: when the request was added.
    :param time_to_first_token: first token time minus arrival (``None`` before it).
    :param inter_token_latencies: gaps between consecutive generated tokens.
    :param prompt_tokens_reused: prompt tokens whose KV came from the prefix
        cache (device or host tier) instead of being computed (summed over
        re-admissions after preemption).
    :param num_preemptions: how often the request lost its KV pages.
    :param finished_time: when it finished (``None`` while running).
    :param spec_verify_steps: speculative decoding: steps that verified draft tokens.
    :param spec_draft_tokens: draft tokens verified in them.
    :param spec_accepted_tokens: draft tokens accepted.
    """

    arrival_time: float
    time_to_first_token: float | None
    inter_token_latencies: list[float]
    prompt_tokens_reused: int
    num_preemptions: int = 0
    finished_time: float | None = None
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted over verified draft tokens (``None`` when no draft was verified)."""
        if not self.spec_draft_tokens:
            return None
        return self.spec_accepted_tokens / self.spec_draft_tokens

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens committed per verifying step: accepted drafts plus the verified token
        (``None`` when no step verified drafts)."""
        if not self.spec_verify_steps:
            return None
        return 1.0 + self.spec_accepted_tokens / self.spec_verify_steps


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    :param index: the sequence's index among the request's samples.
    :param text: the generated text so far (empty without a tokenizer).
    :param token_ids: every generated token so far.
    :param logprobs: per generated token, ``{token_id: Logprob(logprob, rank,
        decoded_token)}`` of the sampled token and the ``SamplingParams.logprobs``
        most likely ones (raw model distribution), when asked for; ``None`` otherwise.
    :param finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` once finished,
        ``None`` while running.
    :param stop_reason: what stopped a ``"stop"`` finish: the stop token id
        (one of ``SamplingParams.stop_token_ids``), or ``None`` for the model's
        end-of-sequence token, a length finish or a running sequence.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """True once this sequence is complete."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request, complete or (while streaming) so far.

    :param request_id: the request's id.
    :param prompt: the prompt text (the rendered conversation for chat), or
        ``None`` when the prompt was given as token ids.
    :param prompt_token_ids: the prompt's tokens.
    :param outputs: the generated sequences (one per sample).
    :param finished: whether generation is over.
    :param prompt_logprobs: with ``SamplingParams.prompt_logprobs=k``: ``None`` for the
        first prompt token, then per prompt token ``{token_id: Logprob(logprob, rank,
        decoded_token)}`` of that token (its logprob given the tokens before it) and the
        ``k`` most likely tokens at its position (raw model distribution); set from the
        output that brings the first generated token on. ``None`` when not asked for.
    :param new_token_ids: tokens of ``outputs[0]`` added since this request's
        previous output (streaming); equals ``token_ids`` in :meth:`LLM.generate` results.
    :param new_text: text of ``outputs[0]`` added since the previous output.
    :param metrics: timing and cache statistics.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    metrics: RequestMetrics | None = None

    # The fields of the single-sequence output backplane returned before (kept for callers).

    @property
    def text(self) -> str:
        """``outputs[0].text``."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        """``outputs[0].token_ids``."""
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        """``outputs[0].finish_reason``."""
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        """``outputs[0].stop_reason``."""
        return self.outputs[0].stop_reason

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the output (metrics flattened to their fields)."""
        return {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "prompt_token_ids": list(self.prompt_token_ids),
            "outputs": [_completion_dict(o) for o in self.outputs],
            "finished": self.finished,
            "prompt_logprobs": _logprob_dicts(self.prompt_logprobs),
            "metrics": None if self.metrics is None else vars(self.metrics).copy(),
        }


def _logprob_dicts(
    positions: list[dict[int, Logprob] | None] | None,
) -> list[dict[int, dict[str, Any]] | None] | None:
    """Logprob objects as dicts (token-id keys become strings in JSON)."""
    if positions is None:
        return None
    return [
        None if pos is None else {t: vars(lp).copy() for t, lp in pos.items()} for pos in positions
    ]


def _completion_dict(o: CompletionOutput) -> dict[str, Any]:
    # by field, not vars(): a streamed output may not have copied its lists yet
    d = {f.name: getattr(o, f.name) for f in fields(o)}
    d["logprobs"] = _logprob_dicts(o.logprobs)
    return d


class _Deferred:
    """A dataclass field whose value a streamed output may build on its first read.

    A running request's stream gets an output every step, and most consumers read
    only its new tokens and text: copying the request's growing lists (tokens,
    logprobs, inter-token gaps) for every output would cost O(output) per request
    per step. Such an output stores what the copy needs instead (the append-only
    source list and its length at that step, under ``_pending_<name>``), and the
    copy is made when the field is first read, equal to the one made at once.

    :param name: the field's name.
    :param build: makes the field's value from the stored pending value.
    :param default: the field's value when neither it nor a pending value is set.
    """

    def __init__(self, name: str, build: Callable[[Any], Any], default: Any) -> None:
        self.name = name
        self.pending = "_pending_" + name
        self.build = build
        self.default = default

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self.default
        d = obj.__dict__
        try:
            return d[self.name]
        except KeyError:
            pass
        pending = d.get(self.pending)
        if pending is None:
            return self.default
        # setdefault: a read from another thread at the same time keeps one value
        value = d.setdefault(self.name, self.build(pending))
        d.pop(self.pending, None)
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        d = obj.__dict__
        d[self.name] = value
        d.pop(self.pending, None)


def _prefix(pending: tuple[list[Any], int]) -> list[Any]:
    """A copy of the first ``n`` items of an append-only list, from ``(list, n)``."""
    items, n = pending
    return items[:n]


#: a request's metrics as of one output: the :class:`RequestMetrics` fields but
#: ``inter_token_latencies`` in field order, the request's append-only list of gaps,
#: and how many of them were its gaps then
MetricsSnapshot = tuple[tuple[Any, ...], list[float], int]


def metrics_from(snapshot: MetricsSnapshot) -> RequestMetrics:
    """Build :class:`RequestMetrics` (with a list of gaps of their own) from a snapshot.

    :param snapshot: see :data:`MetricsSnapshot`.
    :return: the metrics.
    """
    (arrival, ttft, reused, preemptions, finished, verify, drafts, accepted), gaps, n = snapshot
    return RequestMetrics(
        arrival_time=arrival,
        time_to_first_token=ttft,
        inter_token_latencies=gaps[:n],
        prompt_tokens_reused=reused,
        num_preemptions=preemptions,
        finished_time=finished,
        spec_verify_steps=verify,
        spec_draft_tokens=drafts,
        spec_accepted_tokens=accepted,
    )


CompletionOutput.token_ids = _Deferred("token_ids", _prefix, None)  # type: ignore[assignment]
CompletionOutput.logprobs = _Deferred("logprobs", _prefix, None)  # type: ignore[assignment]
RequestOutput.metrics = _Deferred("metrics", metrics_from, None)  # type: ignore[assignment]


def streamed_completion(
    index: int,
    text: str,
    token_ids: list[int],
    logprobs: list[dict[int, Logprob]] | None,
    finish_reason: str | None,
    stop_reason: int | str | None,
    num_tokens: int | None = None,
    num_logprobs: int | None = None,
) -> CompletionOutput:
    """A :class:`CompletionOutput` whose token and logprob lists are copied on first read.

    :param index: the sequence's index among the request's samples.
    :param text: the generated text so far.
    :param token_ids: the request's token list; it may grow later, never change
        its first items (the output shows its first ``num_tokens`` items).
    :param logprobs: the request's logprob list (same rule), or ``None``.
    :param finish_reason: as in :class:`CompletionOutput`.
    :param stop_reason: as in :class:`CompletionOutput`.
    :param num_tokens: how many of ``token_ids`` the output shows (default: all, as of now).
    :param num_logprobs: how many of ``logprobs`` it shows (default: all, as of now).
    :return: the output.
    """
    out = CompletionOutput.__new__(CompletionOutput)
    d = out.__dict__
    d["index"] = index
    d["text"] = text
    d["_pending_token_ids"] = (token_ids, len(token_ids) if num_tokens is None else num_tokens)
    if logprobs is None:
        d["logprobs"] = None
    else:
        d["_pending_logprobs"] = (
            logprobs,
            len(logprobs) if num_logprobs is None else num_logprobs,
        )
    d["finish_reason"] = finish_reason
    d["stop_reason"] = stop_reason
    return out


def defer_metrics(out: RequestOutput, snapshot: MetricsSnapshot) -> RequestOutput:
    """Give ``out`` metrics that are built from ``snapshot`` on their first read.

    :param out: the output.
    :param snapshot: see :data:`MetricsSnapshot`; its list of gaps may grow or be
        replaced later, never change its first items.
    :return: ``out``.
    """
    d = out.__dict__
    d.pop("metrics", None)
    d["_pending_metrics"] = snapshot
    return out


def streamed_output(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: list[int],
    completion: CompletionOutput,
    prompt_logprobs: list[dict[int, Logprob] | None] | None,
    new_token_ids: list[int],
    new_text: str,
    metrics: MetricsSnapshot,
) -> RequestOutput:
    """A running request's :class:`RequestOutput`, its metrics built on their first read.

    The output ``defer_metrics(RequestOutput(..., finished=False, ...), metrics)``
    gives, made without the dataclass's constructor: a stream gets one every step.

    :param request_id: as in :class:`RequestOutput`.
    :param prompt: as in :class:`RequestOutput`.
    :param prompt_token_ids: as in :class:`RequestOutput`.
    :param completion: its one sequence (see :func:`streamed_completion`).
    :param prompt_logprobs: as in :class:`RequestOutput`.
    :param new_token_ids: as in :class:`RequestOutput`.
    :param new_text: as in :class:`RequestOutput`.
    :param metrics: see :data:`MetricsSnapshot` and :func:`defer_metrics`.
    :return: the output.
    """
    out = RequestOutput.__new__(RequestOutput)
    out.__dict__ = {
        "request_id": request_id,
        "prompt": prompt,
        "prompt_token_ids": prompt_token_ids,
        "outputs": [completion],
        "finished": False,
        "prompt_logprobs": prompt_logprobs,
        "new_token_ids": new_token_ids,
        "new_text": new_text,
        "_pending_metrics": metrics,
    }
    return out
