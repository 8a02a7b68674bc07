"""Decoding a GGUF file whose projections stay Q4_K, on a GPU with CUDA graphs.

At one sequence each decode step multiplies one row by the repacked Q4_K
weights in :func:`~backplane.kernels.qgemv_packed.packed_gemv` (inside the
decode graph; launched as programmatic dependents on Hopper), while a prefill
of many tokens dequantises each weight and multiplies the rows densely
(:func:`~backplane.kernels.qgemv_packed.dequantize_packed_matrix`). So the
log-probability of every generated token, as the decode steps gave it, must
match the same token scored by one prefill of the whole sequence
(``prompt_logprobs``): two independent routes through the same blocks, every
position compared. The file is a random-weight llama shape written with the
``gguf`` package (rows of whole 256-value blocks, so every projection is
Q4_K and repacked), in float32 so that the two routes differ by float32
rounding only.

Run with ``python -m pytest -m gpu tests/test_gguf_q4k_decode_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_checks import kernel_gpu

pytestmark = pytest.mark.gpu

pytest.importorskip("gguf")

#: a small llama shape whose projections are whole Q4_K blocks wide (256 values)
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def test_decode_steps_score_tokens_as_a_prefill_does(tmp_path, monkeypatch):
    """Every decoded token's log-probability equals the one a prefill of the sequence gives."""
    kernel_gpu()
    from backplane import LLM, SamplingParams
    from backplane.cli.bench.latency.random_gguf import write_random_gguf
    from backplane.kernels import qgemv_packed

    path = write_random_gguf("q4k-test", CONFIG, tmp_path / "q4k.gguf", seed=3)
    runs: list[int] = []
    real = qgemv_packed.packed_gemv

    def counted(*args, **kwargs):
        runs.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(qgemv_packed, "packed_gemv", counted)
    llm = LLM(
        str(path),
        device="cuda",
        dtype="float32",
        max_num_seqs=2,
        max_num_tokens=128,
        max_model_len=160,
        kv_memory="64MiB",
        cuda_graphs="full_and_piecewise",
        backends={"attention": "triton"},
    )
    prompt = torch.randint(3, 1024, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    new = 40
    out = llm.generate([prompt], SamplingParams(max_tokens=new, ignore_eos=True, logprobs=0))[0]
    tokens = out.outputs[0].token_ids
    assert len(tokens) == new
    assert runs, "no decode step multiplied through the packed Q4_K kernel"
    decoded = torch.tensor(
        [step[tok].logprob for step, tok in zip(out.outputs[0].logprobs, tokens, strict=True)],
        dtype=torch.float64,
    )
    seq = prompt + list(tokens)
    scored = llm.generate([seq], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    prefilled = torch.tensor(
        [scored.prompt_logprobs[j][seq[j]].logprob for j in range(len(prompt), len(seq))],
        dtype=torch.float64,
    )
    # the log-probabilities vary from token to token by far more than the tolerance
    assert prefilled.std() > 0.05, prefilled
    torch.testing.assert_close(decoded, prefilled, rtol=0, atol=2e-3)
