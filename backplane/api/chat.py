"""Chat: conversations rendered with the model's chat template, and the end of turn as a stop."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from backplane.core.errors import RequestError
from backplane.engine.sampling import SamplingParams
from backplane.models.chat import check_template_kwargs

__all__ = ["Conversation", "as_conversations", "chat_params", "render_chat"]

#: A conversation: ``[{"role": "user", "content": "..."}, ...]``.
Conversation = Sequence[Mapping[str, Any]]


def as_conversations(messages: Any) -> list[Any]:
    """One conversation or a list of conversations -> a list of conversations.

    :param messages: a conversation (a list of message dicts) or a list of them.
    :return: the conversations.
    :raises RequestError: anything else.
    """
    if isinstance(messages, (list, tuple)) and messages:
        if all(isinstance(m, Mapping) for m in messages):
            return [messages]
        if all(isinstance(c, (list, tuple)) for c in messages):
            return list(messages)
    raise RequestError(
        'chat() takes a conversation (a non-empty list of {"role": ..., "content": ...} dicts) '
        f"or a list of conversations; got {type(messages).__name__}"
    )


def render_chat(
    tokenizer: Any,
    conversation: Conversation,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """Render one conversation with the chat template and tokenize it.

    :param tokenizer: the model's tokenizer (``None``: the model has none).
    :param conversation: ``[{"role": ..., "content": ...}, ...]``.
    :param add_generation_prompt: end with an open assistant turn.
    :param chat_template_kwargs: further template variables.
    :return: the prompt text and its token ids (no special tokens added:
        the template writes them).
    :raises RequestError: no tokenizer or template, malformed messages, or a
        template that refuses them.
    """
    text = render_chat_text(tokenizer, conversation, add_generation_prompt, chat_template_kwargs)
    # the template writes the special tokens itself
    return text, list(tokenizer.encode(text, add_special_tokens=False).ids)


def render_chat_text(
    tokenizer: Any,
    conversation: Conversation,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Render one conversation with the chat template, without tokenizing it.

    :param tokenizer: the model's tokenizer (``None``: the model has none).
    :param conversation: ``[{"role": ..., "content": ...}, ...]``.
    :param add_generation_prompt: end with an open assistant turn.
    :param chat_template_kwargs: further template variables (not ``messages`` or
        ``add_generation_prompt``, which are the arguments above).
    :return: the prompt text.
    :raises RequestError: as :func:`render_chat`.
    """
    if tokenizer is None:
        raise RequestError("this model has no tokenizer, so it cannot render a chat")
    return tokenizer.apply_chat_template(
        conversation,
        add_generation_prompt=add_generation_prompt,
        **check_template_kwargs(chat_template_kwargs),
    )


def chat_params(tokenizer: Any, sampling_params: SamplingParams) -> SamplingParams:
    """``sampling_params`` that also stop at the tokenizer's end of turn (its eos token).

    :param tokenizer: the model's tokenizer, or ``None``.
    :param sampling_params: the caller's parameters.
    :return: the same, with the end-of-turn id added to ``stop_token_ids``
        unless ``ignore_eos`` is set or it is there already.
    """
    end_of_turn = None if tokenizer is None else tokenizer.token_id("eos_token")
    sp = sampling_params
    if end_of_turn is None or sp.ignore_eos or end_of_turn in sp.stop_token_ids:
        return sp
    return dataclasses.replace(sp, stop_token_ids=(*sp.stop_token_ids, end_of_turn))
