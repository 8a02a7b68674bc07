"""The Python API: :class:`LLM` for offline and streaming generation.

Example::

    from backplane import LLM, SamplingParams

    llm = LLM("tiny-llama", max_num_seqs=8)
    for out in llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=8, temperature=0)):
        print(out.token_ids, out.text, out.finish_reason, out.metrics.time_to_first_token)

    for delta in llm.stream("Hello", SamplingParams(max_tokens=8)):
        print(delta.new_text, end="", flush=True)

    chat = LLM("smollm2")
    print(chat.chat([{"role": "user", "content": "Hi!"}], SamplingParams(temperature=0))[0].text)

The engine is driven by whoever calls :meth:`LLM.generate`, :meth:`LLM.stream`
or :meth:`LLM.step`, on one thread; several streams may be interleaved (each
step's tokens are routed to the stream that owns the request).
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backplane.core.errors import RequestError
from backplane.engine.sampling import SamplingParams, as_params_list

logger = logging.getLogger(__name__)

__all__ = ["LLM", "Prompt", "RequestMetrics", "RequestOutput"]

#: A prompt: text (needs the model's tokenizer), a list of token ids or an int32 array.
Prompt = str | Sequence[int] | np.ndarray

#: A conversation: ``[{"role": "user", "content": "..."}, ...]``.
Conversation = Sequence[Mapping[str, Any]]


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
    """

    arrival_time: float
    time_to_first_token: float | None
    inter_token_latencies: list[float]
    prompt_tokens_reused: int
    num_preemptions: int = 0
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request, complete or (while streaming) so far.

    :param request_id: the request's id.
    :param prompt_token_ids: the prompt.
    :param token_ids: every generated token so far.
    :param text: ``token_ids`` decoded (empty without a tokenizer).
    :param finished: whether generation is over.
    :param finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` once finished.
    :param new_token_ids: tokens added since the previous output of this request
        (streaming); equals ``token_ids`` in :meth:`LLM.generate` results.
    :param new_text: text added since the previous output of this request.
    :param metrics: timing and cache statistics.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    metrics: RequestMetrics | None = None


class _Tracked:
    """The API's view of one live request, with incremental detokenization state.

    Text is produced from a sliding window of tokens, so each step decodes a
    few tokens rather than the whole output: ``decode(ids[prefix:read])`` is
    the text already emitted for that window, ``decode(ids[prefix:])`` the
    window with the new tokens; the difference is new text, held back while it
    ends in an incomplete character (U+FFFD).
    """

    __slots__ = (
        "request",
        "prompt",
        "text",
        "token_ids",
        "emitted",
        "finished",
        "reason",
        "prefix_offset",
        "read_offset",
    )

    def __init__(self, request: Any, prompt: list[int]) -> None:
        self.request = request
        self.prompt = prompt
        self.text = ""
        self.token_ids: list[int] = []
        self.emitted = 0
        self.finished = False
        self.reason: str | None = None
        self.prefix_offset = 0
        self.read_offset = 0


class LLM:
    """Load a model and generate from it.

    :param model: a local model directory (HF ``config.json`` + safetensors) or
        a preset name such as ``tiny-llama``.
    :param config: an ``EngineConfig`` to start from (optional).
    :param overrides: ``EngineConfig`` fields (``max_num_seqs=8``,
        ``kv_memory="256MiB"``, ``backends={"attention": "torch"}``...).
    :raises ConfigError: on an invalid configuration.
    """

    def __init__(self, model: str | None = None, *, config: Any = None, **overrides: Any) -> None:
        from backplane.engine.config import EngineConfig
        from backplane.engine.executor import Engine

        if model is not None:
            overrides["model"] = model
        if config is None:
            config = EngineConfig.from_dict(overrides)
        elif overrides:
            config = config.merge(**overrides)
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer
        self._tracked: dict[str, _Tracked] = {}
        self._ready: dict[str, deque[RequestOutput]] = {}

    # -- requests -------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Tokenize ``text`` with the model's tokenizer.

        :raises RequestError: when the model has no tokenizer.
        """
        if self.tokenizer is None:
            raise RequestError(
                "this model has no tokenizer, so text prompts cannot be used; "
                "pass token ids (a list of ints or an int32 array) instead"
            )
        enc = self.tokenizer.encode(text)
        return list(getattr(enc, "ids", enc))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Detokenize (empty string without a tokenizer)."""
        if self.tokenizer is None or len(token_ids) == 0:
            return ""
        try:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        except TypeError:
            return self.tokenizer.decode(list(token_ids))

    def add_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue one request; drive it with :meth:`step`, :meth:`generate` or :meth:`stream`.

        :param prompt: text, a list of token ids or an int32 array.
        :param sampling_params: defaults to :meth:`default_sampling_params`.
        :param request_id: a unique id (default: generated).
        :return: the request id.
        :raises RequestError: the request is invalid (nothing is queued).
        """
        ids = self.encode(prompt) if isinstance(prompt, str) else prompt
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        rid = self.engine.add_request(ids, sampling_params, request_id)
        req = self.engine.get_request(rid)
        self._tracked[rid] = _Tracked(req, req.prompt_token_ids.tolist())
        return rid

    def abort(self, request_id: str) -> bool:
        """Abort a request: its pages and state slot are freed at once; its
        stream ends with ``finish_reason == "abort"``.

        :return: ``True`` if the request was still running.
        """
        return self.engine.abort_request(request_id)

    # -- driving the engine --------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step and return an incremental output per request that
        got a token or finished (requests added with :meth:`add_request`)."""
        outs = []
        for so in self.engine.step():
            t = self._tracked.get(so.request_id)
            if t is None:
                continue
            t.token_ids.extend(so.new_token_ids)
            if so.finished:
                t.finished = True
                t.reason = so.finish_reason
            out = self._output(t, incremental=True)
            if t.finished:
                self._tracked.pop(so.request_id, None)
            queue = self._ready.get(so.request_id)
            if queue is not None:
                queue.append(out)
            outs.append(out)
        return outs

    def _output(self, t: _Tracked, *, incremental: bool) -> RequestOutput:
        new_ids = t.token_ids[t.emitted :] if incremental else list(t.token_ids)
        t.emitted = len(t.token_ids)
        before = t.text
        if t.finished:
            t.text = self.decode(t.token_ids)  # the exact final text
        elif self.tokenizer is not None and len(t.token_ids) > t.read_offset:
            ids = t.token_ids
            old = self.decode(ids[t.prefix_offset : t.read_offset])
            new = self.decode(ids[t.prefix_offset :])
            if len(new) > len(old) and not new.endswith("\ufffd"):
                t.text += new[len(old) :]
                t.prefix_offset = t.read_offset
                t.read_offset = len(ids)
        return RequestOutput(
            request_id=t.request.request_id,
            prompt_token_ids=t.prompt,
            token_ids=list(t.token_ids),
            text=t.text,
            finished=t.finished,
            finish_reason=t.reason,
            new_token_ids=new_ids,
            new_text=t.text[len(before) :] if incremental else t.text,
            metrics=_metrics(t.request),
        )

    def _add_all(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: Any, ids: Sequence[str] | None
    ) -> list[str]:
        plist = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = as_params_list(sampling_params, len(plist))
        if ids is not None and len(ids) != len(plist):
            raise RequestError(f"got {len(ids)} request ids for {len(plist)} prompts")
        added: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(plist, params, strict=True)):
                try:
                    rid = self.add_request(p, sp, None if ids is None else ids[i])
                    self._ready[rid] = deque()  # this call consumes the request's outputs
                    added.append(rid)
                except RequestError as exc:
                    raise RequestError(f"prompt {i}: {exc}") from None
        except BaseException:
            for rid in added:  # all or nothing: drop what this call queued
                self.abort(rid)
                self._tracked.pop(rid, None)
                self._ready.pop(rid, None)
            raise
        return added

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt and return the finished outputs, in prompt order.

        :param prompts: one prompt or a list of prompts (text, token-id lists or
            int32 arrays).
        :param sampling_params: one set for all prompts or one per prompt;
            ``None``: :meth:`default_sampling_params`.
        :param request_ids: optional unique ids, one per prompt.
        :return: one :class:`RequestOutput` per prompt.
        :raises RequestError: a prompt is invalid (then none of them is run).
        """
        rids = self._add_all(prompts, sampling_params, request_ids)
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(rids):
                self._drain(rids, final)
                if len(final) < len(rids):
                    self.step()
        finally:
            for rid in rids:
                if rid not in final:
                    self.abort(rid)
                self._ready.pop(rid, None)
        results = []
        for rid in rids:
            out = final[rid]
            out.new_token_ids = list(out.token_ids)
            out.new_text = out.text
            results.append(out)
        return results

    def _drain(self, rids: Iterable[str], final: dict[str, RequestOutput]) -> None:
        for rid in rids:
            q = self._ready.get(rid)
            while q:
                out = q.popleft()
                if out.finished:
                    final[rid] = out

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
    ) -> Iterator[RequestOutput]:
        """Generate and yield incremental outputs as tokens are produced.

        Each yielded :class:`RequestOutput` carries the tokens (``new_token_ids``)
        and text (``new_text``) added since that request's previous output, and
        the totals so far. Requests are queued when this is called; closing the
        iterator early aborts the ones still running.

        :param prompts: one prompt or a list of prompts.
        :param sampling_params: one set for all prompts or one per prompt.
        :param request_ids: optional unique ids, one per prompt.
        :return: an iterator of incremental outputs (the last one per request has
            ``finished=True``).
        """
        rids = self._add_all(prompts, sampling_params, request_ids)
        return self._stream(rids)

    def _stream(self, rids: list[str]) -> Iterator[RequestOutput]:
        live = set(rids)
        try:
            while live:
                for rid in rids:
                    q = self._ready.get(rid)
                    while q:
                        out = q.popleft()
                        if out.finished:
                            live.discard(rid)
                        yield out
                if live:
                    self.step()
        finally:
            for rid in rids:
                if rid in live:
                    self.abort(rid)
                    self._tracked.pop(rid, None)
                self._ready.pop(rid, None)

    # -- chat -----------------------------------------------------------------------------

    def default_sampling_params(self, **fields: Any) -> SamplingParams:
        """Sampling parameters from the checkpoint's defaults (``generation_config.json``:
        greedy unless it samples, its temperature / top-k / top-p / min-p and
        ``max_new_tokens``), overridden by ``fields``.

        :param fields: ``SamplingParams`` fields to set explicitly.
        :return: the parameters ``generate``, ``stream`` and ``chat`` use when given none.
        :raises RequestError: an invalid value.
        """
        defaults = dict(getattr(self.engine.model, "generation_defaults", None) or {})
        return SamplingParams(**{**defaults, **fields})

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        request_ids: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Answer conversations: each is rendered with the model's chat template and generated from.

        Generation also stops at the tokenizer's end-of-sequence token (the
        template's end of turn, e.g. ``<|im_end|>``), as well as at the model's
        end-of-sequence ids, unless ``ignore_eos`` is set.

        :param messages: one conversation (a list of ``{"role", "content"}``
            dicts) or a list of conversations.
        :param sampling_params: one set for all or one per conversation;
            ``None``: :meth:`default_sampling_params`.
        :param add_generation_prompt: end each prompt with an open assistant turn.
        :param chat_template_kwargs: further template variables (``enable_thinking``...).
        :param request_ids: optional unique ids, one per conversation.
        :return: one :class:`RequestOutput` per conversation, as :meth:`generate`.
        :raises RequestError: no tokenizer or chat template, malformed messages,
            or a template that refuses them.
        """
        conversations = _as_conversations(messages)
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer, so it cannot render a chat")
        prompts = [
            self.tokenizer.encode_chat(
                c, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
            )
            for c in conversations
        ]
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = as_params_list(sampling_params, len(prompts))
        end_of_turn = self.tokenizer.token_id("eos_token")
        if end_of_turn is not None:
            params = [
                sp
                if sp.ignore_eos or end_of_turn in sp.stop_token_ids
                else dataclasses.replace(sp, stop_token_ids=(*sp.stop_token_ids, end_of_turn))
                for sp in params
            ]
        return self.generate(prompts, params, request_ids=request_ids)

    @property
    def num_unfinished_requests(self) -> int:
        """Requests queued or running in the engine."""
        return self.engine.num_unfinished_requests


def _as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt or a list of prompts -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        if prompts.ndim == 1:
            return [prompts]
        if prompts.ndim == 2:
            return list(prompts)
        raise RequestError(f"a token-id array prompt must be 1-D, got shape {prompts.shape}")
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise RequestError("no prompts given")
        if isinstance(prompts[0], numbers.Integral):
            return [prompts]  # one prompt of token ids
        return list(prompts)
    raise RequestError(
        f"prompts must be a string, a list of token ids, an int32 array or a list of those; "
        f"got {type(prompts).__name__}"
    )


def _as_conversations(messages: Any) -> list[Any]:
    """One conversation or a list of conversations -> a list of conversations."""
    if isinstance(messages, (list, tuple)) and messages:
        if all(isinstance(m, Mapping) for m in messages):
            return [messages]
        if all(isinstance(c, (list, tuple)) for c in messages):
            return list(messages)
    raise RequestError(
        'chat() takes a conversation (a non-empty list of {"role": ..., "content": ...} dicts) '
        f"or a list of conversations; got {type(messages).__name__}"
    )


def _metrics(req: Any) -> RequestMetrics:
    st = req.stats
    times = req.output_token_times
    return RequestMetrics(
        arrival_time=st.arrival_time,
        time_to_first_token=None
        if st.first_token_time is None
        else st.first_token_time - st.arrival_time,
        inter_token_latencies=np.diff(times).tolist() if len(times) > 1 else [],
        prompt_tokens_reused=int(st.cached_tokens),
        num_preemptions=int(st.num_preemptions),
        finished_time=st.finished_time,
    )
