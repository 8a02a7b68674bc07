"""The OpenAI-compatible request bodies, and their translation to :class:`SamplingParams`.

Field names and defaults follow OpenAI's API, with vLLM's extra sampling
fields (``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``...). Unknown
fields are refused (a misspelled option silently ignored would change results
without a word). Everything is checked before a request reaches the engine;
a bad value is a :class:`BadRequest` naming the field.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from backplane.core.errors import RequestError
from backplane.engine.sampling import SamplingParams

__all__ = [
    "BadRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "chat_messages",
    "completion_prompts",
    "sampling_params",
]


class BadRequest(Exception):
    """A request the server refuses with status 400 (or ``status``).

    :param message: what was wrong and what to do.
    :param param: the request field at fault, if one is.
    :param status: the HTTP status.
    :param code: OpenAI's error code string, if any.
    """

    def __init__(
        self, message: str, param: str | None = None, *, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    """One message of a conversation (extra fields go to the chat template as they are)."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


# -- translation -------------------------------------------------------------------------------


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completion request (``prompt`` may hold several).

    :raises BadRequest: an empty prompt or list.
    """
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequest("prompt is empty; give text, token ids or a list of those", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    for i, p in enumerate(prompt):
        if isinstance(p, list) and not p:
            raise BadRequest(f"prompt[{i}] is an empty list of token ids", "prompt")
    return list(prompt)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (text parts of a content list joined).

    :raises BadRequest: no messages, or a content part that is not text.
    """
    if not messages:
        raise BadRequest("messages is empty; give at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        msg = m.model_dump(exclude_none=True)
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(
                        f"messages[{i}].content[{j}] has type {part.get('type')!r}; only text "
                        'parts ({"type": "text", "text": ...}) are supported',
                        "messages",
                    )
                texts.append(part["text"])
            msg["content"] = "\n".join(texts)
        elif content is None:
            msg["content"] = ""
        out.append(msg)
    return out


#: Features of OpenAI's / vLLM's API this server refuses (with the reason) rather than ignore.
def _unsupported(req: _Sampling) -> tuple[str, str] | None:
    checks: list[tuple[bool, str, str]] = [
        (bool(req.logit_bias), "logit_bias", "logit_bias is not supported"),
    ]
    if isinstance(req, CompletionRequest):
        checks += [
            (req.echo, "echo", "echo is not supported"),
            (req.best_of not in (None, 1), "best_of", "best_of is not supported"),
            (bool(req.suffix), "suffix", "suffix is not supported"),
            (
                req.prompt_logprobs is not None and req.stream,
                "prompt_logprobs",
                "prompt_logprobs is not available with stream=true (as in vLLM)",
            ),
        ]
    else:
        checks += [
            (
                req.top_logprobs is not None and not req.logprobs,
                "top_logprobs",
                "top_logprobs needs logprobs set to true",
            ),
        ]
    for bad, param, why in checks:
        if bad:
            return param, why
    return None


_FIELD = re.compile(r"SamplingParams\.(\w+)=")


def sampling_params(
    req: _Sampling, base: SamplingParams, *, max_tokens: int | None
) -> SamplingParams:
    """The engine's parameters for a request.

    :param req: the request body.
    :param base: the model's defaults (``generation_config.json``), which fields
        the request leaves out keep.
    :param max_tokens: the request's token limit after defaults (``None``: ``base``'s).
    :return: validated :class:`SamplingParams`.
    :raises BadRequest: an unsupported feature or an invalid value, naming the field.
    """
    unsupported = _unsupported(req)
    if unsupported is not None:
        param, why = unsupported
        raise BadRequest(f"{param}: {why}", param)
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "min_tokens": req.min_tokens,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    values = {k: v for k, v in fields.items() if v is not None}
    values["ignore_eos"] = req.ignore_eos
    values["n"] = req.n
    values["stop"] = req.stop
    values["include_stop_str_in_output"] = req.include_stop_str_in_output
    if req.stop_token_ids:
        values["stop_token_ids"] = tuple(req.stop_token_ids)
    # completions: logprobs=k; chat: logprobs=true with top_logprobs=k (0 by default)
    logprobs_field = "logprobs"
    if isinstance(req, CompletionRequest):
        values["logprobs"] = req.logprobs
        values["prompt_logprobs"] = req.prompt_logprobs
    elif req.logprobs:
        values["logprobs"] = req.top_logprobs or 0
        logprobs_field = "top_logprobs" if req.top_logprobs else "logprobs"
    try:
        return dataclasses.replace(base, **values)
    except RequestError as exc:
        m = _FIELD.search(str(exc))
        field = getattr(exc, "field", None) or (m.group(1) if m else None)
        if field == "logprobs":
            field = logprobs_field
        raise BadRequest(str(exc), field) from None
