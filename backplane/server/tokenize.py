"""The tokenizer routes, as vLLM serves them: ``/tokenize``, ``/detokenize``, ``/tokenizer_info``.

Evaluation harnesses (lm-evaluation-harness's ``tokenizer_backend=remote``)
and clients that count tokens use them to tokenize exactly as the server does,
without loading the model's tokenizer themselves. Tokenizing runs on the
engine's tokenizer threads, never on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, model_validator

from backplane.api.async_llm import AsyncLLM
from backplane.models.tokenizer import SPECIAL_TOKEN_NAMES
from backplane.server.protocol import (
    BadRequest,
    ChatMessage,
    chat_messages,
    check_chat_template_kwargs,
)

__all__ = ["DetokenizeRequest", "TokenizeRequest", "add_tokenizer_routes"]


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a ``prompt`` text, or chat ``messages`` rendered by the
    model's chat template (then ``add_generation_prompt`` and ``chat_template_kwargs``
    apply, and the template writes the special tokens itself)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest(
                "give either prompt (a text) or messages (a conversation), not both or neither",
                "prompt" if self.prompt is not None else "messages",
            )
        check_chat_template_kwargs(self.chat_template_kwargs)
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: ``tokens``, a list of token ids, back to text."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[Any]


def _token_ids(tokens: list[Any], vocab_size: int) -> list[int]:
    """The ids of a ``/detokenize`` body, each checked to be a token of the model.

    :param tokens: the body's ``tokens``.
    :param vocab_size: ids must be in ``[0, vocab_size)``.
    :return: the ids.
    :raises BadRequest: an item that is not an integer or not in the vocabulary.
    """
    for i, t in enumerate(tokens):
        # a JSON true is no token 1
        if type(t) is not int or not 0 <= t < vocab_size:
            raise BadRequest(
                f"tokens[{i}] is {t!r}, not a token id of this model (an integer in "
                f"[0, {vocab_size})); send ids from /tokenize",
                "tokens",
            )
    return list(tokens)


def add_tokenizer_routes(
    app: FastAPI,
    engine: AsyncLLM,
    parse_body: Callable[..., Any],
    check_model: Callable[[str | None], None],
) -> None:
    """Add ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` to the server's app.

    :param app: the application.
    :param engine: the engine whose tokenizer the routes use.
    :param parse_body: the app's body parser (``await parse_body(request, Model)``).
    :param check_model: refuses a ``model`` the server does not serve.
    """

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        body: TokenizeRequest = await parse_body(request, TokenizeRequest)
        check_model(body.model)
        if body.messages is not None:
            _, ids = await engine.render_chat_async(
                chat_messages(body.messages), body.add_generation_prompt, body.chat_template_kwargs
            )
        else:
            ids = await engine.encode_async(
                body.prompt or "", add_special_tokens=body.add_special_tokens
            )
        answer: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": engine.max_model_len,
            "tokens": ids,
        }
        if body.return_token_strs:
            tokenizer = engine.tokenizer
            answer["token_strs"] = [tokenizer.id_to_token(t) for t in ids]
        return JSONResponse(answer)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        body: DetokenizeRequest = await parse_body(request, DetokenizeRequest)
        check_model(body.model)
        ids = _token_ids(body.tokens, int(engine.llm.engine.vocab_size))
        return JSONResponse({"prompt": await engine.decode_async(ids)})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Any:
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise BadRequest("the model has no tokenizer", status=404)
        special = getattr(tokenizer, "special_tokens", {})
        info: dict[str, Any] = {name: special.get(name) for name in SPECIAL_TOKEN_NAMES}
        template = getattr(tokenizer, "chat_template", None)
        info["chat_template"] = getattr(template, "source", None)
        info["model_max_length"] = engine.max_model_len
        return JSONResponse(info)
