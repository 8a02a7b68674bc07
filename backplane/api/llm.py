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
import itertools
import logging
import numbers
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from backplane.api.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from backplane.core.errors import BackplaneError, RequestError
from backplane.engine.sampling import SamplingParams, as_params_list

logger = logging.getLogger(__name__)

__all__ = [
    "LLM",
    "ConcurrentUseError",
    "Prompt",
    "RequestMetrics",
    "RequestOutput",
    "split_samples",
]

#: A prompt: text (needs the model's tokenizer), a list of token ids or an int32 array.
Prompt = str | Sequence[int] | np.ndarray

#: A conversation: ``[{"role": "user", "content": "..."}, ...]``.
Conversation = Sequence[Mapping[str, Any]]


class ConcurrentUseError(BackplaneError, RuntimeError):
    """Two threads used one :class:`LLM` at the same time.

    :class:`LLM` is driven by one thread at a time (calls from different
    threads one after the other are fine). To serve many callers at once, use
    :class:`~backplane.api.async_llm.AsyncLLM`, whose one loop drives the
    engine for every coroutine and thread.
    """


class _ThreadGuard:
    """Lets one thread at a time into the engine; re-entrant for that thread.

    A second thread is refused with :class:`ConcurrentUseError` instead of
    waiting: two callers interleaving steps would each consume the other's
    outputs, so queueing them silently would still be wrong for streams.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0

    @contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        if not self._lock.acquire(blocking=False):
            raise ConcurrentUseError(
                f"LLM.{what} was called from thread {threading.current_thread().name!r} while "
                "another thread is using this LLM; an LLM serves one thread at a time. Use one "
                "LLM per thread, serialise the calls with a lock, or use "
                "backplane.api.AsyncLLM, which serves any number of threads and coroutines"
            )
        self._owner, self._depth = me, 1
        try:
            yield
        finally:
            self._owner, self._depth = None, 0
            self._lock.release()


class _Tracked:
    """The API's view of one live request, with incremental detokenization state.

    Text is produced from a sliding window of tokens, so each step decodes a
    few tokens rather than the whole output: ``decode(ids[prefix:read])`` is
    the text already emitted for that window, ``decode(ids[prefix:])`` the
    window with the new tokens; the difference is new text, held back while it
    ends in an incomplete character (U+FFFD). With stop strings, the end of the
    text that could still become one is held back too (``sent`` counts the
    characters handed out so far).
    """

    __slots__ = (
        "request",
        "prompt",
        "prompt_text",
        "public_id",
        "index",
        "text",
        "token_ids",
        "emitted",
        "sent",
        "finished",
        "reason",
        "prefix_offset",
        "read_offset",
        "stops",
        "include_stop",
        "stop_str",
        "checked",
        "min_tokens",
        "logprobs",
        "prompt_logprobs",
    )

    def __init__(
        self,
        request: Any,
        prompt: list[int],
        prompt_text: str | None = None,
        *,
        public_id: str | None = None,
        index: int = 0,
    ) -> None:
        self.request = request
        self.prompt = prompt
        self.prompt_text = prompt_text
        self.public_id = request.request_id if public_id is None else public_id
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.emitted = 0
        self.sent = 0
        self.finished = False
        self.reason: str | None = None
        self.prefix_offset = 0
        self.read_offset = 0
        params = getattr(request, "sampling_params", None)
        self.stops: tuple[str, ...] = tuple(getattr(params, "stop", ()) or ())
        self.include_stop = bool(getattr(params, "include_stop_str_in_output", False))
        self.stop_str: str | None = None
        self.checked = 0  # characters of text already searched for stop strings
        # stop strings are not searched in the text of the first min_tokens tokens
        # (0 once the search has begun)
        self.min_tokens = int(getattr(params, "min_tokens", 0) or 0)
        self.logprobs: list[dict[int, Logprob]] | None = (
            [] if getattr(params, "logprobs", None) is not None else None
        )
        # set once the engine delivers them (with the first token)
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None


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
        self._guard = _ThreadGuard()
        self._sample_ids = itertools.count()
        end_of_turn = None if self.tokenizer is None else self.tokenizer.token_id("eos_token")
        self._end_ids = frozenset(self.engine.eos_token_ids) | (
            frozenset() if end_of_turn is None else {end_of_turn}
        )

    # -- requests -------------------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (``encode`` / ``decode`` / ``apply_chat_template``).

        :raises RequestError: when the model has none.
        """
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer; give prompts as token ids")
        return self.tokenizer

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
        text = prompt if isinstance(prompt, str) else None
        ids = self.encode(prompt) if isinstance(prompt, str) else prompt
        return self._add_tokens(ids, sampling_params, request_id, text)

    def _add_tokens(
        self,
        ids: Any,
        sampling_params: SamplingParams | None,
        request_id: str | None,
        prompt_text: str | None,
        *,
        public_id: str | None = None,
        index: int = 0,
    ) -> str:
        """Queue a tokenized prompt (``prompt_text``: what ``RequestOutput.prompt`` shows).

        ``public_id`` / ``index``: the request and sample this engine request is
        one of (``n > 1``); its outputs carry them.
        """
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        if sampling_params.n != 1 and public_id is None:
            raise RequestError(
                f"SamplingParams.n={sampling_params.n}: add_request queues one sample; use "
                "generate, stream or chat for n > 1, or add n requests (seed + j for sample j)"
            )
        with self._guard("add_request"):
            rid = self.engine.add_request(ids, sampling_params, request_id)
            req = self.engine.get_request(rid)
            self._tracked[rid] = _Tracked(
                req, req.prompt_token_ids.tolist(), prompt_text, public_id=public_id, index=index
            )
        return rid

    def abort(self, request_id: str) -> bool:
        """Abort a request: its pages and state slot are freed at once; its
        stream ends with ``finish_reason == "abort"``.

        :return: ``True`` if the request was still running.
        """
        with self._guard("abort"):
            if self.engine.abort_request(request_id):
                return True
            # the samples of an n > 1 request
            samples = [r for r, t in self._tracked.items() if t.public_id == request_id]
            return any([self.engine.abort_request(r) for r in samples])

    # -- driving the engine --------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step and return an incremental output per request that
        got a token or finished (requests added with :meth:`add_request`).

        :raises ConcurrentUseError: another thread is using this LLM.
        """
        with self._guard("step"):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        outs = []
        for so in self.engine.step():
            t = self._tracked.get(so.request_id)
            if t is None:
                continue
            t.token_ids.extend(so.new_token_ids)
            if t.logprobs is not None and so.new_logprobs:
                t.logprobs.extend(self._decoded(d) for d in so.new_logprobs)
            if so.prompt_logprobs is not None:
                t.prompt_logprobs = self._decoded_list(so.prompt_logprobs)
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
        if t.stop_str is None:  # a matched stop string froze the text
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
            if t.stops and len(t.token_ids) > t.min_tokens:
                self._match_stop(t)
        visible = len(t.text)
        if t.stops and not t.finished:  # the end that may still grow into a stop string
            visible -= _partial_stop(t.text, t.stops)
        visible = max(min(visible, len(t.text)), min(t.sent, len(t.text)))
        new_text = t.text[t.sent : visible] if incremental else t.text
        t.sent = visible
        completion = CompletionOutput(
            index=t.index,
            text=t.text,
            token_ids=list(t.token_ids),
            logprobs=None if t.logprobs is None else list(t.logprobs),
            finish_reason=t.reason,
            stop_reason=t.stop_str if t.stop_str is not None else _stop_reason(t, self._end_ids),
        )
        return RequestOutput(
            request_id=t.public_id,
            prompt=t.prompt_text,
            prompt_token_ids=t.prompt,
            outputs=[completion],
            finished=t.finished,
            prompt_logprobs=t.prompt_logprobs,
            new_token_ids=new_ids,
            new_text=new_text,
            metrics=_metrics(t.request),
        )

    def _decoded(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        """One position's logprobs with each token's text filled in (when there is a tokenizer)."""
        if self.tokenizer is None:
            return entry
        return {tok: Logprob(lp.logprob, lp.rank, self.decode([tok])) for tok, lp in entry.items()}

    def _decoded_list(self, entries: list[dict[int, Logprob] | None]) -> list[Any]:
        """Prompt logprobs with each token's text (each distinct token decoded once)."""
        if self.tokenizer is None:
            return entries
        texts: dict[int, str] = {}
        out: list[dict[int, Logprob] | None] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            d = {}
            for tok, lp in entry.items():
                s = texts.get(tok)
                if s is None:
                    s = texts[tok] = self.decode([tok])
                d[tok] = Logprob(lp.logprob, lp.rank, s)
            out.append(d)
        return out

    def _match_stop(self, t: _Tracked) -> None:
        """Finish ``t`` at the first stop string in its text (trimmed unless it is to be kept).

        Only text not searched before (plus the overlap a stop string may span)
        is searched. With ``min_tokens``, the search starts once more tokens
        than that were generated, and a match must end after the text of the
        first ``min_tokens`` tokens (vLLM's rule). A match ends the request in the
        engine at once (its pages are freed); the tokens stay in ``token_ids``.
        """
        text = t.text
        if t.min_tokens:
            # the first search: the text of the first min_tokens tokens is not searched
            held = self.decode(t.token_ids[: t.min_tokens]).rstrip("\ufffd")
            t.checked = max(t.checked, min(len(held), len(text)))
            t.min_tokens = 0
        start = t.checked
        t.checked = len(text)
        best: tuple[int, str] | None = None
        for s in t.stops:
            # a match ending in new text may begin in text searched before
            p = text.find(s, max(0, start - len(s) + 1))
            if p != -1 and (best is None or p < best[0]):
                best = (p, s)
        if best is None:
            return
        p, s = best
        t.text = text[: p + len(s)] if t.include_stop else text[:p]
        t.stop_str = s
        if not t.finished:
            t.finished = True
            self.engine.abort_request(t.request.request_id)
        t.reason = "stop"

    def _add_all(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: Any,
        ids: Sequence[str] | None,
        prompt_texts: Sequence[str] | None = None,
    ) -> list[list[str]]:
        """Queue every prompt (all or nothing); return each prompt's engine request ids
        (one per sample)."""
        plist = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = as_params_list(sampling_params, len(plist))
        if ids is not None and len(ids) != len(plist):
            raise RequestError(f"got {len(ids)} request ids for {len(plist)} prompts")
        added: list[str] = []
        groups: list[list[str]] = []
        try:
            for i, (p, sp) in enumerate(zip(plist, params, strict=True)):
                try:
                    rid = None if ids is None else ids[i]
                    if prompt_texts is not None:  # pre-tokenized (chat): keep the rendered text
                        tokens, text = p, prompt_texts[i]
                    else:
                        text = p if isinstance(p, str) else None
                        tokens = self.encode(p) if isinstance(p, str) else p
                    if sp.n == 1:
                        samples = [(rid, sp, None, 0)]
                    else:  # one engine request per sample, reported under the request's id
                        public = rid if rid is not None else f"n{next(self._sample_ids)}"
                        samples = [
                            (f"{public}/{j}", s, public, j) for j, s in enumerate(split_samples(sp))
                        ]
                    group = []
                    for sample_id, s, public, j in samples:
                        rid = self._add_tokens(
                            tokens, s, sample_id, text, public_id=public, index=j
                        )
                        self._ready[rid] = deque()  # this call consumes the request's outputs
                        added.append(rid)
                        group.append(rid)
                    groups.append(group)
                except RequestError as exc:
                    # name the prompt, keeping the error's type and fields (InvalidFieldError.field)
                    exc.args = (f"prompt {i}: {exc}", *exc.args[1:])
                    raise
        except BaseException:
            for rid in added:  # all or nothing: drop what this call queued
                self.abort(rid)
                self._tracked.pop(rid, None)
                self._ready.pop(rid, None)
            raise
        return groups

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt and return the finished outputs, in prompt order.

        :param prompts: one prompt or a list of prompts (text, token-id lists or
            int32 arrays).
        :param sampling_params: one set for all prompts or one per prompt;
            ``None``: :meth:`default_sampling_params`.
        :param request_ids: optional unique ids, one per prompt.
        :param use_tqdm: show a progress bar of finished prompts on stderr when
            there is more than one prompt and stderr is a terminal.
        :return: one :class:`RequestOutput` per prompt.
        :raises RequestError: a prompt is invalid (then none of them is run).
        :raises ConcurrentUseError: another thread is using this LLM.
        """
        with self._guard("generate"):
            return self._generate(prompts, sampling_params, request_ids, use_tqdm)

    def _generate(
        self,
        prompts: Any,
        sampling_params: Any,
        request_ids: Sequence[str] | None,
        use_tqdm: bool,
        prompt_texts: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        groups = self._add_all(prompts, sampling_params, request_ids, prompt_texts)
        rids = [rid for group in groups for rid in group]
        final: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(rids)) if use_tqdm and len(rids) > 1 else None
        try:
            while len(final) < len(rids):
                before = len(final)
                self._drain(rids, final)
                if bar is not None and len(final) > before:
                    bar.update(len(final) - before)
                if len(final) < len(rids):
                    self.step()
        finally:
            if bar is not None:
                bar.close()
            for rid in rids:
                if rid not in final:
                    self.abort(rid)
                self._ready.pop(rid, None)
        self._settle()
        results = []
        for group in groups:
            out = final[group[0]]
            if len(group) > 1:  # the samples of one request, in index order
                out.outputs = [final[rid].outputs[0] for rid in group]
            out.new_token_ids = list(out.token_ids)
            out.new_text = out.text
            results.append(out)
        return results

    def _settle(self) -> None:
        """With no request left, commit a step still in flight and collect abort reports.

        With asynchronous scheduling a step for requests that have just finished
        may already be launched; committing it (its tokens are dropped) leaves
        the engine idle, so nothing waits on the device after ``generate`` returns.
        """
        for _ in range(2):
            if self.engine.num_unfinished_requests or not (
                self.engine.has_unfinished_requests() or self._tracked
            ):
                return
            self._step()

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
        with self._guard("stream"):
            groups = self._add_all(prompts, sampling_params, request_ids)
        return self._stream([rid for group in groups for rid in group])

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
            try:
                with self._guard("stream"):
                    self._settle()
            except ConcurrentUseError:
                pass  # closed while another thread drives the engine: that thread settles it

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
        use_tqdm: bool = True,
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
        :param use_tqdm: as :meth:`generate`.
        :return: one :class:`RequestOutput` per conversation, as :meth:`generate`
            (``prompt`` is the rendered conversation).
        :raises RequestError: no tokenizer or chat template, malformed messages,
            or a template that refuses them.
        """
        with self._guard("chat"):
            conversations = _as_conversations(messages)
            rendered = [
                self.render_chat(c, add_generation_prompt, chat_template_kwargs)
                for c in conversations
            ]
            if sampling_params is None:
                sampling_params = self.default_sampling_params()
            params = [self.chat_params(sp) for sp in as_params_list(sampling_params, len(rendered))]
            return self._generate(
                [ids for _, ids in rendered],
                params,
                request_ids,
                use_tqdm,
                prompt_texts=[text for text, _ in rendered],
            )

    def render_chat(
        self,
        conversation: Conversation,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """Render one conversation with the chat template and tokenize it.

        :param conversation: ``[{"role": ..., "content": ...}, ...]``.
        :param add_generation_prompt: end with an open assistant turn.
        :param chat_template_kwargs: further template variables.
        :return: the prompt text and its token ids (no special tokens added:
            the template writes them).
        :raises RequestError: no tokenizer or template, malformed messages, or a
            template that refuses them.
        """
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer, so it cannot render a chat")
        text = self.tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            **(chat_template_kwargs or {}),
        )
        return text, list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def chat_params(self, sampling_params: SamplingParams) -> SamplingParams:
        """``sampling_params`` that also stop at the tokenizer's end of turn (its eos token).

        :param sampling_params: the caller's parameters.
        :return: the same, with the end-of-turn id added to ``stop_token_ids``
            unless ``ignore_eos`` is set or it is there already.
        """
        end_of_turn = None if self.tokenizer is None else self.tokenizer.token_id("eos_token")
        sp = sampling_params
        if end_of_turn is None or sp.ignore_eos or end_of_turn in sp.stop_token_ids:
            return sp
        return dataclasses.replace(sp, stop_token_ids=(*sp.stop_token_ids, end_of_turn))

    @property
    def num_unfinished_requests(self) -> int:
        """Requests queued or running in the engine."""
        return self.engine.num_unfinished_requests

    def shutdown(self) -> None:
        """Release the model, caches and graphs (device memory included); idempotent.

        Unfinished requests are dropped. Afterwards a new ``LLM`` in the same
        process gets the memory back; this one raises
        :class:`~backplane.core.errors.EngineClosedError` when given work.
        """
        self._tracked.clear()
        self._ready.clear()
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        """``with LLM(...) as llm:`` shuts the engine down when the block ends."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Shut the engine down (see :meth:`shutdown`)."""
        self.shutdown()


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


def _progress_bar(total: int) -> Any:
    """A tqdm bar of finished prompts (``disable=None``: hidden unless stderr is a terminal)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generating", unit="prompt", disable=None, leave=False)


def _partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that begins some stop string (held back)."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


def split_samples(sp: SamplingParams) -> list[SamplingParams]:
    """One :class:`SamplingParams` per sample of an ``n > 1`` request (``n == 1``: itself).

    Sample ``j`` of a seeded request uses ``seed + j`` (wrapped to 64 bits), so the
    samples differ and each is reproducible. Only sample 0 computes
    ``prompt_logprobs`` (they are the prompt's, the same for every sample).
    """
    if sp.n == 1:
        return [sp]
    out = []
    for j in range(sp.n):
        seed = None if sp.seed is None else (sp.seed + j) % 2**64
        plp = sp.prompt_logprobs if j == 0 else None
        out.append(dataclasses.replace(sp, n=1, seed=seed, prompt_logprobs=plp))
    return out


def _stop_reason(t: _Tracked, end_ids: frozenset[int] = frozenset()) -> int | None:
    """The stop token that ended a ``"stop"`` finish (``None`` for end-of-sequence or other).

    :param end_ids: the model's end-of-sequence ids and the chat end of turn: a stop
        on one of those is an end of sequence, as in vLLM.
    """
    if t.reason != "stop" or not t.token_ids:
        return None
    last = t.token_ids[-1]
    if last in end_ids:
        return None
    return last if last in t.request.sampling_params.stop_token_ids else None


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
