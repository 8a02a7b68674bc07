"""The two-stage greedy argmax picks the token ``torch.argmax`` picks, ties included."""

from __future__ import annotations

import pytest
import torch

from backplane.engine.sampling.greedy import _chunk_for, chunked_argmax, greedy_tokens


@pytest.mark.parametrize("vocab", [32000, 128256, 151936, 131072])
def test_chunk_divides_the_vocabulary(vocab: int) -> None:
    chunk = _chunk_for(vocab)
    assert chunk and vocab % chunk == 0 and vocab // chunk >= 16


def test_prime_vocabulary_has_no_chunk() -> None:
    assert _chunk_for(32003) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [32000, 128256])
def test_matches_argmax_with_ties(vocab: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g).to(dtype)
    # ties: the row maximum repeated in a later chunk and inside the same chunk
    for row, spots in enumerate([(5, 70000 % vocab), (1000, 1001), (vocab - 1, 0)]):
        logits[row, list(spots)] = 100.0
    logits[3] = 0.0  # a flat row: the first token
    chunk = _chunk_for(vocab)
    got = chunked_argmax(logits, chunk)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))


@pytest.mark.gpu
def test_matches_argmax_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    logits = torch.randn(3, 128256, device="cuda")
    logits[0, [7, 90000]] = 50.0
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
