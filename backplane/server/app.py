"""The OpenAI-compatible HTTP server: a FastAPI app over one :class:`AsyncLLM`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamed
as server-sent events ending in ``data: [DONE]``, or not), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /version``, and the
tokenizer's ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``
(:mod:`backplane.server.tokenize`).

Errors use OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``:
a bad request is a 400 that says what was wrong (never a 500), a missing or
wrong API key 401, an unknown model 404, a body over the size limit 413, a full
waiting queue or a stopped engine 503. A request whose client disconnects is
aborted, which frees its KV pages.

No request blocks the event loop: prompts are tokenized and chats rendered on
the engine's tokenizer threads, and detokenized on its engine loop; a text
prompt too long in characters to fit the model is refused before tokenizing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from backplane import __version__ as backplane_version
from backplane.api.async_llm import (
    AsyncLLM,
    AsyncRequestStream,
    EngineDeadError,
    EngineOverloadedError,
)
from backplane.api.llm import split_samples
from backplane.api.outputs import RequestOutput
from backplane.core.errors import BackplaneError, OutOfKVMemoryError, RequestError
from backplane.server.chat_output import ChatDeltas, ChatFormats
from backplane.server.metrics import CONTENT_TYPE, ServerMetrics
from backplane.server.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    completion_prompts,
    sampling_params,
)
from backplane.server.tokenize import add_tokenizer_routes

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_BODY_BYTES", "build_app"]

#: Default cap on a request body (a prompt of token ids near the model length fits easily).
DEFAULT_MAX_BODY_BYTES = 8 * 2**20

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error JSON."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def _error(message: str, status: int, param: str | None = None, code: str | None = None) -> Any:
    return JSONResponse(error_body(message, status, param, code), status_code=status)


class _BodyLimitAndAuth:
    """ASGI middleware: the request-body size limit and the API key of ``/v1`` routes.

    The size is checked on ``Content-Length`` before the body is read, and
    counted while it is read (a chunked body has no length).
    """

    def __init__(self, app: Any, *, max_body_bytes: int, api_key: str | None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"].startswith("/v1"):
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()
            ):
                await _error(
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                    "with the key the server was started with (--api-key)",
                    401,
                    code="invalid_api_key",
                )(scope, receive, send)
                return
        limit = self.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _too_large(limit)(scope, receive, send)
            return
        seen = 0

        async def counted_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, _too_large_message(limit))
            return message

        await self.app(scope, counted_receive, send)


def _too_large_message(limit: int) -> str:
    return (
        f"the request body is larger than the server's limit of {limit} bytes "
        "(--max-request-body-bytes); send a shorter prompt"
    )


def _too_large(limit: int) -> Any:
    return _error(_too_large_message(limit), 413, code="request_too_large")


def build_app(
    engine: AsyncLLM,
    *,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics: ServerMetrics | None = None,
    tool_call_parser: str = "auto",
    reasoning_parser: str | None = None,
) -> FastAPI:
    """Build the server's FastAPI application.

    :param engine: the engine that runs every request.
    :param model_name: the name ``/v1/models`` lists and requests must use
        (a request without ``model`` gets it too).
    :param api_key: when set, ``/v1`` routes need ``Authorization: Bearer <api_key>``.
    :param max_body_bytes: larger request bodies get 413.
    :param metrics: the metrics registry (a new one by default).
    :param tool_call_parser: the format of the model's tool calls (``"auto"``: by its family).
    :param reasoning_parser: returns ``<think>`` text as ``reasoning_content``
        (``deepseek_r1``, ``qwen3``; ``None``: only for requests that ask).
    :return: the application (serve it with uvicorn).
    :raises ConfigError: an unknown parser name.
    """
    chat_formats = ChatFormats.for_engine(engine, tool_call_parser, reasoning_parser)
    app = FastAPI(title="backplane", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = metrics if metrics is not None else ServerMetrics(engine, model_name)
    app.state.engine = engine
    app.state.metrics = metrics
    created = int(time.time())
    app.add_middleware(_BodyLimitAndAuth, max_body_bytes=max_body_bytes, api_key=api_key)

    # -- errors -------------------------------------------------------------------------------

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Any:
        errors = exc.errors()
        parts, param = [], None
        for e in errors[:5]:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            where = ".".join(loc) or "body"
            param = param or (loc[0] if loc else None)
            if e.get("type") == "json_invalid":
                parts.append(f"the body is not valid JSON ({e.get('ctx', {}).get('error', '')})")
                param = None
                break
            elif e.get("type") == "extra_forbidden":
                parts.append(f"{where}: unknown field")
            else:
                parts.append(f"{where}: {e.get('msg')}")
        return _error("; ".join(parts) or "invalid request body", 400, param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Any:
        code = "request_too_large" if exc.status_code == 413 else None
        return _error(str(exc.detail), exc.status_code, code=code)

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest) -> Any:
        return _error(exc.message, exc.status, exc.param, exc.code)

    @app.exception_handler(BackplaneError)
    async def _backplane(request: Request, exc: BackplaneError) -> Any:
        return _engine_error(exc)

    # -- routes -------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Any:
        if not engine.is_alive:
            return _error("the engine loop is not running", 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Any:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Any:
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "backplane",
            "root": str(engine.llm.engine.config.model),
            "max_model_len": engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise BadRequest(
                f"the model {name!r} does not exist; this server serves {model_name!r}",
                "model",
                status=404,
                code="model_not_found",
            )

    @app.get("/version")
    async def version() -> Any:
        return JSONResponse({"version": backplane_version})

    add_tokenizer_routes(app, engine, _parse_body, check_model)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await _parse_body(request, CompletionRequest)
        check_model(body.model)
        prompts = completion_prompts(body.prompt)
        base = engine.default_sampling_params()
        # max_tokens 0 (echo only): the prefill that scores the prompt samples one token,
        # which the answer leaves out
        prompt_only = body.max_tokens == 0
        max_tokens = body.max_tokens if body.max_tokens is not None else base.max_tokens
        params = sampling_params(body, base, max_tokens=1 if prompt_only else max_tokens)
        rid = f"cmpl-{uuid.uuid4().hex}"
        samples = split_samples(params)
        if body.echo and params.prompt_logprobs is not None:
            # each echoed choice shows its prompt's logprobs, a stream's in its first chunk
            samples = [
                dataclasses.replace(sp, prompt_logprobs=params.prompt_logprobs) for sp in samples
            ]
        # choice i * n + j is sample j of prompt i
        streams = await _start(
            [
                lambda p=p, sp=sp, k=i * len(samples) + j: engine.add_request(p, sp, f"{rid}-{k}")
                for i, p in enumerate(prompts)
                for j, sp in enumerate(samples)
            ],
            [
                f"prompt {i}: " if len(prompts) > 1 else ""
                for i in range(len(prompts))
                for _ in samples
            ],
        )
        echo_texts: list[str] = []
        if body.echo:
            try:  # the engine has checked the token ids of the prompts given as ids
                echo_texts = [
                    p if isinstance(p, str) else await engine.decode_async(p) for p in prompts
                ]
            except BaseException:
                for s in streams:
                    s.abort()
                raise
        head = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }

        offsets: dict[int, int] = {}  # characters of each choice's tokens already sent
        sent: dict[int, int] = {}  # tokens of each choice whose logprobs were sent
        echoed: set[int] = set()  # choices whose prompt was sent
        n = len(samples)

        def choice(i: int, out: RequestOutput, final: bool) -> dict[str, Any]:
            text, logprobs = "", None
            if body.echo and (final or i not in echoed):
                # the prompt comes first: the whole answer, or a stream's first chunk
                echoed.add(i)
                text = echo_texts[i // n]
                if params.logprobs is not None:
                    logprobs, offsets[i] = _echo_logprobs(engine, out, params.logprobs)
            if not prompt_only:
                text += out.text if final else out.new_text
                if params.logprobs is not None:
                    ids, entries = _logprobs_since(out, 0 if final else sent.get(i, 0))
                    sent[i] = len(out.outputs[0].token_ids)
                    more, offsets[i] = _completion_logprobs(ids, entries, offsets.get(i, 0))
                    logprobs = more if logprobs is None else _joined(logprobs, more)
            c = {
                "index": i,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": out.finish_reason if out.finished else None,
                "stop_reason": out.stop_reason if out.finished else None,
            }
            if prompt_only and out.finished:
                c["finish_reason"], c["stop_reason"] = "length", None
            if final:
                c["prompt_logprobs"] = None
            return c

        def usage(outs: Sequence[RequestOutput]) -> dict[str, int]:
            counts = _usage(outs)
            if prompt_only:
                counts["completion_tokens"] = 0
                counts["total_tokens"] = counts["prompt_tokens"]
            return counts

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(streams, head, lambda i, out: [choice(i, out, False)], include_usage, usage)
        outs = await _collect(streams, request)
        if outs is None:
            return Response(status_code=499)
        choices = [choice(i, o, True) for i, o in enumerate(outs)]
        if body.prompt_logprobs is not None:
            # every choice of a prompt shows the prompt's logprobs (its sample 0 computed them)
            for i, c in enumerate(choices):
                c["prompt_logprobs"] = _prompt_logprobs(outs[i - i % n].prompt_logprobs)
        return JSONResponse({**head, "choices": choices, "usage": usage(outs)})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await _parse_body(request, ChatCompletionRequest)
        check_model(body.model)
        messages, template_kwargs, output = chat_formats.prepare(body, chat_messages(body.messages))
        # templating and tokenizing run on the engine's tokenizer threads, off this event loop
        text, ids = await engine.render_chat_async(
            messages, body.add_generation_prompt, template_kwargs
        )
        base = engine.default_sampling_params()
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # as much as the context leaves
            max_tokens = max(engine.max_model_len - len(ids), 1)
        params = engine.chat_params(sampling_params(body, base, max_tokens=max_tokens))
        params = chat_formats.constrain(body, params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await _start(
            [
                lambda sp=sp, j=j: engine.add_request(ids, sp, f"{rid}-{j}", prompt_text=text)
                for j, sp in enumerate(split_samples(params))
            ]
        )
        created_at = int(time.time())
        if body.stream:
            head = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created_at,
                "model": model_name,
            }
            greeted: set[int] = set()
            sent: dict[int, int] = {}  # tokens of each choice whose logprobs were sent
            deltas: dict[int, ChatDeltas] = {}

            def chunks(i: int, out: RequestOutput) -> list[dict[str, Any]]:
                delta: dict[str, Any] = {}
                if i not in greeted:  # each choice's first chunk names the role
                    delta["role"] = "assistant"
                    greeted.add(i)
                reader = deltas.setdefault(i, ChatDeltas(output))
                delta.update(reader.update(out.text, final=out.finished))
                if "role" in delta:
                    delta.setdefault("content", "")
                logprobs = None
                if params.logprobs is not None:
                    ids, entries = _logprobs_since(out, sent.get(i, 0))
                    sent[i] = len(out.outputs[0].token_ids)
                    logprobs = _chat_logprobs(ids, entries, params.logprobs)
                return [
                    {
                        "index": i,
                        "delta": delta,
                        "logprobs": logprobs,
                        "finish_reason": (
                            reader.finish_reason(out.finish_reason) if out.finished else None
                        ),
                        "stop_reason": out.stop_reason if out.finished else None,
                    }
                ]

            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(streams, head, chunks, include_usage)
        outs = await _collect(streams, request)
        if outs is None:
            return Response(status_code=499)
        head = {"id": rid, "object": "chat.completion", "created": created_at, "model": model_name}
        choices = []
        for i, o in enumerate(outs):
            message, finish_reason = output.message(o.text, o.finish_reason)
            logprobs = None
            if params.logprobs is not None:
                logprobs = _chat_logprobs(*_logprobs_since(o, 0), params.logprobs)
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": o.stop_reason,
                }
            )
        return JSONResponse({**head, "choices": choices, "usage": _usage(outs)})

    return app


# -- helpers ----------------------------------------------------------------------------------------

_Body = TypeVar("_Body", bound=BaseModel)


#: Bodies up to this size are decoded on the event loop (well under a millisecond).
_INLINE_BODY_BYTES = 64 * 1024

#: One thread decodes the larger bodies: ``json.loads`` holds the GIL, so more threads
#: would not decode faster, only make the event loop wait for the GIL behind more of them.
_body_decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="backplane-body")


async def _parse_body(request: Request, model: type[_Body]) -> _Body:
    """The request's JSON body as ``model``; a large one decoded off the event loop.

    Decoding a body of several megabytes takes long enough to stall every other
    connection if it ran on the event loop (as FastAPI's own body parameters do).

    :param request: the HTTP request.
    :param model: the body's pydantic model.
    :return: the validated body.
    :raises RequestValidationError: the body is not JSON or does not fit ``model``
        (answered 400 by the app's handler, as FastAPI's own errors are).
    """
    raw = await request.body()
    content_type = request.headers.get("content-type")
    if len(raw) <= _INLINE_BODY_BYTES:
        return _decode_body(raw, content_type, model)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_body_decoder, _decode_body, raw, content_type, model)


def _decode_body(raw: bytes, content_type: str | None, model: type[_Body]) -> _Body:
    """Decode and validate a request body (on a worker thread); see :func:`_parse_body`."""
    data: Any = None
    if raw:
        media = (content_type or "application/json").split(";", 1)[0].strip().lower()
        if media == "application/json" or media.endswith("+json"):
            try:
                data = json.loads(raw)
            except (ValueError, RecursionError) as exc:
                # JSONDecodeError, bytes that are not UTF-8, or nesting too deep to decode
                if isinstance(exc, json.JSONDecodeError):
                    pos, why = exc.pos, exc.msg
                elif isinstance(exc, UnicodeDecodeError):
                    pos, why = exc.start, f"not UTF-8: {exc.reason}"
                else:
                    pos, why = (
                        0,
                        "nested too deeply" if isinstance(exc, RecursionError) else str(exc),
                    )
                raise RequestValidationError(
                    [
                        {
                            "type": "json_invalid",
                            "loc": ("body", pos),
                            "msg": "JSON decode error",
                            "input": {},
                            "ctx": {"error": why},
                        }
                    ]
                ) from None
        else:
            data = raw
    if data is None:
        raise RequestValidationError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise RequestValidationError(
            [{**e, "loc": ("body", *e.get("loc", ()))} for e in errors]
        ) from None


def _logprobs_since(out: RequestOutput, start: int) -> tuple[list[int], list[dict[int, Any]]]:
    """The tokens of ``outputs[0]`` from ``start`` on and their logprobs.

    A stream sends a chunk only when the text grows, so a chunk carries the
    logprobs of every token since the previous chunk, not only this output's.
    """
    c = out.outputs[0]
    return list(c.token_ids[start:]), list((c.logprobs or [])[start:])


def _completion_logprobs(
    ids: Sequence[int], entries: Sequence[dict[int, Any]], offset: int
) -> tuple[dict[str, Any], int]:
    """OpenAI completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset).

    :param offset: characters of the choice's tokens before these.
    :return: the object, and the offset after these tokens.
    """
    tokens, token_logprobs, top, text_offset = [], [], [], []
    for tok, d in zip(ids, entries, strict=False):
        s = d[tok].decoded_token or ""
        tokens.append(s)
        token_logprobs.append(d[tok].logprob)
        # as vLLM: the sampled token and the top k, by text
        top.append({(v.decoded_token or ""): v.logprob for v in d.values()})
        text_offset.append(offset)
        offset += len(s)
    return _logprobs_object(tokens, token_logprobs, top, text_offset), offset


def _echo_logprobs(engine: AsyncLLM, out: RequestOutput, k: int) -> tuple[dict[str, Any], int]:
    """OpenAI completions ``logprobs`` of an echoed prompt: ``None`` for its first token
    (nothing comes before it), then each token's logprob and the ``k`` most likely.

    :param engine: the engine, whose tokenizer spells the first token.
    :param out: an output of the request, holding its prompt logprobs.
    :param k: the request's ``logprobs``: how many alternatives each position shows.
    :return: the object, and the characters its tokens cover.
    """
    ids = out.prompt_token_ids
    positions = out.prompt_logprobs or []
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    offset = 0
    for j, tok in enumerate(ids):
        d = positions[j] if j < len(positions) else None
        if d is None or tok not in d:
            s = engine.llm.decode([tok])  # one token: too short to leave the event loop for
            token_logprobs.append(None)
            top.append(None)
        else:
            s = d[tok].decoded_token or ""
            token_logprobs.append(d[tok].logprob)
            # the prompt token and the k most likely, by text, as for generated tokens
            top.append(
                {
                    (v.decoded_token or ""): v.logprob
                    for t, v in d.items()
                    if t == tok or (v.rank is not None and v.rank <= k)
                }
            )
        tokens.append(s)
        text_offset.append(offset)
        offset += len(s)
    return _logprobs_object(tokens, token_logprobs, top, text_offset), offset


def _logprobs_object(
    tokens: list[str],
    token_logprobs: list[float | None],
    top: list[dict[str, float] | None],
    text_offset: list[int],
) -> dict[str, Any]:
    """OpenAI completions' ``logprobs`` object from its four parallel lists."""
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": text_offset,
    }


def _joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two completions ``logprobs`` objects as one (the prompt's, then the completion's)."""
    return {key: first[key] + then[key] for key in first}


def _prompt_logprobs(positions: Sequence[dict[int, Any] | None] | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs`` of a completion choice: ``None`` for the first prompt
    token, then ``{token_id: {"logprob", "rank", "decoded_token"}}`` per prompt token."""
    if positions is None:
        return None
    return [
        None
        if d is None
        else {
            str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token}
            for t, v in d.items()
        }
        for d in positions
    ]


def _chat_logprobs(ids: Sequence[int], entries: Sequence[dict[int, Any]], k: int) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def one(lp: Any) -> dict[str, Any]:
        s = lp.decoded_token or ""
        return {"token": s, "logprob": lp.logprob, "bytes": list(s.encode("utf-8"))}

    content = []
    for tok, d in zip(ids, entries, strict=False):
        ranked = sorted((v for v in d.values() if v.rank is not None and v.rank <= k), key=_rank)
        content.append({**one(d[tok]), "top_logprobs": [one(v) for v in ranked[:k]]})
    return {"content": content}


def _rank(lp: Any) -> int:
    return int(lp.rank)


def _engine_error(exc: BaseException) -> Any:
    if isinstance(exc, EngineOverloadedError):
        return _error(str(exc), 503, code="overloaded")
    if isinstance(exc, EngineDeadError):
        return _error(str(exc), 503, code="engine_dead")
    if isinstance(exc, RequestError | OutOfKVMemoryError):
        field = getattr(exc, "field", None)
        if field == "prompt_token_ids":
            field = "prompt"
        return _error(str(exc), 400, field or ("prompt" if "prompt" in str(exc) else None))
    return _error(str(exc), 400)


async def _start(
    adds: Sequence[Callable[[], Awaitable[AsyncRequestStream]]],
    labels: Sequence[str] | None = None,
) -> list[AsyncRequestStream]:
    """Queue every request of an HTTP request; all or nothing.

    :param adds: one coroutine factory per engine request.
    :param labels: what to put before a refused request's message (``"prompt 2: "``).
    """
    streams: list[AsyncRequestStream] = []
    try:
        for i, add in enumerate(adds):
            try:
                streams.append(await add())
            except RequestError as exc:
                if not labels or not labels[i]:
                    raise
                raise RequestError(labels[i] + str(exc)) from None
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


async def _merge(streams: list[AsyncRequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, s: AsyncRequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _collect(
    streams: list[AsyncRequestStream], request: Request
) -> list[RequestOutput] | None:
    """The final output of every stream, or ``None`` (all aborted) if the client disconnects."""

    async def gather() -> list[RequestOutput]:
        finals: list[Any] = [None] * len(streams)
        async for i, out in _merge(streams):
            if out.finished:
                finals[i] = out
        return finals

    async def disconnected() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)

    work = asyncio.create_task(gather())
    watch = asyncio.create_task(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
        for s in streams:
            s.abort()
    if work in done:
        return work.result()
    logger.info("client disconnected; request %s aborted", streams[0].request_id)
    return None


def _usage(outs: Sequence[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _sse(
    streams: list[AsyncRequestStream],
    head: dict[str, Any],
    choices: Callable[[int, RequestOutput], list[dict[str, Any]]],
    include_usage: bool,
    usage: Callable[[Sequence[RequestOutput]], dict[str, int]] | None = None,
) -> StreamingResponse:
    """A server-sent-event response: one chunk per output that adds text or finishes.

    :param streams: the engine requests, one per choice.
    :param head: the fields every chunk starts with.
    :param choices: the chunk's choices for one output of choice ``i``.
    :param include_usage: end with a chunk of token counts and no choices.
    :param usage: those counts from the final outputs (by default every token generated).
    """
    usage = usage or _usage

    async def events() -> AsyncIterator[str]:
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in _merge(streams):
                if out.finished:
                    finals[i] = out
                elif not out.new_text:
                    continue  # tokens that do not make a whole character yet
                yield _event({**head, "choices": choices(i, out)})
            if include_usage:
                counts = usage([finals[i] for i in sorted(finals)])
                yield _event({**head, "choices": [], "usage": counts})
        except BackplaneError as exc:  # the engine stopped mid-stream
            yield _event(error_body(str(exc), 503))
        finally:
            # a client that went away cancels this generator: free its requests' pages
            for s in streams:
                s.abort()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
