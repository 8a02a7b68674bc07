"""GGUF tokenizers against transformers' GGUF loader: SentencePiece BPE vocabularies ("llama")."""

from __future__ import annotations

from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from backplane.core.errors import ConfigError  # noqa: E402
from backplane.models.gguf.reader import GGUFFile  # noqa: E402
from backplane.models.gguf.tokenizer import build_gguf_tokenizer, merges_from_scores  # noqa: E402

# SentencePiece pieces with their scores, as llama.cpp's converter writes them:
# control tokens, the 256 byte tokens, then the pieces (several ways to split
# most words, so the merge order decides), an added control and a user token.
PIECES = [
    "▁", "h", "e", "l", "o", "w", "r", "d", "a", "b", "t", "i", "n", "g", "s",
    "▁h", "he", "ll", "llo", "▁he", "hel", "hello", "▁hello", "▁w", "or", "ld", "orld",
    "wor", "▁world", "▁a", "ab", "▁ab", "in", "ing", "st", "▁t", "te", "est", "▁test",
    "▁testing", "ting", "▁st", "▁ing", "lo", "▁lo",
]  # fmt: skip
TEXTS = [
    "hello world",
    " hello",
    "hello  world",
    "  leading and trailing  ",
    "testing abab hello\nworld\ttab",
    "x é 日本 🙂 unknown characters fall back to bytes",
    "<|im_end|>hello<think>world<s>",
    "",
    " ",
]


def _write(
    path: Path, *, merges: bool, add_bos: bool | None, scores_shuffled: bool = False
) -> Path:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for i, piece in enumerate(PIECES):
        tokens.append(piece)
        types.append(1)
        # longer pieces tend to score higher, with ties, as in real vocabularies
        scores.append(float(len(piece) * 3 - (i % 4)) if scores_shuffled else -float(i))
    tokens += ["<|im_end|>", "<think>"]
    types += [3, 4]
    scores += [0.0, 0.0]
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "block_count": 1,
        "context_length": 64,
        "embedding_length": 8,
        "feed_forward_length": 16,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
    }.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", scores)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    if add_bos is not None:
        w.add_bool("tokenizer.ggml.add_bos_token", add_bos)
    if merges:
        order = merges_from_scores(tokens, scores)[::-1]  # deliberately not the score order
        w.add_array("tokenizer.ggml.merges", [f"{a} {b}" for a, b in order])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "merges, add_bos, shuffled",
    [(False, None, False), (False, None, True), (True, False, True), (False, True, True)],
    ids=["scores", "tied-scores", "listed-merges-no-bos", "bos-flag"],
)
def test_sentencepiece_vocabulary_tokenizes_as_transformers(
    tmp_path: Path, merges: bool, add_bos: bool | None, shuffled: bool
) -> None:
    path = _write(tmp_path / "spm.gguf", merges=merges, add_bos=add_bos, scores_shuffled=shuffled)
    ours = build_gguf_tokenizer(GGUFFile(path))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        want = hf.encode(text)
        assert ours.encode(text).ids == want, text
        assert ours.decode(want, skip_special_tokens=True) == hf.decode(
            want, skip_special_tokens=True
        ), text
    assert ours.special_tokens["bos_token"] == "<s>" and ours.special_tokens["eos_token"] == "</s>"


def test_merges_from_scores_rank_by_score_then_length() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc", "x"]
    scores = [0.0, 0.0, 0.0, -1.0, -1.0, 5.0, 9.0]
    merges = merges_from_scores(tokens, scores)
    # abc (score 5): ("a", "bc") and ("ab", "c") tie on score; the longer left part first
    assert merges == [("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c")]
    # a skipped token is neither merged nor a part
    assert merges_from_scores(tokens, scores, skip={"ab"}) == [("a", "bc"), ("b", "c")]


def test_scores_missing_without_merges_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", ["<unk>", "a", "b", "ab"])
    w.add_array("tokenizer.ggml.scores", [0.0, 0.0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"bad\.gguf: tokenizer\.ggml\.scores has 2 entries"):
        build_gguf_tokenizer(GGUFFile(path))


def test_other_tokenizer_models_are_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "t5.gguf"
    w = gguf.GGUFWriter(str(path), "t5")
    w.add_string("tokenizer.ggml.model", "t5")
    w.add_array("tokenizer.ggml.tokens", ["<pad>", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        ConfigError, match=r"t5\.gguf: tokenizer\.ggml\.model 't5' is not supported"
    ):
        build_gguf_tokenizer(GGUFFile(path))
