"""The asynchronous engine front: one loop drives the engine for any number of callers.

Example::

    import asyncio
    from backplane.api import AsyncLLM
    from backplane import SamplingParams

    engine = AsyncLLM("smollm2")

    async def main():
        async for out in engine.generate("The capital of France is", SamplingParams(max_tokens=8)):
            print(out.new_text, end="", flush=True)

    asyncio.run(main())
    engine.shutdown()

One background thread (the *engine loop*) owns the :class:`~backplane.api.llm.LLM`:
it takes submitted requests and aborts from a command queue between steps,
runs :meth:`LLM.step` while any request is live, and hands each output to the
stream of the request it belongs to. Coroutines of any event loop submit with
:meth:`AsyncLLM.add_request` / :meth:`AsyncLLM.generate`; plain threads with
:meth:`AsyncLLM.submit` / :meth:`AsyncLLM.generate_sync`. A thread rather than
an asyncio task drives the engine because a step is blocking work: on an
event loop it would stall every connection for the length of a step.

Tokenizing and chat templating run on a small thread pool, not on the
caller's event loop (the ``tokenizers`` library lets go of the GIL while it
encodes), and detokenizing runs on the engine loop: no request stalls the
other connections of a server. A text prompt with more characters than any
prompt that fits the model length could have is refused before it is
tokenized (:attr:`AsyncLLM.max_prompt_chars`).

Closing or cancelling a stream aborts its request: the abort is queued ahead
of anything else and the engine loop runs it before its next step, freeing the
request's KV pages and state slot (at most one step after the call).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from backplane.api.balancing import LoadBalancer
from backplane.api.chat import render_chat_text
from backplane.api.data_parallel import replica_configs, replica_in_own_process
from backplane.api.engine_process import ProcessLLM
from backplane.api.llm import LLM, Conversation, Prompt
from backplane.api.outputs import RequestOutput
from backplane.api.pending_output import PendingOutput, coalesced
from backplane.api.stop import StopAutomaton, stop_automaton
from backplane.core.errors import (
    BackplaneError,
    EngineFailedError,
    InvalidFieldError,
    RequestError,
)
from backplane.core.gc_heap import freeze_startup_heap, released_startup_heap
from backplane.engine.config import EngineConfig
from backplane.engine.sampling import SamplingParams
from backplane.models.tokenizer_bounds import char_bound

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncLLM",
    "AsyncRequestStream",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineSnapshot",
    "RequestStream",
]


class EngineDeadError(BackplaneError, RuntimeError):
    """The engine loop stopped (shut down, or a step failed); no request can run."""


class EngineOverloadedError(BackplaneError):
    """The cap on waiting requests is reached; try again later."""


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's load, as of the end of the engine loop's last iteration.

    :param running: requests holding KV pages.
    :param waiting: requests queued for admission.
    :param kv_pages_used: KV pages held by requests.
    :param kv_pages_total: usable KV pages.
    :param prefix_cache_queries: full prompt pages looked up in the prefix cache (total).
    :param prefix_cache_hits: of those, found (device or host tier).
    :param steps: engine steps run.
    :param alive: whether the engine loop is running.
    """

    running: int = 0
    waiting: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    steps: int = 0
    alive: bool = True

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits over queries (0 before the first query)."""
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    @classmethod
    def total(cls, snapshots: Sequence[EngineSnapshot]) -> EngineSnapshot:
        """The load of several engine replicas taken together.

        :param snapshots: one snapshot per replica.
        :return: the sums of the counts (steps too); alive only while every replica is.
        """
        return cls(
            running=sum(s.running for s in snapshots),
            waiting=sum(s.waiting for s in snapshots),
            kv_pages_used=sum(s.kv_pages_used for s in snapshots),
            kv_pages_total=sum(s.kv_pages_total for s in snapshots),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in snapshots),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in snapshots),
            steps=sum(s.steps for s in snapshots),
            alive=all(s.alive for s in snapshots),
        )


#: Failed engine steps in a row after which the loop gives up (the engine keeps failing).
_MAX_FAILED_STEPS = 50

#: Most tokenizer threads: enough that one long prompt does not queue the short ones
#: behind it, few enough not to take the cores the engine steps on.
_MAX_TOKENIZER_THREADS = 4


def _engine_config(model: str | None, config: Any, overrides: dict[str, Any]) -> EngineConfig:
    """The configuration :class:`LLM` would build from the same arguments."""
    if model is not None:
        overrides = {**overrides, "model": model}
    if config is None:
        return EngineConfig.from_dict(overrides)
    return config.merge(**overrides) if overrides else config


def _build_replicas(configs: Sequence[EngineConfig]) -> list[LLM]:
    """One :class:`LLM` per configuration; if one fails to start, the ones built are released.

    A replica that needs a process of its own (:func:`replica_in_own_process`)
    is a :class:`ProcessLLM`; those start first and build their engines while
    this process builds its own.
    """
    llms: list[LLM] = []
    # ProcessLLM: the same calls as an LLM, answered by the engine process
    started: dict[int, Any] = {}
    try:
        for i, c in enumerate(configs):
            if replica_in_own_process(c, i):
                started[i] = ProcessLLM(c, i)
        for i, c in enumerate(configs):
            llms.append(started[i] if i in started else LLM(config=c))
        for replica in started.values():
            replica.wait_ready()
    except BaseException:
        llms += [r for r in started.values() if r not in llms]
        for built in llms:
            try:
                built.shutdown()
            except Exception:
                logger.exception("releasing replica %d after a failed start failed", len(llms))
        raise
    return llms


def _usable_cpus() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this OS
        return os.cpu_count() or 1


class _AsyncSink:
    """Where a request's outputs wait for its reader, on the submitter's event loop.

    Items are appended on that loop's thread (:func:`_put_all`), and the reader
    is woken only when it waits for one: a reader that is behind finds
    everything that piled up at its next read, without one wake-up per output.
    """

    __slots__ = ("loop", "items", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque[Any] = deque()
        #: the future the reader awaits while ``items`` is empty (``None`` when it does not wait)
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: Any) -> None:
        """Queue an item for the reader and wake it if it waits (on the sink's loop only).

        :param item: an output, or the exception that ends the stream.
        """
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():  # a cancelled read leaves its future done
                waiter.set_result(None)


class _ThreadSink:
    """Delivers a request's outputs to a thread-safe queue."""

    __slots__ = ("queue",)

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()


def _take(items: deque[Any]) -> Any:
    """Take a stream's next item from what is queued for it (at least one item).

    Every output queued before the next exception, up to the request's last one,
    comes as one (:func:`coalesced`): a reader that fell behind catches up in one
    read, and the outputs it reads still add up to the same tokens and text.

    :param items: the stream's queued items, oldest first.
    :return: an output (possibly unbuilt) or the exception that ends the stream.
    """
    item = items.popleft()
    if not items or isinstance(item, BaseException) or item.finished:
        return item
    run = [item]
    while items:
        nxt = items[0]
        if isinstance(nxt, BaseException):
            break
        run.append(items.popleft())
        if nxt.finished:
            break
    return coalesced(run)


class AsyncRequestStream:
    """The outputs of one request, for ``async for``.

    Each item is an incremental :class:`RequestOutput` (``new_text`` /
    ``new_token_ids`` since the previous one); the last has ``finished=True``.
    The outputs of the steps that ran while the reader was busy come as one
    (their new tokens and text together, the rest as of the latest step).
    Cancelling the task that iterates it, or :meth:`aclose`, aborts the request.

    :param engine: the engine that runs the request.
    :param request_id: the request's id.
    :param sink: where the engine loop delivers its outputs.
    """

    def __init__(self, engine: AsyncLLM, request_id: str, sink: _AsyncSink) -> None:
        self.request_id = request_id
        self._engine = engine
        self._sink = sink
        self._done = False

    def __aiter__(self) -> AsyncRequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        sink = self._sink
        items = sink.items
        while not items:
            waiter = sink.waiter = sink.loop.create_future()
            try:
                await waiter
            except BaseException:  # cancelled while waiting: the caller gave up on the request
                sink.waiter = None
                self.abort()
                raise
        item = _take(items)
        if type(item) is PendingOutput:
            return item.build()  # a running request's output, built here, off the engine loop
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    def abort(self) -> None:
        """Abort the request unless it finished (returns at once; see :meth:`AsyncLLM.abort`)."""
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        """Stop iterating; an unfinished request is aborted."""
        self.abort()

    @property
    def finished(self) -> bool:
        """True once the last output was taken (or the stream was closed)."""
        return self._done


class RequestStream:
    """The outputs of one request, for a plain ``for`` loop on any thread.

    As :class:`AsyncRequestStream`; :meth:`close` (or leaving a ``with`` block)
    aborts an unfinished request.
    """

    def __init__(self, engine: AsyncLLM, request_id: str, sink: _ThreadSink) -> None:
        self.request_id = request_id
        self._engine = engine
        self._sink = sink
        self._done = False
        # taken from the sink's queue, not handed out yet
        self._items: deque[Any] = deque()

    def __iter__(self) -> Iterator[RequestOutput]:
        return self

    def __next__(self) -> RequestOutput:
        if self._done:
            raise StopIteration
        items = self._items
        q = self._sink.queue
        if not items:
            items.append(q.get())
        # what piled up while this reader was away comes as one output (see _take)
        while not q.empty():
            items.append(q.get_nowait())
        item = _take(items)
        if type(item) is PendingOutput:
            return item.build()  # a running request's output, built here, off the engine loop
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    def close(self) -> None:
        """Stop iterating; an unfinished request is aborted."""
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncLLM:
    """Serve many concurrent callers from one engine, driven by one background loop.

    With ``data_parallel_size = N`` (a configuration key) it runs N engine
    replicas, each with its own devices (:func:`~backplane.api.data_parallel.replica_configs`)
    and its own engine-loop thread, and gives each new request to the replica
    with the fewest live requests (:class:`~backplane.api.balancing.LoadBalancer`);
    an abort goes to the replica that holds the request, and :meth:`snapshot`
    adds the replicas' loads up.

    :param model: as :class:`LLM` (a preset, ``smollm2``, a directory or a ``.gguf`` file).
    :param config: an ``EngineConfig`` to start from (optional).
    :param llm: an already built :class:`LLM` to drive instead of building one
        (it must not be used directly afterwards); one replica.
    :param max_waiting_requests: refuse new requests with
        :class:`EngineOverloadedError` while this many wait for admission
        in the replica the request would go to (``None``: no cap).
    :param overrides: ``EngineConfig`` fields, as for :class:`LLM`.
    :raises ConfigError: on an invalid configuration.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: Any = None,
        llm: LLM | None = None,
        max_waiting_requests: int | None = None,
        **overrides: Any,
    ) -> None:
        if llm is not None:
            llms = [llm]
        else:
            llms = _build_replicas(replica_configs(_engine_config(model, config, overrides)))
        self.llm = llms[0]  # the tokenizer and limits, which every replica shares
        self.max_waiting_requests = max_waiting_requests
        self._finished_callbacks: list[Callable[[RequestOutput], None]] = []
        self._ids = itertools.count()
        self._id_prefix = f"{int(time.time() * 1000):x}"
        self._stopping = False
        self._balancer = LoadBalancer(len(llms))
        self._replicas = [_EngineLoop(r, i, self) for i, r in enumerate(llms)]
        self._char_bound = char_bound(self.llm.tokenizer) if self.llm.tokenizer else None
        self._tokenizer_pool = ThreadPoolExecutor(
            max_workers=max(1, min(_MAX_TOKENIZER_THREADS, _usable_cpus())),
            thread_name_prefix="backplane-tokenize",
        )
        for replica in self._replicas:
            replica.start()

    # -- what callers read --------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (``None`` without one)."""
        return self.llm.tokenizer

    def get_tokenizer(self) -> Any:
        """The model's tokenizer; see :meth:`LLM.get_tokenizer`."""
        return self.llm.get_tokenizer()

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output."""
        return int(self.llm.engine.max_model_len)

    @property
    def max_prompt_chars(self) -> int | None:
        """The most characters a text prompt that fits :attr:`max_model_len` can have.

        ``max_model_len`` times the most characters one token of the tokenizer
        covers (its longest vocabulary entry); longer prompts are refused
        without tokenizing them. ``None`` when the tokenizer has no such bound
        (it can drop text or fold any run of it into one token) or there is none.
        """
        if self._char_bound is None:
            return None
        return self._char_bound.max_chars(self.max_model_len)

    def default_sampling_params(self, **fields: Any) -> SamplingParams:
        """See :meth:`LLM.default_sampling_params`."""
        return self.llm.default_sampling_params(**fields)

    def render_chat(
        self,
        conversation: Conversation,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """See :meth:`LLM.render_chat` (runs on the caller's thread).

        A rendered conversation over :attr:`max_prompt_chars` is refused before
        it is tokenized.

        :raises InvalidFieldError: the rendered conversation cannot fit the model length.
        """
        text = render_chat_text(
            self.llm.tokenizer, conversation, add_generation_prompt, chat_template_kwargs
        )
        self._check_prompt_chars(text, "the rendered conversation", "messages")
        # the template writes the special tokens itself
        return text, self._encode(text, add_special_tokens=False)

    async def render_chat_async(
        self,
        conversation: Conversation,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """:meth:`render_chat` on the tokenizer threads, leaving the event loop free.

        :param conversation: ``[{"role": ..., "content": ...}, ...]``.
        :param add_generation_prompt: end with an open assistant turn.
        :param chat_template_kwargs: further template variables.
        :return: the prompt text and its token ids.
        :raises RequestError: as :meth:`render_chat`.
        """
        self._check_running()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenizer_pool,
            self.render_chat,
            conversation,
            add_generation_prompt,
            chat_template_kwargs,
        )

    async def encode_async(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Tokenize ``text`` on the tokenizer threads, leaving the event loop free.

        A text over :attr:`max_prompt_chars` is refused before it is tokenized.

        :param text: the text.
        :param add_special_tokens: apply the tokenizer's post-processor (a leading bos...).
        :return: the token ids.
        :raises RequestError: the text cannot be tokenized, or the model has no tokenizer.
        """
        self._check_running()

        def encode() -> list[int]:
            self._check_prompt_chars(text)
            return self._encode(text, add_special_tokens=add_special_tokens)

        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, encode)

    async def decode_async(self, token_ids: Sequence[int]) -> str:
        """:meth:`LLM.decode` (special tokens skipped) on the tokenizer threads.

        :param token_ids: the ids.
        :return: the text.
        """
        self._check_running()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, self.llm.decode, list(token_ids))

    def chat_params(self, sampling_params: SamplingParams) -> SamplingParams:
        """See :meth:`LLM.chat_params`."""
        return self.llm.chat_params(sampling_params)

    def snapshot(self) -> EngineSnapshot:
        """The engine's load after the loop's last iteration (any thread); with
        several replicas, their loads added up (:meth:`EngineSnapshot.total`)."""
        if len(self._replicas) == 1:
            return self._replicas[0].snapshot
        return EngineSnapshot.total(self.replica_snapshots())

    def replica_snapshots(self) -> list[EngineSnapshot]:
        """Each replica's load after its loop's last iteration (any thread).

        :return: one snapshot per replica, in replica order.
        """
        return [r.snapshot for r in self._replicas]

    @property
    def data_parallel_size(self) -> int:
        """How many engine replicas serve the requests."""
        return len(self._replicas)

    @property
    def is_alive(self) -> bool:
        """False once a loop stopped (shut down or a step failed)."""
        return all(r.is_alive for r in self._replicas)

    def add_finished_callback(self, callback: Callable[[RequestOutput], None]) -> None:
        """Call ``callback(output)`` on the engine loop for every request that finishes
        (aborted ones included). It must be quick and must not raise."""
        self._finished_callbacks.append(callback)

    # -- submitting ---------------------------------------------------------------------------

    def _check_prompt_chars(self, text: str, what: str = "prompt", field: str = "prompt") -> None:
        """Refuse ``text`` when it has more characters than a prompt that fits can have."""
        bound = self._char_bound
        if bound is None:
            return
        limit = bound.max_chars(self.max_model_len)
        # the length is free; counting the characters the tokenizer drops is not
        if len(text) <= limit:
            return
        n = bound.counted(text)
        if n > limit:
            raise InvalidFieldError(
                f"{what} ({n} characters) exceeds what the model length max_model_len="
                f"{self.max_model_len} can hold: at most {limit} characters (a token of this "
                f"model's tokenizer covers at most {bound.chars_per_token}); "
                "shorten the prompt",
                field=field,
            )

    def _encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Tokenize ``text`` on the calling thread, letting other threads run meanwhile."""
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            return self.llm.encode(text)  # raises the no-tokenizer error
        backend = getattr(tokenizer, "backend", None)
        try:
            if backend is not None and hasattr(backend, "encode_batch"):
                # ``encode_batch`` lets go of the GIL while it runs (``encode`` does not)
                enc = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
                return list(enc.ids)
            enc = tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return list(getattr(enc, "ids", enc))
        except (TypeError, ValueError) as exc:
            # e.g. a lone surrogate ("\ud800"), which no tokenizer can encode
            raise InvalidFieldError(
                f"the prompt cannot be tokenized ({type(exc).__name__}: {exc}); "
                "send valid Unicode text (no lone surrogates)",
                field="prompt",
            ) from None

    def _tokenize_sync(self, prompt: Prompt) -> tuple[Any, str | None]:
        if isinstance(prompt, str):
            self._check_prompt_chars(prompt)
            return self._encode(prompt), prompt
        return prompt, None

    def _stops_ahead_sync(
        self, params: SamplingParams | None, replica: int = 0
    ) -> StopAutomaton | None:
        """Check a request's stop strings against the limits and build their automaton.

        Both cost time in proportion to the stop strings (a fraction of a second
        for the largest allowed set), so they run on the caller's side, never on
        the engine loop, where every stream would wait. A structured-output
        grammar is compiled here too (into the cache of the engine of ``replica``,
        where its loop finds it), and a schema, regex or grammar that does not
        compile is refused here.
        """
        if not isinstance(params, SamplingParams):
            return None
        if params.structured_outputs is not None:
            engine = self._replicas[replica].llm.engine
            engine.structured_output.compile(params.structured_outputs)
        if not params.stop:
            return None
        self.llm._check_stops(params)
        return stop_automaton(tuple(params.stop))

    async def _stops_ahead(
        self, params: SamplingParams | None, replica: int
    ) -> StopAutomaton | None:
        if not isinstance(params, SamplingParams) or (
            not params.stop and params.structured_outputs is None
        ):
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenizer_pool, self._stops_ahead_sync, params, replica
        )

    async def _tokenize(self, prompt: Prompt) -> tuple[Any, str | None]:
        if not isinstance(prompt, str):
            return prompt, None
        self._check_running()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, self._tokenize_sync, prompt)

    def _check_running(self) -> None:
        """Refuse work once a loop stopped or is stopping (the tokenizer threads are gone)."""
        for replica in self._replicas:
            if replica.dead is not None:
                raise EngineDeadError(f"the engine loop is not running: {replica.dead}")
        if self._stopping:
            raise EngineDeadError("the engine loop is not running: the engine was shut down")

    def _new_id(self, request_id: str | None) -> str:
        if request_id is not None:
            return str(request_id)
        return f"{self._id_prefix}-{next(self._ids)}"

    def _assign(self, request_id: str) -> int:
        """Choose the replica of a new request (it counts there until it finishes)."""
        return self._balancer.assign(request_id)

    async def add_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_text: str | None = None,
    ) -> AsyncRequestStream:
        """Queue a request and return the stream of its outputs.

        :param prompt: text, a list of token ids or an int32 array.
        :param sampling_params: defaults to :meth:`default_sampling_params`.
        :param request_id: a unique id (default: generated).
        :param prompt_text: what ``RequestOutput.prompt`` shows for a token-id
            prompt (the rendered conversation of a chat).
        :return: the request's :class:`AsyncRequestStream`.
        :raises RequestError: the request is invalid (nothing is queued).
        :raises EngineOverloadedError: too many requests are waiting.
        :raises EngineDeadError: the engine loop is not running.
        """
        ids, text = await self._tokenize(prompt)
        rid = self._new_id(request_id)
        replica = self._assign(rid)
        try:
            automaton = await self._stops_ahead(sampling_params, replica)
        except BaseException:
            self._balancer.release(rid)
            raise
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[None] = loop.create_future()
        sink = _AsyncSink(loop)

        def done(exc: BaseException | None) -> None:
            def settle() -> None:
                if not accepted.done():
                    if exc is None:
                        accepted.set_result(None)
                    else:
                        accepted.set_exception(exc)

            loop.call_soon_threadsafe(settle)

        command = ("add", ids, sampling_params, rid, prompt_text or text, sink, done, automaton)
        self._replicas[replica].submit(command)
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(rid)  # queued after the add: it runs once the request exists
            raise
        return AsyncRequestStream(self, rid, sink)

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Generate for one prompt, yielding incremental outputs (the last finished).

        Leaving the ``async for`` early, or cancelling its task, aborts the request.

        :param prompt: text, a list of token ids or an int32 array.
        :param sampling_params: defaults to :meth:`default_sampling_params`.
        :param request_id: a unique id (default: generated).
        :raises RequestError: the request is invalid.
        """
        stream = await self.add_request(prompt, sampling_params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def chat(
        self,
        conversation: Conversation,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> AsyncRequestStream:
        """Queue one conversation, rendered with the chat template (see :meth:`LLM.chat`).

        :return: the request's :class:`AsyncRequestStream`.
        :raises RequestError: no template, malformed messages, or an invalid request.
        """
        text, ids = await self.render_chat_async(
            conversation, add_generation_prompt, chat_template_kwargs
        )
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = self.chat_params(sampling_params)
        return await self.add_request(ids, params, request_id, prompt_text=text)

    def submit(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_text: str | None = None,
    ) -> RequestStream:
        """Queue a request from a plain thread; blocks until the engine loop accepted it.

        :return: the request's :class:`RequestStream` (a blocking iterator).
        :raises RequestError: the request is invalid (nothing is queued).
        :raises EngineOverloadedError: too many requests are waiting.
        :raises EngineDeadError: the engine loop is not running.
        """
        ids, text = self._tokenize_sync(prompt)
        rid = self._new_id(request_id)
        replica = self._assign(rid)
        try:
            automaton = self._stops_ahead_sync(sampling_params, replica)
        except BaseException:
            self._balancer.release(rid)
            raise
        sink = _ThreadSink()
        accepted = threading.Event()
        error: list[BaseException] = []

        def done(exc: BaseException | None) -> None:
            if exc is not None:
                error.append(exc)
            accepted.set()

        runner = self._replicas[replica]
        runner.submit(
            ("add", ids, sampling_params, rid, prompt_text or text, sink, done, automaton)
        )
        while not accepted.wait(0.5):
            if not runner.is_alive:
                raise EngineDeadError("the engine loop stopped before accepting the request")
        if error:
            raise error[0]
        return RequestStream(self, rid, sink)

    def generate_sync(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt from a plain thread; return the finished outputs in order.

        Safe to call from many threads at once: the requests of every caller run
        in the same engine steps.

        :raises RequestError: a prompt is invalid (the ones already queued are aborted).
        """
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params: list[SamplingParams | None] = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise RequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        streams: list[RequestStream] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
                try:
                    streams.append(self.submit(p, sp))
                except RequestError as exc:
                    # name the prompt, keeping the error's type and fields (InvalidFieldError.field)
                    exc.args = (f"prompt {i}: {exc}", *exc.args[1:])
                    raise
            finals = []
            for s in streams:
                outs = list(s)  # incremental outputs; the last one is the finished request
                finals.append(outs[-1])
            return finals
        finally:
            for s in streams:
                s.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (any thread; returns at once).

        The engine loop runs the abort before its next step: the request's KV
        pages and state slot are freed then and its stream ends with
        ``finish_reason == "abort"`` unless it was closed. With several
        replicas the abort goes to the one holding the request.
        """
        owner = self._balancer.owner(request_id)
        for replica in self._replicas if owner is None else (self._replicas[owner],):
            replica.abort(request_id)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine loop and release the engine (model, caches, graphs).

        Live requests are aborted; streams still open end with :class:`EngineDeadError`.
        """
        self._stopping = True
        for replica in self._replicas:
            replica.stop()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout
        for replica in self._replicas:
            replica.join(max(0.0, deadline - time.monotonic()))


class _EngineLoop:
    """One engine replica and the thread that drives it (the *engine loop*).

    The loop takes the replica's queued adds and aborts between steps, steps
    its :class:`LLM` while any request is live and hands the outputs to the
    requests' sinks. It releases each request from the front's balancer when
    the request ends (finished, aborted or refused).

    :param llm: the replica's engine.
    :param index: the replica's number.
    :param front: the :class:`AsyncLLM` whose requests it runs.
    """

    def __init__(self, llm: LLM, index: int, front: AsyncLLM) -> None:
        self.llm = llm
        self.index = index
        self._front = front
        # errors name the replica only when there are several
        self._of = f" of replica {index}" if front._balancer.num_replicas > 1 else ""
        self._commands: deque[tuple[Any, ...]] = deque()
        self._commands_lock = threading.Lock()
        self._cancelled: set[str] = set()  # aborted while their add was still queued
        self._wake = threading.Event()
        self._sinks: dict[str, _AsyncSink | _ThreadSink] = {}
        self._stopping = False
        self._dead: BaseException | None = None
        self._snapshot = EngineSnapshot()
        self._snapshot = self._take_snapshot()
        name = "backplane-engine" + (f"-{index}" if self._of else "")
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    @property
    def snapshot(self) -> EngineSnapshot:
        """The replica's load after its loop's last iteration."""
        return self._snapshot

    @property
    def dead(self) -> BaseException | None:
        """Why the loop stopped (``None`` while it runs)."""
        return self._dead

    @property
    def is_alive(self) -> bool:
        """False once the loop stopped (shut down or a step failed)."""
        return self._dead is None and self._thread.is_alive()

    def start(self) -> None:
        """Start the loop's thread, the start-up heap frozen for it (see
        :mod:`backplane.core.gc_heap`; the loop gives its hold up when it stops)."""
        freeze_startup_heap()
        self._thread.start()

    def submit(self, command: tuple[Any, ...]) -> None:
        """Queue an add for the loop.

        :param command: ``("add", ids, params, request_id, text, sink, done, automaton)``.
        :raises EngineDeadError: the loop is not running.
        """
        if self._dead is not None:
            self._front._balancer.release(command[3])
            raise EngineDeadError(f"the engine loop{self._of} is not running: {self._dead}")
        with self._commands_lock:
            self._commands.append(command)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Queue an abort ahead of everything else (returns at once).

        :param request_id: the request's id.
        """
        if self._dead is None:
            with self._commands_lock:
                self._commands.appendleft(("abort", request_id))
            self._wake.set()

    def stop(self) -> None:
        """Ask the loop to stop after its current step."""
        self._stopping = True
        self._wake.set()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the loop's thread to end (not from that thread).

        :param timeout: seconds.
        """
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        llm = self.llm
        engine = llm.engine
        # a replica in this process hands running requests' outputs to their streams
        # unbuilt: their readers build them (one of another process comes built)
        step = llm.step_streamed if isinstance(llm, LLM) else llm.step
        failures = 0
        try:
            while not self._stopping:
                self._wake.clear()
                self._run_commands()
                if self._stopping:
                    break
                # tracked requests without engine work: aborts the next step reports
                if engine.has_unfinished_requests() or llm._tracked:
                    try:
                        outs = step()
                    except Exception as exc:
                        # a failed step is undone by the engine (its requests restart from their
                        # last committed token; one failing too often finishes with "error")
                        failures += 1
                        logger.exception("engine step failed (%d in a row)", failures)
                        # a lost worker process cannot come back: retrying would fail again
                        if failures >= _MAX_FAILED_STEPS or isinstance(exc, EngineFailedError):
                            raise
                        continue
                    failures = 0
                    self._deliver(outs)
                    self._snapshot = self._take_snapshot()
                else:
                    self._snapshot = self._take_snapshot()
                    self._wake.wait()
            reason: BaseException = EngineDeadError("the engine was shut down")
        except BaseException as exc:  # the engine keeps failing (or was interrupted): stop
            logger.exception("the engine loop%s failed; no more requests can run", self._of)
            reason = EngineDeadError(
                f"the engine loop{self._of} failed: {type(exc).__name__}: {exc}"
            )
        self._dead = reason
        self._release_all()
        self._snapshot = EngineSnapshot(alive=False)
        with released_startup_heap():
            if self._stopping:  # shut down on purpose: give the model's memory back too
                try:
                    self.llm.shutdown()
                except Exception:
                    logger.exception("releasing the engine failed")
        for rid, sink in list(self._sinks.items()):
            self._push(sink, reason)
            self._sinks.pop(rid, None)
            self._front._balancer.release(rid)
        with self._commands_lock:
            pending, self._commands = list(self._commands), deque()
        for cmd in pending:
            if cmd[0] == "add":
                self._front._balancer.release(cmd[3])
                cmd[-1](reason)

    def _release_all(self) -> None:
        """Abort every live request so the engine holds no pages once the loop ends."""
        llm = self.llm
        try:
            for rid in list(llm._tracked):
                llm.abort(rid)
            for _ in range(3):  # collect the abort reports (and a step still in flight)
                if not (llm.engine.has_unfinished_requests() or llm._tracked):
                    break
                llm.step()
        except Exception:
            logger.exception("could not abort the live requests while stopping")

    def _run_commands(self) -> None:
        while True:
            with self._commands_lock:
                if not self._commands:
                    return
                cmd = self._commands.popleft()
                if cmd[0] == "abort" and cmd[1] not in self.llm._tracked:
                    # aborts jump the queue: one may overtake the add of its own request
                    if any(c[0] == "add" and c[3] == cmd[1] for c in self._commands):
                        self._cancelled.add(cmd[1])
            if cmd[0] == "abort":
                rid = cmd[1]
                self._sinks.pop(rid, None)
                if self.llm.abort(rid):
                    logger.debug("request %s aborted", rid)
                continue
            _, ids, params, rid, text, sink, done, automaton = cmd
            if rid in self._cancelled:
                self._cancelled.discard(rid)
                self._front._balancer.release(rid)
                done(RequestError(f"request {rid!r} was aborted before it started"))
                continue
            try:
                cap = self._front.max_waiting_requests
                if cap is not None and self.llm.engine.scheduler.num_waiting >= cap:
                    raise EngineOverloadedError(
                        f"{cap} requests are already waiting for the engine "
                        "(max_waiting_requests); retry later"
                    )
                self.llm._add_tokens(ids, params, rid, text, stop_automaton=automaton)
            except BackplaneError as exc:
                self._front._balancer.release(rid)
                done(exc)
                continue
            except Exception as exc:  # a malformed prompt object: the caller's error, not ours
                self._front._balancer.release(rid)
                done(RequestError(f"request {rid!r}: {type(exc).__name__}: {exc}"))
                continue
            self._sinks[rid] = sink
            done(None)

    def _deliver(self, outs: list[RequestOutput | PendingOutput]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_AsyncSink, Any]]] = {}
        for out in outs:
            rid = out.request_id
            sink = self._sinks.get(rid)
            if out.finished:
                self._sinks.pop(rid, None)
                self._front._balancer.release(rid)
                for cb in self._front._finished_callbacks:
                    try:
                        cb(out)
                    except Exception:
                        logger.exception("a finished-request callback failed")
            if sink is None:
                continue
            if isinstance(sink, _AsyncSink):
                batches.setdefault(sink.loop, []).append((sink, out))
            else:
                sink.queue.put(out)
        # one wake-up per event loop per step, not one per request
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: its callers are gone
                pass

    @staticmethod
    def _push(sink: _AsyncSink | _ThreadSink, item: Any) -> None:
        if isinstance(sink, _AsyncSink):
            try:
                sink.loop.call_soon_threadsafe(sink.put, item)
            except RuntimeError:
                pass
        else:
            sink.queue.put(item)

    def _take_snapshot(self) -> EngineSnapshot:
        engine = self.llm.engine
        sched = engine.scheduler
        kv = engine.kv_manager
        stats = kv.stats
        return EngineSnapshot(
            running=sched.num_running,
            waiting=sched.num_waiting,
            kv_pages_used=int(kv.num_used_pages),
            kv_pages_total=int(kv.pool.num_usable),
            prefix_cache_queries=int(stats.lookup_pages),
            prefix_cache_hits=int(stats.device_hit_pages + stats.host_hit_pages),
            steps=int(sched.stats.steps),
            alive=self._dead is None,
        )


def _put_all(items: list[tuple[_AsyncSink, Any]]) -> None:
    """Queue one step's outputs for their readers (on the readers' event loop).

    :param items: ``(sink, output)`` pairs.
    """
    for sink, item in items:
        sink.put(item)
