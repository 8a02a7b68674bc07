"""The model's vocabulary as the grammar backend reads it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backplane.core.errors import RequestError


def import_xgrammar() -> Any:
    """Import xgrammar, the grammar backend, or say how to install it.

    :return: the ``xgrammar`` module (Any: it ships no type information).
    :raises RequestError: xgrammar is not installed.
    """
    try:
        import xgrammar
    except ImportError:
        raise RequestError(
            "structured output (structured_outputs, response_format) needs xgrammar; "
            "install it with: pip install 'backplane[structured]'"
        ) from None
    return xgrammar


def tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """Describe a model's tokenizer to xgrammar.

    Every id's spelling in id order (byte-level, byte-fallback or raw, as the
    tokenizer's own description says), special tokens as empty strings so a
    grammar never picks them (xgrammar treats empty tokens as special), ids
    past the tokenizer's vocabulary (a padded embedding) left out by sizing
    the bitmask for the model's ``vocab_size``.

    :param tokenizer: the model's tokenizer (a :class:`~backplane.models.tokenizer.TextTokenizer`
        or a bare ``tokenizers.Tokenizer``; Any: whatever the checkpoint's loader made).
    :param vocab_size: the model's vocabulary size (the logits' width).
    :param eos_token_ids: ids that end a sequence: a finished grammar allows only these.
    :return: an ``xgrammar.TokenizerInfo``.
    :raises RequestError: the model has no tokenizer, or xgrammar is not installed.
    """
    xgr = import_xgrammar()
    backend = getattr(tokenizer, "backend", tokenizer)
    if backend is None or not hasattr(backend, "get_vocab"):
        raise RequestError(
            "structured output needs the model's tokenizer, and this model was loaded without "
            "one; load a checkpoint that ships its tokenizer"
        )
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
    # ids the tokenizer lacks (a padded embedding) stay empty: never allowed
    encoded = [""] * vocab_size
    for text, i in vocab.items():
        if i < vocab_size:
            encoded[i] = text
    for i, added in backend.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            encoded[i] = ""
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(
        encoded,
        meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=list(eos_token_ids),
        add_prefix_space=bool(meta["add_prefix_space"]),
    )
