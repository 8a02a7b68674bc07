"""The character bound of a tokenizer, and AsyncLLM refusing prompts too long to tokenize."""

from __future__ import annotations

import asyncio
import random

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from backplane.core.errors import InvalidFieldError, RequestError
from backplane.models.presets import byte_tokenizer
from backplane.models.tokenizer_bounds import char_bound

CONFIG = dict(device="cpu", max_num_seqs=4, max_num_tokens=32, page_size=4, num_kv_pages=128)


def _bpe(vocab: list[str], merges: list[tuple[str, str]], **kw) -> Tokenizer:
    return Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=merges, **kw))


def _texts(alphabet: str, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    runs = [c * 500 for c in alphabet]
    mixed = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 300))) for _ in range(50)]
    return runs + mixed


def _check_holds(tok: Tokenizer, texts: list[str]) -> None:
    """No tokenized text has more counted characters than the bound allows for its tokens."""
    bound = char_bound(tok)
    assert bound is not None
    for text in texts:
        n_tokens = len(tok.encode(text, add_special_tokens=False).ids)
        assert bound.counted(text) <= bound.chars_per_token * n_tokens, (text[:40], n_tokens)


def test_byte_level_bound_holds_and_counts_dropped_bytes():
    tok = byte_tokenizer()
    bound = char_bound(tok)
    assert bound is not None
    longest = max(len(t) for t in tok.get_vocab(with_added_tokens=True))
    assert bound.chars_per_token == longest
    _check_holds(tok, _texts("ab é\n中🙂"))


def test_merged_tokens_bound_holds():
    # a byte-level BPE whose merges build "aaaa" and "abab": a run of 'a' packs 4 per token
    from backplane.models.tokenizer import byte_alphabet

    alphabet = list(byte_alphabet().values())
    merges = [("a", "a"), ("aa", "aa"), ("a", "b"), ("ab", "ab")]
    tok = _bpe(alphabet + ["aa", "aaaa", "ab", "abab"], merges)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    assert char_bound(tok).chars_per_token == 4
    assert len(tok.encode("a" * 400).ids) == 100  # the bound is reached, not only respected
    _check_holds(tok, _texts("ab"))


def test_byte_level_vocab_without_some_ascii_ignores_those_characters():
    from backplane.models.tokenizer import byte_alphabet

    spelled = byte_alphabet()
    alphabet = [c for b, c in spelled.items() if b not in (0x04, 0x06)]
    tok = _bpe(alphabet, [])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bound = char_bound(tok)
    assert bound is not None and set(bound.ignored) == {"\x04", "\x06"}
    # the tokenizer really drops them: a megabyte of them is no token at all
    assert tok.encode("\x04" * 10_000).ids == []
    assert bound.counted("\x04" * 10_000 + "ab") == 2
    _check_holds(tok, _texts("a\x04b\x06"))


def test_nfc_composition_is_allowed_for():
    from backplane.models.tokenizer import byte_alphabet

    tok = _bpe(list(byte_alphabet().values()), [])
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bound = char_bound(tok)
    assert bound is not None and bound.chars_per_token == 4
    # alpha + three combining marks compose into one code point (U+1F85, 3 bytes)
    _check_holds(tok, ["\u03b1\u0314\u0301\u0345" * 200, "\u1100\u1161\u11a8" * 200])


@pytest.mark.parametrize(
    ("build", "text"),
    [
        # whitespace splitting drops the spaces: thousands of them are no token
        (
            lambda: _with(
                _bpe(["a", "[UNK]"], [], unk_token="[UNK]"), pre=pre_tokenizers.Whitespace()
            ),
            " " * 3000 + "a",
        ),
        # stripping drops any run of leading spaces
        (
            lambda: _with(
                _bpe(["a", " ", "[UNK]"], [], unk_token="[UNK]"), norm=normalizers.Strip()
            ),
            " " * 3000 + "a",
        ),
        # one fused unknown token for any run of unknown characters
        (lambda: _bpe(["a", "[UNK]"], [], unk_token="[UNK]", fuse_unk=True), "xyz" * 1000),
        # one token per word, whatever its length
        (lambda: Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")), "x" * 3000),
    ],
)
def test_no_bound_where_text_can_vanish_or_fold(build, text):
    tok = build()
    # the reason there is no bound: thousands of characters in a single token
    assert len(tok.encode(text).ids) == 1
    assert char_bound(tok) is None


def _with(tok: Tokenizer, *, pre=None, norm=None) -> Tokenizer:
    if pre is not None:
        tok.pre_tokenizer = pre
    if norm is not None:
        tok.normalizer = norm
    return tok


# -- AsyncLLM ---------------------------------------------------------------------------------


class _CountingBackend:
    """A tokenizer backend that counts the texts it encodes (and forwards everything)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.encoded = 0

    def encode(self, *args, **kwargs):
        self.encoded += 1
        return self.inner.encode(*args, **kwargs)

    def encode_batch(self, texts, *args, **kwargs):
        self.encoded += len(texts)
        return self.inner.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def engine():
    from backplane import LLM
    from backplane.api import AsyncLLM
    from backplane.models.chat import ChatTemplate

    llm = LLM("tiny-llama", **CONFIG)
    llm.tokenizer.chat_template = ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", origin="test"
    )
    eng = AsyncLLM(llm=llm)
    counting = _CountingBackend(llm.tokenizer.backend)
    llm.tokenizer.backend = counting
    yield eng, counting
    eng.shutdown()


def test_limit_is_model_length_times_longest_token(engine):
    eng, counting = engine
    vocab = counting.inner.get_vocab(with_added_tokens=True)
    assert eng.max_prompt_chars == eng.max_model_len * max(len(t) for t in vocab)


def test_oversized_prompt_is_refused_without_tokenizing(engine):
    from backplane import SamplingParams

    eng, counting = engine
    before = counting.encoded
    text = "a" * (eng.max_prompt_chars + 1)

    async def go():
        return await eng.add_request(text, SamplingParams(max_tokens=2))

    with pytest.raises(InvalidFieldError) as exc:
        asyncio.run(go())
    assert exc.value.field == "prompt"
    msg = str(exc.value)
    assert f"({len(text)} characters)" in msg and f"max_model_len={eng.max_model_len}" in msg
    assert counting.encoded == before
    with pytest.raises(InvalidFieldError):  # the thread API too
        eng.submit(text, SamplingParams(max_tokens=2))
    assert counting.encoded == before


def test_oversized_chat_is_refused_without_tokenizing(engine):
    from backplane import SamplingParams

    eng, counting = engine
    before = counting.encoded
    big = [{"role": "user", "content": "a" * eng.max_prompt_chars}]

    async def go():
        return await eng.chat(big, SamplingParams(max_tokens=2))

    with pytest.raises(InvalidFieldError, match="rendered conversation") as exc:
        asyncio.run(go())
    assert exc.value.field == "messages"
    assert counting.encoded == before


def test_prompt_under_the_limit_is_tokenized_as_before(engine):
    from backplane import SamplingParams

    eng, counting = engine
    text = "hello there"

    async def go():
        outs = [o async for o in eng.generate(text, SamplingParams(max_tokens=2, temperature=0))]
        return outs[-1]

    out = asyncio.run(go())
    assert out.prompt_token_ids == list(counting.inner.encode(text).ids)
    # too long in tokens though short enough in characters: the engine's token-count error
    long = "ab " * (eng.max_model_len // 2)
    assert len(long) < eng.max_prompt_chars

    async def too_long():
        return await eng.add_request(long, SamplingParams(max_tokens=2))

    with pytest.raises(RequestError, match="tokens"):
        asyncio.run(too_long())


def test_chat_off_the_event_loop_matches_the_llm(engine):
    eng, _ = engine
    conv = [{"role": "user", "content": "hi"}]

    async def go():
        return await eng.render_chat_async(conv)

    assert asyncio.run(go()) == eng.llm.render_chat(conv)
