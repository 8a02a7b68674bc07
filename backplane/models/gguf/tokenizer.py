"""The tokenizer a GGUF file describes, built with the ``tokenizers`` library.

GGUF stores no ``tokenizer.json``: the vocabulary (``tokenizer.ggml.tokens``),
the token types, the BPE merges (or, for SentencePiece vocabularies, the
token scores) and the special token ids are metadata. This builds the tokenizer
they describe the way transformers' GGUF loader does:

* ``tokenizer.ggml.model == "gpt2"`` (Llama 3, Qwen, SmolLM and most recent
  models): byte-level BPE with the pre-tokenizer split chosen by
  ``tokenizer.ggml.pre``;
* ``"llama"`` (SentencePiece BPE: Llama 2, TinyLlama, Mistral and their
  fine-tunes): BPE over the vocabulary as spelled, ``▁`` for spaces prepended
  to the first word, unknown characters falling back to the ``<0xXX>`` byte
  tokens, and, when the file lists no merges, merges recovered from the
  scores (:func:`merges_from_scores`); a leading bos unless the file says
  otherwise.

Either way, tokens marked control are added as special tokens, ones marked
user-defined as plain added tokens, a leading bos when
``tokenizer.ggml.add_bos_token`` says so, and the chat template of
``tokenizer.chat_template`` comes along.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from backplane.core.errors import ConfigError
from backplane.models.chat import ChatTemplate
from backplane.models.gguf.reader import GGUFFile
from backplane.models.tokenizer import TextTokenizer, byte_alphabet

# Token types of tokenizer.ggml.token_type (llama.cpp's llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4

#: SentencePiece's spelling of a space
_SPACE = "\u2581"

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: tokenizer.ggml.pre -> the split its merges were learned with (others: GPT-2's)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}

_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _pre_tokenizer(pre: str | None) -> Any:
    from tokenizers import Regex, pre_tokenizers

    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], skip: Collection[str] = ()
) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, best first.

    Every token that two other tokens concatenate to is a merge of those two,
    ranked by the merged token's score (higher first), then by the longer
    left and right parts; splits of one token keep the order of their parts'
    ids. This is the order transformers derives for GGUF files that list no
    merges, so both tokenize alike.

    :param tokens: the vocabulary, by id.
    :param scores: one score per token.
    :param skip: tokens that are neither merged nor parts of a merge.
    :return: ``(left, right)`` pairs.
    """
    ids = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores, strict=True):
        if token in skip:
            continue
        splits = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in ids
            and token[cut:] in ids
            and token[:cut] not in skip
            and token[cut:] not in skip
        ]
        splits.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
        ranked.extend((float(score), len(left), len(right), left, right) for left, right in splits)
    # a stable sort, best first: equal keys keep the order built above
    ranked.sort(key=lambda r: (r[0], r[1], r[2]), reverse=True)
    return [(left, right) for _, _, _, left, right in ranked]


def _byte_level_model(file: GGUFFile, tokens: list[str]) -> tuple[Any, set[str]]:
    """Byte-level BPE (``"gpt2"``): the model and the alphabet real tokens are spelled in."""
    from tokenizers import Tokenizer, decoders, models

    spelling = byte_alphabet()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:
        # A token written with characters outside the byte alphabet is raw text: re-spell it.
        if set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spelled(t): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in file.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(file.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def _sentencepiece_model(file: GGUFFile, tokens: list[str]) -> Any:
    """SentencePiece BPE (``"llama"``): the model, as transformers' ``LlamaTokenizer`` builds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    listed = file.get("tokenizer.ggml.merges")
    if listed:
        merges = [tuple(m.split(" ", 1)) for m in listed]
    else:
        scores = list(file.get("tokenizer.ggml.scores") or [])
        if len(scores) != len(tokens):
            raise ConfigError(
                f"{file.path}: tokenizer.ggml.scores has {len(scores)} entries for "
                f"{len(tokens)} tokens, and there are no tokenizer.ggml.merges to use instead"
            )
        merges = merges_from_scores(tokens, scores)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first", split=False
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace(_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    return tok


def build_gguf_tokenizer(file: GGUFFile) -> TextTokenizer | None:
    """Build the tokenizer of ``file``.

    :param file: the opened GGUF file.
    :return: the tokenizer with its special tokens and chat template, or
        ``None`` when the file has no vocabulary.
    :raises ConfigError: a tokenizer model other than byte-level BPE
        (``"gpt2"``) and SentencePiece BPE (``"llama"``), or inconsistent
        metadata, naming the file and the field.
    """
    from tokenizers import AddedToken, processors

    tokens = file.get("tokenizer.ggml.tokens")
    if not tokens:
        return None
    tokens = list(tokens)
    kind = file.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ConfigError(
            f"{file.path}: tokenizer.ggml.model {kind!r} is not supported; backplane builds "
            "byte-level BPE ('gpt2') and SentencePiece BPE ('llama') tokenizers from GGUF files"
        )
    types = list(file.get("tokenizer.ggml.token_type") or [])
    if types and len(types) != len(tokens):
        raise ConfigError(
            f"{file.path}: tokenizer.ggml.token_type has {len(types)} entries for "
            f"{len(tokens)} tokens"
        )
    if kind == "gpt2":
        tok, alphabet = _byte_level_model(file, tokens)

        def is_real(token: str) -> bool:
            # in a byte-level vocabulary a control token in other characters is a mislabel
            return set(token) <= alphabet
    else:
        tok = _sentencepiece_model(file, tokens)

        def is_real(token: str) -> bool:
            return True

    special: dict[str, str] = {}
    for name, key in _SPECIAL_IDS.items():
        idx = file.get(key)
        if idx is not None:
            if not 0 <= int(idx) < len(tokens):
                raise ConfigError(
                    f"{file.path}: {key} = {idx} is outside the vocabulary of {len(tokens)} tokens"
                )
            special[name] = tokens[int(idx)]
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL and is_real(t)]
    # The named special tokens stay whole in text whatever their type says.
    control += [t for t in special.values() if t not in control]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, kind in zip(tokens, types, strict=True) if kind == _USER_DEFINED]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    edges = []
    # llama.cpp adds bos to a SentencePiece vocabulary unless the file says otherwise
    add_bos = file.get("tokenizer.ggml.add_bos_token", kind == "llama")
    if add_bos and "bos_token" in special:
        edges.append(("bos", special["bos_token"]))
    if file.get("tokenizer.ggml.add_eos_token", False) and "eos_token" in special:
        edges.append(("eos", special["eos_token"]))
    if edges:
        pieces = {edge: f"{token}:0" for edge, token in edges}
        single = " ".join(p for p in (pieces.get("bos"), "$A:0", pieces.get("eos")) if p)
        pair = " ".join(
            p
            for p in (pieces.get("bos"), "$A:0", pieces.get("bos"), "$B:1", pieces.get("eos"))
            if p
        )
        tok.post_processor = processors.TemplateProcessing(
            single=single,
            pair=pair,
            special_tokens=[(token, tok.token_to_id(token)) for _, token in edges],
        )
    source = file.get("tokenizer.chat_template")
    template = (
        ChatTemplate(source, origin=f"{file.path}: tokenizer.chat_template") if source else None
    )
    return TextTokenizer(tok, special_tokens=special, chat_template=template)
