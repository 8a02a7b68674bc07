"""The OpenAI-compatible request bodies, and their translation to :class:`SamplingParams`.

Field names and defaults follow OpenAI's API, with vLLM's extra sampling
fields (``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``...). Unknown
fields are refused (a misspelled option silently ignored would change results
without a word). Everything is checked before a request reaches the engine;
a bad value is a :class:`BadRequest` naming the field.

The sampling fields are not typed or ranged here: each is checked by its row of
the engine's own table (:func:`~backplane.engine.sampling.check_field`) when
the body is parsed, so the server and the Python API accept the same values
and refuse the others with the same message (``true`` is not a token count,
``"10"`` is not a number). Token ids of a prompt are checked by the engine,
as they are for a Python caller. Strings that are not UTF-8 text (a lone
surrogate, ``"\\ud800"``) are refused anywhere in a body.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from backplane.api.tools import check_tool_choice, check_tools
from backplane.core.errors import InvalidFieldError, RequestError
from backplane.core.text import find_invalid_text
from backplane.engine.sampling import SamplingParams, check_field
from backplane.models.chat import check_template_kwargs
from backplane.server.response_format import structured_outputs_of

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


def _refuse_invalid_text(data: Any) -> Any:
    """Refuse a body holding a string that is not UTF-8 text, naming the field it is in."""
    if isinstance(data, dict):
        for key, value in data.items():
            where = find_invalid_text({key: value}, "")
            if where is not None:
                name = where[1:]
                raise BadRequest(
                    f"{name} holds a string that is not UTF-8 text (a lone surrogate such as "
                    "\\ud800); send valid Unicode text",
                    name.split(".")[0].split("[")[0],
                )
    return data


#: Body fields that are :class:`SamplingParams` fields of the same name, checked by its table.
_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "stop_token_ids",
    "seed",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "include_stop_str_in_output",
)


def _checked(body: BaseModel, fields: dict[str, str]) -> None:
    """Check and normalise body fields by the engine's table, in place.

    :param body: the parsed body.
    :param fields: body field -> :class:`SamplingParams` field, for each field to check.
    :raises BadRequest: the table's message, naming the body field.
    """
    for name, rule in fields.items():
        value = getattr(body, name)
        if value is None:
            continue
        try:
            checked = check_field(rule, value)
        except InvalidFieldError as exc:
            raise BadRequest(str(exc), name) from None
        if checked is not value:
            object.__setattr__(body, name, checked)


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions.

    The sampling fields hold what the client sent until the body's validator
    has checked them by the engine's table (then their normalised values).
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    min_p: Any = None
    n: Any = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None
    stop_token_ids: Any = None
    seed: Any = None
    ignore_eos: Any = False
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    include_stop_str_in_output: Any = False
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # structured output: both become one StructuredOutputsParams in structured_outputs
    response_format: Any = None
    structured_outputs: Any = None

    # BadRequest is no ValueError: it leaves pydantic as it is and the server answers it
    # with its own message and field, not as a schema error
    _refuse_text = model_validator(mode="before")(_refuse_invalid_text)

    @model_validator(mode="after")
    def _check_sampling(self) -> _Sampling:
        fields = {name: name for name in _SAMPLING_FIELDS}
        if self._prompt_only():
            del fields["max_tokens"]  # 0 is not an engine value; the server answers it alone
        _checked(self, fields)
        try:
            self.structured_outputs = structured_outputs_of(
                self.response_format, self.structured_outputs
            )
        except InvalidFieldError as exc:
            raise BadRequest(str(exc), exc.field) from None
        return self

    def _prompt_only(self) -> bool:
        """Whether the body asks for no new tokens (``max_tokens: 0``), which only
        completions' ``echo`` allows."""
        return False


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either
    (:func:`completion_prompts` checks its shape; the engine checks token ids)."""

    prompt: Any
    logprobs: Any = None
    prompt_logprobs: Any = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> CompletionRequest:
        _checked(self, {"logprobs": "logprobs", "prompt_logprobs": "prompt_logprobs"})
        return self

    def _prompt_only(self) -> bool:
        zero = self.max_tokens == 0 and type(self.max_tokens) is int
        if zero and not self.echo:
            raise BadRequest(
                "max_tokens is 0, which asks for no completion: it is only allowed with "
                "echo=true (to score the prompt with logprobs); ask for at least 1 token "
                "or set echo",
                "max_tokens",
            )
        return zero


class ChatMessage(BaseModel):
    """One message of a conversation (extra fields go to the chat template as they are)."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: Any = None
    logprobs: bool = False
    top_logprobs: Any = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    include_reasoning: bool | None = None

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        try:
            if self.tools is not None:
                self.tools = check_tools(self.tools)
            self.tool_choice = check_tool_choice(self.tool_choice, self.tools)
        except InvalidFieldError as exc:
            raise BadRequest(str(exc), exc.field) from None
        return self

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        _checked(self, {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"})
        if self.max_completion_tokens is not None:
            # it wins over max_tokens; held in both, a refused 0 is never skipped as unset
            self.max_tokens = self.max_completion_tokens
        check_chat_template_kwargs(self.chat_template_kwargs)
        return self


# -- translation -------------------------------------------------------------------------------


_PROMPT_FORMS = (
    "give text, a list of token ids, or a list of several texts or several lists of token ids"
)


def check_chat_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """Refuse template variables the chat template cannot take, as a 400.

    :param kwargs: a request's ``chat_template_kwargs`` (``None``: none given).
    :raises BadRequest: a reserved name, or text that is not UTF-8.
    """
    if kwargs is None:
        return
    try:
        check_template_kwargs(kwargs)
    except InvalidFieldError as exc:
        raise BadRequest(str(exc), exc.field) from None


def completion_prompts(prompt: Any) -> list[Any]:
    """The prompts of a completion request (``prompt`` may hold several).

    Only the shape is checked here: the items of a token-id list go to the
    engine as they came, which refuses what is not an integer id with the
    message a Python caller gets (``true`` is not token 1).

    :param prompt: the body's ``prompt``.
    :return: one text or token-id list per prompt.
    :raises BadRequest: an empty prompt or list, or a value of none of the accepted forms.
    """
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise BadRequest(f"prompt is a {_json_type(prompt)}; {_PROMPT_FORMS}", "prompt")
    if not prompt:
        raise BadRequest(f"prompt is empty; {_PROMPT_FORMS}", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        for i, p in enumerate(prompt):
            if not p:
                raise BadRequest(f"prompt[{i}] is an empty list of token ids", "prompt")
        return list(prompt)
    return [prompt]  # one list of token ids (the engine refuses any item that is not an id)


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages."""
    names = {bool: "boolean", int: "number", float: "number", dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


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


def sampling_params(
    req: _Sampling, base: SamplingParams, *, max_tokens: int | None
) -> SamplingParams:
    """The engine's parameters for a request.

    :param req: the request body.
    :param base: the model's defaults (``generation_config.json``), which fields
        the request leaves out keep.
    :param max_tokens: the request's token limit after defaults (``None``: ``base``'s).
    :return: validated :class:`SamplingParams`.
    :raises BadRequest: an unsupported feature or an invalid value (by the engine's
        table, through :class:`~backplane.core.errors.InvalidFieldError`'s field), naming
        the body's field.
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
    if req.structured_outputs is not None:
        values["structured_outputs"] = req.structured_outputs
    # completions: logprobs=k; chat: logprobs=true with top_logprobs=k (0 by default)
    logprobs_field = "logprobs"
    if isinstance(req, CompletionRequest):
        values["logprobs"] = req.logprobs
        values["prompt_logprobs"] = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            # the echoed prompt carries its tokens' logprobs, as OpenAI's legacy completions
            values["prompt_logprobs"] = max(req.logprobs, req.prompt_logprobs or 0)
    elif req.logprobs:
        values["logprobs"] = req.top_logprobs or 0
        logprobs_field = "top_logprobs" if req.top_logprobs else "logprobs"
    try:
        return dataclasses.replace(base, **values)
    except InvalidFieldError as exc:
        field = exc.field
        if field == "logprobs":
            field = logprobs_field
        elif field == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
            field = "max_completion_tokens"
        raise BadRequest(str(exc), field) from None
    except RequestError as exc:
        raise BadRequest(str(exc)) from None
