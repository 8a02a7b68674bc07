"""The tokenizer a GGUF file describes, built with the ``tokenizers`` library.

GGUF stores no ``tokenizer.json``: the vocabulary (``tokenizer.ggml.tokens``),
the token types, the BPE merges and the special token ids are metadata. This
builds the byte-level BPE tokenizer they describe (``tokenizer.ggml.model ==
"gpt2"``, used by Llama 3, Qwen, SmolLM and most recent models) the way
transformers' GGUF loader does: the pre-tokenizer split chosen by
``tokenizer.ggml.pre``, tokens marked control added as special tokens, ones
marked user-defined as plain added tokens, a leading bos when
``tokenizer.ggml.add_bos_token`` says so, and the chat template of
``tokenizer.chat_template``.
"""

from __future__ import annotations

from typing import Any

from backplane.core.errors import ConfigError
from backplane.models.chat import ChatTemplate
from backplane.models.gguf.reader import GGUFFile
from backplane.models.tokenizer import TextTokenizer, byte_alphabet

# Token types of tokenizer.ggml.token_type (llama.cpp's llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4

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


def build_gguf_tokenizer(file: GGUFFile) -> TextTokenizer | None:
    """Build the tokenizer of ``file``.

    :param file: the opened GGUF file.
    :return: the tokenizer with its special tokens and chat template, or
        ``None`` when the file has no vocabulary.
    :raises ConfigError: a tokenizer model other than byte-level BPE, or
        inconsistent metadata, naming the file and the field.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    tokens = file.get("tokenizer.ggml.tokens")
    if not tokens:
        return None
    kind = file.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(
            f"{file.path}: tokenizer.ggml.model {kind!r} is not supported; backplane builds "
            "byte-level BPE tokenizers ('gpt2') from GGUF files"
        )
    types = list(file.get("tokenizer.ggml.token_type") or [])
    if types and len(types) != len(tokens):
        raise ConfigError(
            f"{file.path}: tokenizer.ggml.token_type has {len(types)} entries for "
            f"{len(tokens)} tokens"
        )
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

    special: dict[str, str] = {}
    for name, key in _SPECIAL_IDS.items():
        idx = file.get(key)
        if idx is not None:
            if not 0 <= int(idx) < len(tokens):
                raise ConfigError(
                    f"{file.path}: {key} = {idx} is outside the vocabulary of {len(tokens)} tokens"
                )
            special[name] = tokens[int(idx)]
    control = [
        t for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL and set(t) <= alphabet
    ]
    # The named special tokens stay whole in text whatever their type says.
    control += [t for t in special.values() if t not in control]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, kind in zip(tokens, types, strict=True) if kind == _USER_DEFINED]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    edges = []
    if file.get("tokenizer.ggml.add_bos_token", False) and "bos_token" in special:
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
