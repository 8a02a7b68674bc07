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

import itertools
import logging
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from backplane.api import chat as _chat
from backplane.api.chat import Conversation
from backplane.api.guard import ConcurrentUseError, ThreadGuard
from backplane.api.output_processor import OutputProcessor, TrackedRequest
from backplane.api.outputs import RequestMetrics, RequestOutput
from backplane.api.pending_output import PendingOutput
from backplane.api.prompts import (
    Prompt,
    as_prompt_list,
    check_sampling_params,
    check_unique_ids,
    params_per_prompt,
    split_samples,
)
from backplane.api.stop import StopAutomaton, check_stop_limits
from backplane.core.errors import RequestError
from backplane.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "LLM",
    "ConcurrentUseError",
    "Conversation",
    "Prompt",
    "RequestMetrics",
    "RequestOutput",
    "split_samples",
]


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
        from backplane.engine.engine import Engine

        if model is not None:
            overrides["model"] = model
        if config is None:
            config = EngineConfig.from_dict(overrides)
        elif overrides:
            config = config.merge(**overrides)
        if config.data_parallel_size > 1:
            logger.warning(
                "data_parallel_size=%d: an LLM runs one engine; AsyncLLM (and the server) run "
                "the replicas",
                config.data_parallel_size,
            )
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer
        self._tracked: dict[str, TrackedRequest] = {}
        self._ready: dict[str, deque[RequestOutput]] = {}
        # the requests of a generate call (only their final outputs are built) and those of
        # them that finished since the call last looked
        self._final_only: set[str] = set()
        self._finished: list[str] = []
        self._guard = ThreadGuard()
        self._sample_ids = itertools.count()
        end_of_turn = None if self.tokenizer is None else self.tokenizer.token_id("eos_token")
        end_ids = frozenset(self.engine.eos_token_ids) | (
            frozenset() if end_of_turn is None else {end_of_turn}
        )
        self._outputs = OutputProcessor(self.tokenizer, end_ids, self.engine.abort_request)

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
        """Detokenize (empty string without a tokenizer).

        :param token_ids: the ids.
        :return: the text, special tokens skipped.
        """
        return self._outputs.decode(token_ids)

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
        :raises RequestError: the request is invalid (nothing is queued);
            :class:`~backplane.core.errors.InvalidFieldError` names the field
            (``sampling_params`` when it is not a :class:`SamplingParams`).
        """
        if sampling_params is not None:
            check_sampling_params(sampling_params)
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
        stop_automaton: StopAutomaton | None = None,
    ) -> str:
        """Queue a tokenized prompt (``prompt_text``: what ``RequestOutput.prompt`` shows).

        ``public_id`` / ``index``: the request and sample this engine request is
        one of (``n > 1``); its outputs carry them. ``stop_automaton``: the stop
        strings' automaton when the caller built it ahead, off this thread.
        """
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        check_sampling_params(sampling_params)
        self._check_stops(sampling_params)
        if sampling_params.n != 1 and public_id is None:
            raise RequestError(
                f"SamplingParams.n={sampling_params.n}: add_request queues one sample; use "
                "generate, stream or chat for n > 1, or add n requests (seed + j for sample j)"
            )
        with self._guard("add_request"):
            rid = self.engine.add_request(ids, sampling_params, request_id)
            req = self.engine.get_request(rid)
            self._tracked[rid] = TrackedRequest(
                req,
                req.prompt_token_ids.tolist(),
                prompt_text,
                public_id=public_id,
                index=index,
                stop_automaton=stop_automaton,
            )
        return rid

    def _check_stops(self, sampling_params: SamplingParams) -> None:
        """Refuse stop strings beyond the engine's ``max_stop_strings`` / ``max_stop_string_length``."""
        cfg = self.engine.config
        check_stop_limits(sampling_params.stop, cfg.max_stop_strings, cfg.max_stop_string_length)

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

    def step_streamed(self) -> list[RequestOutput | PendingOutput]:
        """:meth:`step` for a caller that hands each output to a stream read on another
        thread: a running request's output comes as a :class:`PendingOutput`, which
        the stream's reader builds (:meth:`PendingOutput.build`); finished ones are built.

        :raises ConcurrentUseError: another thread is using this LLM.
        """
        with self._guard("step"):
            return self._step(streamed=True)

    def _step(self, *, lean: bool = False, streamed: bool = False) -> list[Any]:
        """Run one engine step and process its outputs.

        :param lean: the caller drops the returned list (``generate``): the
            running requests of a ``generate`` call get no output object, only
            their finished ones do.
        :param streamed: a running request that no call of this LLM reads gets a
            :class:`PendingOutput` instead of its output (see :meth:`step_streamed`).
        :return: the outputs built (see :meth:`step`).
        """
        outs = []
        tracked, ready, final_only = self._tracked, self._ready, self._final_only
        step_outputs = self.engine.step()
        if streamed and not ready:
            return self._streamed_outputs(step_outputs)
        for so in step_outputs:
            rid = so.request_id
            t = tracked.get(rid)
            if t is None:
                continue
            if lean and rid in final_only:
                if not self._outputs.absorb(t, so):
                    continue
                out = self._outputs.output(t, incremental=True)
            elif streamed and rid not in ready:
                out = self._outputs.update_streamed(t, so)
            else:
                out = self._outputs.update(t, so)
            if t.finished:
                tracked.pop(rid, None)
                if rid in final_only:
                    self._finished.append(rid)
            queue = ready.get(rid)
            if queue is not None:
                queue.append(out)
            outs.append(out)
        return outs

    def _streamed_outputs(self, step_outputs: list[Any]) -> list[RequestOutput | PendingOutput]:
        """The outputs of :meth:`step_streamed` when no :meth:`stream` call reads any.

        Every request's output is a streamed one (see
        :meth:`OutputProcessor.update_streamed_many`: the step's texts are decoded together).

        :param step_outputs: the engine step's outputs.
        :return: one output per tracked request among them, in their order.
        """
        tracked, final_only = self._tracked, self._final_only
        pairs = []
        for so in step_outputs:
            t = tracked.get(so.request_id)
            if t is not None:
                pairs.append((t, so))
        outs = self._outputs.update_streamed_many(pairs)
        for t, so in pairs:
            if t.finished:
                rid = so.request_id
                tracked.pop(rid, None)
                if rid in final_only:
                    self._finished.append(rid)
        return outs

    def _add_all(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: Any,
        ids: Sequence[str] | None,
        prompt_texts: Sequence[str] | None = None,
    ) -> list[list[str]]:
        """Queue every prompt (all or nothing); return each prompt's engine request ids
        (one per sample).

        Every prompt is tokenized and every request id checked before the first
        one is queued, so a refused call leaves nothing behind in the engine.
        """
        plist = as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = params_per_prompt(sampling_params, len(plist))
        if ids is not None and len(ids) != len(plist):
            raise RequestError(f"got {len(ids)} request ids for {len(plist)} prompts")
        # (tokens, prompt text, [(engine id or None, params, public id, index)]) per prompt
        plans: list[tuple[Any, str | None, list[tuple[str | None, SamplingParams, Any, int]]]] = []
        seen: set[str] = set()
        for i, (p, sp) in enumerate(zip(plist, params, strict=True)):
            try:
                self._check_stops(sp)
                rid = None if ids is None else ids[i]
                if prompt_texts is not None:  # pre-tokenized (chat): keep the rendered text
                    tokens, text = p, prompt_texts[i]
                else:
                    text = p if isinstance(p, str) else None
                    tokens = self.encode(p) if isinstance(p, str) else p
                if sp.n == 1:
                    samples: list[tuple[str | None, SamplingParams, Any, int]] = [
                        (rid, sp, None, 0)
                    ]
                else:  # one engine request per sample, reported under the request's id
                    public = rid if rid is not None else f"n{next(self._sample_ids)}"
                    samples = [
                        (f"{public}/{j}", s, public, j) for j, s in enumerate(split_samples(sp))
                    ]
                check_unique_ids(
                    [sid for sid, *_ in samples if sid is not None],
                    lambda r: self.engine.get_request(r) is not None,
                    seen,
                )
            except RequestError as exc:
                # name the prompt, keeping the error's type and fields (InvalidFieldError.field)
                exc.args = (f"prompt {i}: {exc}", *exc.args[1:])
                raise
            plans.append((tokens, text, samples))
        added: list[str] = []
        groups: list[list[str]] = []
        try:
            for i, (tokens, text, samples) in enumerate(plans):
                try:
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
        self._final_only.update(rids)
        bar = _progress_bar(len(rids)) if use_tqdm and len(rids) > 1 else None
        try:
            while len(final) < len(rids):
                before = len(final)
                self._drain(final)
                if bar is not None and len(final) > before:
                    bar.update(len(final) - before)
                if len(final) < len(rids):
                    with self._guard("step"):
                        self._step(lean=True)
        finally:
            if bar is not None:
                bar.close()
            self._final_only.difference_update(rids)
            for rid in rids:
                if rid not in final:
                    self.abort(rid)
                self._ready.pop(rid, None)
            self._finished = [rid for rid in self._finished if rid in self._final_only]
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

    def _drain(self, final: dict[str, RequestOutput]) -> None:
        """Move the final outputs of the ``generate`` requests finished since the last call
        into ``final`` (O(finished): the running requests are not visited).

        :param final: request id -> its final output.
        """
        done, self._finished = self._finished, []
        for rid in done:
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
        tools: Sequence[Mapping[str, Any]] | None = None,
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
        :param tools: functions the model may call (OpenAI's ``tools`` list), given to the
            template; earlier ``tool_calls`` in the messages are written for it too. The
            model's calls come back as text in its format (read them with
            :func:`backplane.api.tool_parsers.tool_parser_for_model`'s parser).
        :param request_ids: optional unique ids, one per conversation.
        :param use_tqdm: as :meth:`generate`.
        :return: one :class:`RequestOutput` per conversation, as :meth:`generate`
            (``prompt`` is the rendered conversation).
        :raises RequestError: no tokenizer or chat template, malformed messages,
            or a template that refuses them.
        """
        with self._guard("chat"):
            conversations = _chat.as_conversations(messages)
            rendered = []
            for conversation in conversations:
                kwargs = chat_template_kwargs
                if tools is not None or any(m.get("tool_calls") for m in conversation):
                    conversation, kwargs = self._with_tools(conversation, tools, kwargs)
                rendered.append(self.render_chat(conversation, add_generation_prompt, kwargs))
            if sampling_params is None:
                sampling_params = self.default_sampling_params()
            params = [
                self.chat_params(sp) for sp in params_per_prompt(sampling_params, len(rendered))
            ]
            return self._generate(
                [ids for _, ids in rendered],
                params,
                request_ids,
                use_tqdm,
                prompt_texts=[text for text, _ in rendered],
            )

    def _with_tools(
        self,
        conversation: Conversation,
        tools: Sequence[Mapping[str, Any]] | None,
        chat_template_kwargs: Mapping[str, Any] | None,
    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """The conversation and template variables to render with ``tools``."""
        from backplane.api.tool_parsers import tool_parser_for_model
        from backplane.api.tools import with_tools

        template = getattr(self.tokenizer, "chat_template", None)
        source = None if template is None else template.source
        parser = tool_parser_for_model(self.engine.model_config.get("model_type"), source)
        return with_tools(conversation, tools, source, parser, chat_template_kwargs)

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
        return _chat.render_chat(
            self.tokenizer, conversation, add_generation_prompt, chat_template_kwargs
        )

    def chat_params(self, sampling_params: SamplingParams) -> SamplingParams:
        """``sampling_params`` that also stop at the tokenizer's end of turn (its eos token).

        :param sampling_params: the caller's parameters.
        :return: the same, with the end-of-turn id added to ``stop_token_ids``
            unless ``ignore_eos`` is set or it is there already.
        """
        return _chat.chat_params(self.tokenizer, sampling_params)

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
        self._final_only.clear()
        self._finished.clear()
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        """``with LLM(...) as llm:`` shuts the engine down when the block ends."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Shut the engine down (see :meth:`shutdown`)."""
        self.shutdown()


def _progress_bar(total: int) -> Any:
    """A tqdm bar of finished prompts (``disable=None``: hidden unless stderr is a terminal)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generating", unit="prompt", disable=None, leave=False)
