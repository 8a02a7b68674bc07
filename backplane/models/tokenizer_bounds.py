"""How many characters of text one token can cover: a bound that refuses long prompts untokenized.

A prompt of ``N`` characters needs at least ``N / C`` tokens when no token
covers more than ``C`` characters of the input. :func:`max_chars_per_token`
finds such a ``C`` from a ``tokenizers`` tokenizer's vocabulary and pipeline,
so a server can refuse a prompt that cannot fit the model length before
spending the time to tokenize it. Where the pipeline may drop text or fold an
unbounded run of it into one token (whitespace splitting, stripping, fused
unknown tokens), no such bound exists and the answer is ``None``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from backplane.models.tokenizer import byte_alphabet

logger = logging.getLogger(__name__)

__all__ = ["CharBound", "char_bound"]

#: Normalizers that never shorten text (decompositions, lowercasing, prefixes, the byte map).
_EXPANDING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"})

#: Canonical composition folds at most four code points into one (e.g. U+1F85 from
#: alpha and three combining marks; Hangul syllables fold three).
_COMPOSING_NORMALIZERS = {"NFC": 4, "NFKC": 4}

#: Pre-tokenizers that split or re-spell text without removing any of it.
_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "FixedLength"}
)


def _normalizer_factor(node: dict[str, Any] | None) -> float | None:
    """How many input characters one normalized character may stand for (``None``: unbounded)."""
    if node is None:
        return 1.0
    kind = node.get("type")
    if kind == "Sequence":
        factor = 1.0
        for child in node.get("normalizers", []):
            f = _normalizer_factor(child)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _EXPANDING_NORMALIZERS:
        return 1.0
    if kind in _COMPOSING_NORMALIZERS:
        return float(_COMPOSING_NORMALIZERS[kind])
    if kind == "Replace":
        pattern = node.get("pattern", {})
        content = node.get("content", "")
        if "String" in pattern and content:
            return max(1.0, len(pattern["String"]) / len(content))
        return None  # a regex, or a replacement by nothing, may remove any amount of text
    # Strip, StripAccents, BertNormalizer, Nmt, Precompiled and unknown kinds may remove text.
    return None


def _pre_tokenizer_keeps_text(node: dict[str, Any] | None) -> bool:
    """Whether the pre-tokenizer passes every character on (splits, never removes)."""
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(c) for c in node.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return str(node.get("behavior", "")).lower() != "removed"
    # Whitespace, WhitespaceSplit, BertPreTokenizer and CharDelimiterSplit drop characters.
    return kind in _KEEPING_PRE_TOKENIZERS


def _dropped_bytes(vocab: dict[str, int]) -> set[int] | None:
    """The ASCII bytes a byte-level vocabulary cannot spell (whose characters it drops).

    A character of several bytes keeps at least one byte (and so a place in some
    token) as long as every continuation byte is spelled; ``None`` when one is not.
    """
    missing = {b for b, c in byte_alphabet().items() if c not in vocab}
    if any(0x80 <= b <= 0xBF for b in missing):
        return None
    return {b for b in missing if b < 0x80}


def _unknowns_unbounded(model: dict[str, Any]) -> bool:
    """Whether a model that is not byte-level may drop characters or fold a run of them."""
    kind = model.get("type")
    if kind == "BPE":
        if model.get("byte_fallback"):
            return False
        # without an unknown token, unknown characters are dropped; fused, a run is one token
        return model.get("unk_token") is None or bool(model.get("fuse_unk"))
    if kind == "Unigram":
        return not model.get("byte_fallback")
    if kind == "WordPiece":
        return False  # an unknown word is at most max_input_chars_per_word characters
    return True  # WordLevel (one token per word of any length) and unknown kinds


@dataclass(frozen=True)
class CharBound:
    """No token of a tokenizer covers more than ``chars_per_token`` counted characters.

    :param chars_per_token: the bound.
    :param ignored: characters the tokenizer drops (they are not counted).
    """

    chars_per_token: int
    ignored: str = ""

    def counted(self, text: str) -> int:
        """The characters of ``text`` that the bound applies to.

        :param text: a prompt.
        :return: its length less the characters the tokenizer drops.
        """
        return len(text) - sum(text.count(c) for c in self.ignored)

    def max_chars(self, max_tokens: int) -> int:
        """The most counted characters a text of at most ``max_tokens`` tokens can have.

        :param max_tokens: a number of tokens (the model length).
        :return: ``max_tokens * chars_per_token``.
        """
        return int(max_tokens) * self.chars_per_token


def char_bound(tokenizer: Any) -> CharBound | None:
    """How many input characters one token of ``tokenizer`` covers at most.

    The longest vocabulary entry (added tokens included) bounds the normalized
    characters of a token: a byte-level entry spells one character per byte,
    and a text character is at least one byte. Normalizers that compose
    characters (NFC, NFKC) multiply it by the most code points one composed
    character can fold.

    :param tokenizer: a ``tokenizers.Tokenizer``, or an object whose
        ``backend`` is one (:class:`~backplane.models.tokenizer.TextTokenizer`).
    :return: the bound, or ``None`` when the tokenizer can drop arbitrary text
        or fold an unbounded run of it into one token (then only tokenizing can tell).
    """
    backend = getattr(tokenizer, "backend", tokenizer)
    try:
        spec = json.loads(backend.to_str())
        vocab = backend.get_vocab(with_added_tokens=True)
    except Exception:  # not a ``tokenizers`` tokenizer (or one it cannot serialize)
        logger.debug("no character bound for tokenizer %r", type(tokenizer).__name__)
        return None
    factor = _normalizer_factor(spec.get("normalizer"))
    pre = spec.get("pre_tokenizer")
    if factor is None or not _pre_tokenizer_keeps_text(pre):
        return None
    model = spec.get("model") or {}
    ignored = ""
    if model.get("type") == "BPE" and '"ByteLevel"' in json.dumps(pre):
        dropped = _dropped_bytes(vocab)
        if dropped is None:
            return None
        ignored = "".join(chr(b) for b in sorted(dropped))
    elif _unknowns_unbounded(model):
        return None
    longest = max((len(token) for token in vocab), default=1)
    if model.get("type") == "WordPiece":
        longest = max(longest, int(model.get("max_input_chars_per_word", 100)))
    return CharBound(int(max(1, longest) * factor + 0.999999), ignored)
