"""One generation request: its tokens, its progress and its statistics.

Tokens live in ONE preallocated contiguous ``int32`` buffer of capacity
``prompt + max_tokens``: the prompt occupies the front, generated tokens are
appended behind it. Building a request from an ``int32`` ndarray is a single
memcpy (no per-element conversion); a Python list is converted once, straight
into the buffer. Appending a token, reading the last token and slicing the
tokens of a step are O(1) and never build Python lists, which keeps the
per-step CPU cost of the engine independent of sequence length.

Validation (:class:`~backplane.core.errors.RequestError`) rejects only the
request at hand: an empty prompt, token ids outside ``[0, vocab_size)`` and
``prompt + max_tokens`` beyond the model length are reported with what to do.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from backplane.core.errors import InvalidFieldError

__all__ = [
    "FinishReason",
    "PromptLogprobs",
    "Request",
    "RequestStats",
    "RequestStatus",
    "SamplingLike",
]


class SamplingLike(Protocol):
    """What the scheduler reads from a sampling-parameters object (duck-typed).

    :class:`backplane.engine.sampling.SamplingParams` satisfies it.
    """

    max_tokens: int
    stop_token_ids: Sequence[int]
    ignore_eos: bool


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  #: queued, holds no KV pages
    RUNNING = "running"  #: admitted, holds KV pages (and a state slot if needed)
    PREEMPTED = "preempted"  #: lost its pages under memory pressure; requeued at the front
    FINISHED = "finished"  #: done (see :attr:`Request.finish_reason`); holds nothing

    @property
    def is_finished(self) -> bool:
        """True once the request holds no resources and produces no more tokens."""
        return self is RequestStatus.FINISHED


class FinishReason(str, enum.Enum):
    """Why a request finished."""

    STOP = "stop"  #: a stop token id or the end-of-sequence token was generated
    LENGTH = "length"  #: ``max_tokens`` reached, or the model length
    ABORT = "abort"  #: aborted by the caller
    ERROR = "error"  #: every step it took part in failed (see ``Scheduler.max_step_failures``)


@dataclass
class RequestStats:
    """Per-request KV-cache and timing statistics (accumulated over preemptions).

    Page counts are KV pages; token counts are prompt (or, after a preemption,
    prompt + generated) tokens whose KV came from the given source.

    :param reused_pages: pages found on the device at admission (prefix hits).
    :param reused_tokens: tokens covered by ``reused_pages``.
    :param onboarded_pages: pages found in the host tier and copied back.
    :param onboarded_tokens: tokens covered by ``onboarded_pages``.
    :param new_pages: pages newly allocated for this request (prefill and decode).
    :param missed_pages: full pages looked up in the prefix cache and not found.
    :param missed_tokens: tokens that had to be computed at admission.
    :param num_preemptions: how often the request lost its pages.
    :param num_spec_steps: decode steps that verified speculative draft tokens.
    :param num_draft_tokens: draft tokens verified in those steps.
    :param num_accepted_tokens: draft tokens accepted (each one a token gained).
    """

    reused_pages: int = 0
    reused_tokens: int = 0
    onboarded_pages: int = 0
    onboarded_tokens: int = 0
    new_pages: int = 0
    missed_pages: int = 0
    missed_tokens: int = 0
    num_preemptions: int = 0
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV was not computed (device reuse + host onboarding)."""
        return self.reused_tokens + self.onboarded_tokens


class PromptLogprobs:
    """The prompt logprobs of one request, filled chunk by chunk (``SamplingParams.prompt_logprobs``).

    Row ``p`` holds what the logits at prompt position ``p`` say of prompt token
    ``p + 1``: column 0 that token, then the ``k`` most likely ones. Rows are
    written by position, so a chunk computed again (after a preemption or a
    failed step) writes the same rows; ``done`` counts the leading rows known.

    :param num_prompt: prompt tokens of the request.
    :param k: top logprobs per position.
    """

    __slots__ = ("k", "token_ids", "logprobs", "ranks", "done", "delivered")

    def __init__(self, num_prompt: int, k: int) -> None:
        m = max(num_prompt - 1, 0)
        self.k = k
        self.token_ids = np.zeros((m, 1 + k), dtype=np.int64)
        self.logprobs = np.zeros((m, 1 + k), dtype=np.float32)
        self.ranks = np.zeros(m, dtype=np.int64)
        self.done = 0
        #: the engine handed the finished list out (with the request's first token)
        self.delivered = False

    @property
    def num_positions(self) -> int:
        """Prompt positions with logprobs (every prompt token but the first)."""
        return len(self.ranks)

    @property
    def complete(self) -> bool:
        """Every position is known."""
        return self.done >= len(self.ranks)

    def store(
        self, lo: int, token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray
    ) -> None:
        """Write rows ``lo .. lo + len(ranks)`` (host copies of one step's rows; extra top
        columns, asked for by another request of the step, are dropped).

        :param lo: the first prompt position written.
        :param token_ids: ``[r, >= 1 + k]`` int64.
        :param logprobs: ``[r, >= 1 + k]`` float32.
        :param ranks: ``[r]`` int64 ranks of column 0.
        """
        hi = lo + len(ranks)
        c = 1 + self.k
        self.token_ids[lo:hi] = token_ids[:, :c]
        self.logprobs[lo:hi] = logprobs[:, :c]
        self.ranks[lo:hi] = ranks
        if lo <= self.done:
            self.done = max(self.done, hi)


class Request:
    """A generation request.

    :param request_id: unique id (any hashable string).
    :param prompt_token_ids: the prompt: an ``int32`` ndarray (copied with one
        memcpy), another integer ndarray (converted with one vectorised cast) or
        a sequence of ints (converted once).
    :param sampling_params: object with ``max_tokens``, ``stop_token_ids`` and
        ``ignore_eos`` (e.g. :class:`backplane.engine.sampling.SamplingParams`);
        kept by reference for the sampler.
    :param vocab_size: token ids must be in ``[0, vocab_size)``; ``None`` skips the check.
    :param max_model_len: ``prompt + max_tokens`` must not exceed it; ``None`` skips the check.
    :param eos_token_ids: the model's end-of-sequence ids (ignored with ``ignore_eos``).
    :param arrival_time: ``time.perf_counter()`` value of arrival (default: now).
    :raises RequestError: on an empty prompt, out-of-vocabulary ids or a too long request.
    """

    __slots__ = (
        "request_id",
        "sampling_params",
        "max_tokens",
        "max_model_len",
        "status",
        "finish_reason",
        "stats",
        "num_computed_tokens",
        "_tokens",
        "_num_prompt",
        "_num_tokens",
        "_token_times",
        "_stop_ids",
        "_pending",
        "pending_row",
        "final_pending",
        "kv_state",
        "scheduled_step",
        "user_data",
        "sampling_seed",
        "num_failed_steps",
        "logprobs",
        "prompt_logprobs",
        "spec_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: np.ndarray | Sequence[int],
        sampling_params: SamplingLike,
        *,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        eos_token_ids: Iterable[int] = (),
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        prompt_token_ids = _as_prompt_array(prompt_token_ids)
        n = _prompt_len(request_id, prompt_token_ids)
        if n == 0:
            raise _prompt_error(
                request_id,
                "the prompt is empty; give at least one token "
                "(for text prompts, check that the tokenizer produced tokens)",
            )
        max_tokens = int(sampling_params.max_tokens)
        if max_tokens < 1:
            raise InvalidFieldError(
                f"request {request_id!r}: max_tokens={max_tokens}; ask for at least one token",
                field="max_tokens",
            )
        if max_model_len is not None and n + max_tokens > max_model_len:
            raise InvalidFieldError(
                f"request {request_id!r}: prompt ({n} tokens) + max_tokens ({max_tokens}) = "
                f"{n + max_tokens} exceeds the model length max_model_len={max_model_len}; "
                f"shorten the prompt or lower max_tokens to at most {max(max_model_len - n, 0)}",
                field="max_tokens",
            )
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        # One buffer for prompt + outputs: the prompt is copied in once.
        buf = np.empty(n + max_tokens, dtype=np.int32)
        _fill_prompt(request_id, buf, prompt_token_ids, n)
        # One reduction checks both bounds: negative ids are huge as uint32.
        limit_u = vocab_size if vocab_size is not None else 2**31
        if int(buf[:n].view(np.uint32).max()) >= limit_u:
            lo = int(buf[:n].min())
            hi = int(buf[:n].max())
            if lo < 0 or (vocab_size is not None and hi >= vocab_size):
                bad = lo if lo < 0 else hi
                pos = int(np.argmax(buf[:n] == bad))
                limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise _prompt_error(
                    request_id,
                    f"prompt token id {bad} at position {pos} is outside "
                    f"the vocabulary {limit}; tokenize with this model's tokenizer",
                )
        self._tokens = buf
        self._num_prompt = n
        self._num_tokens = n
        self._token_times = np.zeros(max_tokens, dtype=np.float64)
        stops = set(int(t) for t in sampling_params.stop_token_ids)
        if not sampling_params.ignore_eos:
            stops.update(int(t) for t in eos_token_ids)
        self._stop_ids = frozenset(stops)
        # Asynchronous steps: the last token may be a placeholder for a token still
        # being sampled on the device, in row `pending_row` of its step's output.
        self._pending = False
        self.pending_row = -1
        # the placeholder is the request's last token by length: schedule it no more
        self.final_pending = False
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.stats = RequestStats(
            arrival_time=time.perf_counter() if arrival_time is None else arrival_time
        )
        # Owned by the KV-cache manager while the request holds pages: its RequestKV (Any: the
        # kv_cache package imports this module, so naming the type here would close a circle).
        self.kv_state: Any = None
        # Last scheduler step that scheduled this request (owned by the scheduler).
        self.scheduled_step = -1
        # Free for the layer above (e.g. the executor's per-request state; Any: its own type).
        self.user_data: Any = None
        # The seed of the request's random draws (set by the engine at admission).
        self.sampling_seed = 0
        # Failed steps this request took part in (each one restarted it from its committed tokens).
        self.num_failed_steps = 0
        # one {token_id: Logprob} per committed output token, when the request asks for them
        # (Any: Logprob belongs to the sampling package, which builds on this module)
        self.logprobs: list[Any] | None = (
            [] if getattr(sampling_params, "logprobs", None) is not None else None
        )
        # the prompt's logprobs, when the request asks for them
        k = getattr(sampling_params, "prompt_logprobs", None)
        self.prompt_logprobs: PromptLogprobs | None = (
            None if k is None else PromptLogprobs(n, int(k))
        )
        # draft tokens proposed for the next step (speculative decoding), written after the
        # last token in the buffer; the scheduler verifies them with it or drops them
        self.spec_token_ids: list[int] = []

    # -- tokens -------------------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        """Number of prompt tokens."""
        return self._num_prompt

    @property
    def num_output_tokens(self) -> int:
        """Number of generated tokens so far."""
        return self._num_tokens - self._num_prompt

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return self._num_tokens

    @property
    def capacity(self) -> int:
        """Most tokens this request can ever hold (``prompt + max_tokens``)."""
        return len(self._tokens)

    @property
    def prompt_token_ids(self) -> np.ndarray:
        """The prompt as a read-only ``int32`` view (no copy)."""
        return self._read_only(0, self._num_prompt)

    @property
    def output_token_ids(self) -> np.ndarray:
        """The generated tokens as a read-only ``int32`` view (no copy)."""
        return self._read_only(self._num_prompt, self._num_tokens)

    @property
    def all_token_ids(self) -> np.ndarray:
        """Prompt + generated tokens as a read-only ``int32`` view (no copy)."""
        return self._read_only(0, self._num_tokens)

    def _read_only(self, start: int, stop: int) -> np.ndarray:
        # callers get views of the live buffer; writing through one would corrupt the request
        v = self._tokens[start:stop]
        v.flags.writeable = False
        return v

    @property
    def token_buffer(self) -> np.ndarray:
        """The whole preallocated buffer; only ``[:num_tokens]`` is meaningful.

        Input preparation slices ``token_buffer[start:stop]`` without the
        read-only view the other accessors build.
        """
        return self._tokens

    @property
    def last_token_id(self) -> int:
        """The most recent token (the input of the next decode step)."""
        return int(self._tokens[self._num_tokens - 1])

    @property
    def output_token_times(self) -> np.ndarray:
        """``time.perf_counter()`` value at which each generated token was committed.

        A pending placeholder has no commit time yet, so it is left out: with
        asynchronous scheduling the next token is reserved before the output of
        the current one is read, and a request ended then (a stop string) would
        otherwise show a gap of minus the clock's value.
        """
        return self._token_times[: self._num_tokens - self._num_prompt - int(self._pending)]

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Token ids that finish the request (stop ids, plus EOS unless ``ignore_eos``)."""
        return self._stop_ids

    def append_token(self, token_id: int, now: float | None = None) -> FinishReason | None:
        """Append one generated token (O(1)) and say whether the request is now done.

        Does not change :attr:`status`; the scheduler finishes the request.

        :param token_id: the sampled token.
        :param now: commit time (default ``time.perf_counter()``); the scheduler
            passes one timestamp per step.
        :return: the finish reason if this token ends the request, else ``None``.
        """
        self.append_placeholder()
        return self.resolve_placeholder(token_id, now)

    def append_placeholder(self) -> bool:
        """Reserve the next token's place while its value is still being sampled.

        The placeholder counts as a token (it is the input of the next decode
        step, which reads its value on the device), so the request can be
        scheduled again before the sampled token reaches the host.

        :return: ``True`` when this token is the request's last by length
            (``max_tokens`` or the model length): it must not be scheduled again.
        :raises RuntimeError: a placeholder is already pending, or the buffer is full.
        """
        i = self._num_tokens
        if self._pending:
            raise RuntimeError(
                f"request {self.request_id!r} already has a token being sampled; "
                "resolve it before reserving another"
            )
        if i >= len(self._tokens):
            raise RuntimeError(
                f"request {self.request_id!r} already holds {i} tokens, its capacity; "
                "it should have been finished"
            )
        self._tokens[i] = 0  # any valid id: the device overwrites it before it is read
        self._num_tokens = i + 1
        self._pending = True
        k = i - self._num_prompt
        self.final_pending = k + 1 >= self.max_tokens or (
            self.max_model_len is not None and i + 1 >= self.max_model_len
        )
        return self.final_pending

    def resolve_placeholder(self, token_id: int, now: float | None = None) -> FinishReason | None:
        """Write the sampled value of the pending token and say whether the request is done.

        :param token_id: the sampled token.
        :param now: commit time (default ``time.perf_counter()``).
        :return: the finish reason if this token ends the request, else ``None``.
        :raises RuntimeError: no token is pending.
        """
        if not self._pending:
            raise RuntimeError(f"request {self.request_id!r} has no token being sampled")
        i = self._num_tokens - 1
        self._tokens[i] = token_id
        self._pending = False
        t = time.perf_counter() if now is None else now
        k = i - self._num_prompt
        self._token_times[k] = t
        if k == 0:
            self.stats.first_token_time = t
        self.stats.last_token_time = t
        if token_id in self._stop_ids:
            return FinishReason.STOP
        if self.final_pending:
            return FinishReason.LENGTH
        return None

    def drop_placeholder(self) -> None:
        """Take back the pending token: its step failed, so its value will never come.

        :raises RuntimeError: no token is pending.
        """
        if not self._pending:
            raise RuntimeError(f"request {self.request_id!r} has no token being sampled")
        self._num_tokens -= 1
        self._pending = False
        self.final_pending = False
        self.pending_row = -1

    @property
    def has_pending_token(self) -> bool:
        """The last token is a placeholder whose value is still on the device."""
        return self._pending

    @property
    def pending_source_row(self) -> int:
        """Row of the pending token in its step's sampled tokens, or -1 when none is pending."""
        return self.pending_row if self._pending else -1

    @property
    def skips_prefix_cache(self) -> bool:
        """Take no prefix-cache hits: the request still needs logits of prompt positions
        (``prompt_logprobs``), so its whole prompt is computed (its pages are still
        offered to the prefix cache once computed)."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs.complete

    # -- state ----------------------------------------------------------------------------------

    @property
    def is_finished(self) -> bool:
        """True once the request is finished (stopped, length or aborted)."""
        return self.status is RequestStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not yet in the cache (1 while decoding)."""
        return self._num_tokens - self.num_computed_tokens

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self._num_prompt}, "
            f"output={self.num_output_tokens}/{self.max_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )


def _prompt_error(request_id: str, why: str) -> InvalidFieldError:
    return InvalidFieldError(f"request {request_id!r}: {why}", field="prompt_token_ids")


def _prompt_len(request_id: str, prompt: Any) -> int:
    """Length of a prompt given as an ndarray or a sequence, with a clear error otherwise."""
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1:
            raise _prompt_error(
                request_id,
                f"prompt token ids must be 1-D, got shape {prompt.shape}; "
                "pass one flat array per request",
            )
        if prompt.dtype.kind not in "iu":
            raise _prompt_error(
                request_id,
                f"prompt token ids must be integers, got dtype {prompt.dtype}; "
                "convert with .astype(np.int32)",
            )
        return int(prompt.shape[0])
    if isinstance(prompt, (str, bytes)):
        raise _prompt_error(request_id, "got text where token ids were expected; tokenize first")
    try:
        return len(prompt)
    except TypeError:
        raise _prompt_error(
            request_id,
            "prompt token ids must be a list of ints or an integer array, "
            f"got {type(prompt).__name__}",
        ) from None


def _as_prompt_array(prompt: Any) -> Any:
    """An array-like prompt (a tensor, ``array.array``) as an ndarray; lists stay lists."""
    if isinstance(prompt, (np.ndarray, list, tuple, range, str, bytes, bytearray)):
        return prompt  # text is refused by _prompt_len
    if hasattr(prompt, "__array__") or isinstance(prompt, memoryview):
        return np.asarray(prompt)
    try:  # the buffer protocol (array.array, bytearray is refused by its dtype)
        return np.asarray(memoryview(prompt))
    except TypeError:
        return prompt


def _check_token_types(request_id: str, prompt: Any) -> None:
    """Refuse a sequence holding anything but integers (no silent float or str casts).

    ``set(map(type, ...))`` runs at C speed, so an all-int list costs one pass
    over its items and the per-item check runs only on the few distinct types.
    """
    for t in set(map(type, prompt)):
        if t is int or (issubclass(t, np.integer) and t is not bool):
            continue
        pos, bad = next((i, v) for i, v in enumerate(prompt) if type(v) is t)
        raise _prompt_error(
            request_id,
            f"prompt token id {bad!r} at position {pos} is a {t.__name__}, not an integer; "
            "pass integer token ids from this model's tokenizer",
        )


def _fill_prompt(request_id: str, buf: np.ndarray, prompt: Any, n: int) -> None:
    """Copy the prompt into ``buf[:n]``: memcpy for int32, one vectorised cast otherwise."""
    if isinstance(prompt, np.ndarray):
        if prompt.dtype != np.int32:
            info = np.iinfo(np.int32)
            if n and (int(prompt.min()) < info.min or int(prompt.max()) > info.max):
                raise _prompt_error(
                    request_id,
                    "prompt token ids do not fit in int32; tokenize with this model's tokenizer",
                )
        buf[:n] = prompt  # int32: one memcpy; other ints: one vectorised cast
        return
    _check_token_types(request_id, prompt)
    try:
        buf[:n] = prompt  # one pass of the list straight into the buffer
    except (OverflowError, ValueError, TypeError) as e:
        raise _prompt_error(
            request_id,
            f"prompt token ids must be integers in the vocabulary ({e}); "
            "tokenize with this model's tokenizer",
        ) from None
