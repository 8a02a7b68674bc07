"""``backplane bench latency`` with quantised weights and KV cache, on the CPU.

The floors are checked against counts made apart from the benchmark's code:
FP8 weights from the parameters of an engine that loaded the saved weights
with ``quantization="fp8"``, the unquantised floor from the safetensors file,
the KV cache from the config, and a Q4_K GGUF file's floor from the tensor
table the ``gguf`` package reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bench_helpers import cpu_latency

from backplane.cli import main

PROMPT_LEN = 8
NEW_TOKENS = 4
BATCHES = (1, 2)


def _bench(tmp_path: Path, shape: str, *flags: str) -> dict[str, Any]:
    """Run ``bench latency`` on ``shape`` (CPU, torch attention, no transformers); its JSON."""
    result, _ = cpu_latency(
        shape,
        tmp_path / "latency.json",
        tmp_path / "weights",
        batches=BATCHES,
        prompt_len=PROMPT_LEN,
        new_tokens=NEW_TOKENS,
        extra=flags,
    )
    return result["shapes"][0]


def _floors(shape: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    return tuple(c for c in shape["configs"] if c["kind"] == "floor")


def _ran(shape: dict[str, Any]) -> dict[str, Any]:
    (entry,) = [c for c in shape["configs"] if c["kind"] == "backplane"]
    assert entry["status"] == "ok", entry
    assert [r["status"] for r in entry["batches"]] == ["ok"] * len(BATCHES)
    return entry


def _kv_bytes(config: dict[str, Any], element: int, batch: int) -> int:
    """KV bytes a step reads, from the config: keys and values of every layer at the mean
    context of the timed steps, and the new token."""
    heads = config["num_key_value_heads"] * config["head_dim"]
    per_token = 2 * heads * config["num_hidden_layers"] * element
    return int(batch * per_token * (PROMPT_LEN + NEW_TOKENS / 2 + 1))


def test_fp8_floor_counts_the_loaded_engine_weights_and_fp8_kv(tmp_path):
    import torch
    from safetensors import safe_open

    from backplane import LLM

    shape = _bench(tmp_path, "tiny-llama", "--quantization", "fp8", "--kv-cache-dtype", "fp8")
    entry = _ran(shape)
    assert entry["engine_settings"]["quantization"] == "fp8"
    assert entry["engine_settings"]["kv_cache_dtype"] == "fp8"
    fp8, full = _floors(shape)
    assert full.get("unquantized") and not fp8.get("unquantized")

    folder = tmp_path / "weights" / "tiny-llama-float32"
    llm = LLM(str(folder), device="cpu", quantization="fp8", kv_cache_dtype="fp8")
    model = llm.engine.model
    params = list(model.parameters())
    assert any(p.dtype == torch.float8_e4m3fn for p in params)
    held = sum(p.numel() * p.element_size() for p in params)
    embedding = model.embed_tokens.weight
    row = embedding.shape[1] * embedding.element_size()
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        saved = {k: fh.get_tensor(k) for k in fh.keys()}
    saved_bytes = sum(t.numel() * t.element_size() for t in saved.values())
    saved_embedding = saved["model.embed_tokens.weight"]
    saved_row = saved_embedding.shape[1] * saved_embedding.element_size()
    config = shape["config"]
    for b, quant_row, full_row in zip(BATCHES, fp8["batches"], full["batches"], strict=True):
        # untied: every weight once, the embedding only for the rows looked up
        want = held - embedding.numel() * embedding.element_size() + b * row
        assert quant_row["bytes_per_step"]["weights"] == want
        assert quant_row["bytes_per_step"]["kv_cache"] == _kv_bytes(config, 1, b)
        want_full = saved_bytes - saved_embedding.numel() * saved_embedding.element_size()
        assert full_row["bytes_per_step"]["weights"] == want_full + b * saved_row
        assert full_row["bytes_per_step"]["kv_cache"] == _kv_bytes(config, 4, b)
    llm.shutdown()


#: a tiny Llama whose rows are whole Q4_K blocks (256 values)
WIDE_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 256,
    "eos_token_id": 257,
}


def test_gguf_q4_k_floor_is_the_file_tensors_a_step_reads(tmp_path, monkeypatch):
    import gguf

    from backplane.models import presets

    name = "test-wide-llama"
    monkeypatch.setitem(presets.PRESETS, name, WIDE_LLAMA)
    shape = _bench(tmp_path, name, "--weights-format", "gguf-q4_k")
    _ran(shape)
    (floor,) = _floors(shape)

    path = tmp_path / "weights" / f"{name}-gguf-q4_k.gguf"
    reader = gguf.GGUFReader(str(path))
    qt = gguf.GGMLQuantizationType
    types = {t.name: t.tensor_type for t in reader.tensors}
    projections = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    for layer in range(WIDE_LLAMA["num_hidden_layers"]):
        for proj in projections:
            assert types[f"blk.{layer}.{proj}.weight"] == qt.Q4_K
    assert types["output.weight"] == qt.Q6_K
    assert types["token_embd.weight"] == qt.F16

    float32 = 4  # the CPU run's dtype: what the loader dequantises to
    for b, row in zip(BATCHES, floor["batches"], strict=True):
        want = 0
        for t in reader.tensors:
            if t.name == "rope_freqs.weight":
                continue  # read into the rotary frequencies at load
            if t.name == "token_embd.weight":
                want += b * WIDE_LLAMA["hidden_size"] * float32
            elif t.tensor_type in (qt.Q4_K, qt.Q6_K):
                want += int(t.n_bytes)
            else:
                want += int(t.n_elements) * float32
        assert row["bytes_per_step"]["weights"] == want
        assert row["bytes_per_step"]["kv_cache"] == _kv_bytes(WIDE_LLAMA, float32, b)

    # the file is kept and reused: a second run does not write it again
    stamp = path.stat().st_mtime_ns
    _bench(tmp_path, name, "--weights-format", "gguf-q4_k")
    assert path.stat().st_mtime_ns == stamp


def test_random_q4_k_and_q6_k_blocks_decode_to_small_centred_weights():
    import gguf

    from backplane.cli.bench.latency.random_gguf import random_blocks

    rng = np.random.default_rng(0)
    for qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
        raw = random_blocks(int(qtype), 64, 512, rng)
        assert raw.shape == (64, 512 // 256 * gguf.GGML_QUANT_SIZES[qtype][1])
        w = gguf.quants.dequantize(raw, qtype)
        assert w.shape == (64, 512)
        assert np.isfinite(w).all()
        assert abs(float(w.mean())) < 0.005
        assert 0.005 < float(w.std()) < 0.06


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--shapes", "tiny-nemotron-h", "--weights-format", "gguf-q4_k"], "llama-family"),
        (
            ["--shapes", "tiny-llama", "--weights-format", "gguf-q4_k", "--quantization", "fp8"],
            "give one of the two",
        ),
        (
            ["--shapes", "tiny-llama", "--weights-format", "gguf-q4_k", "-tp", "2"],
            "--tensor-parallel-size 1",
        ),
    ],
)
def test_storage_choices_that_cannot_run_are_user_errors(flags, message, capsys):
    assert main(["bench", "latency", "--device", "cpu", *flags]) == 2
    assert message in capsys.readouterr().err


def test_help_lists_the_storage_flags(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "latency", "--help"])
    out = capsys.readouterr().out
    for flag in ("--quantization", "--kv-cache-dtype", "--weights-format", "gguf-q4_k"):
        assert flag in out
