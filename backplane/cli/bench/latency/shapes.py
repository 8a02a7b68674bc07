"""The model shapes ``backplane bench latency`` and ``bench throughput`` measure, as HF ``config.json`` dicts.

Two ~1B shapes of the same width, a dense one and a hybrid one
(``llama-1b``, ``nemotron-h-0.85b``); the shapes of published models that
published figures exist for (``llama-3.2-1b`` with its tied 128k vocabulary,
``llama-3.1-8b``, ``qwen3-8b``, ``nemotron-h-8b``); a Qwen3-Next-shaped
hybrid with one MTP layer for speculative decoding (``qwen3-next-1b-mtp``);
and a lookup that also accepts any built-in preset (the tiny ones run on a
CPU) and a model directory.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from backplane.core.errors import ConfigError

LLAMA_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""The ~1.1B Llama shape (the one ``benchmarks/bench_graphs.py`` measures)."""

NEMOTRON_H_085B: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": 32000,
    "hidden_size": 2048,
    # 10 Mamba2 (M), 2 attention (*) and 12 MLP (-) layers
    "hybrid_override_pattern": "M-M-M-M-*-M-M-M-*-M-M-M-",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "mlp_hidden_act": "relu2",
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "chunk_size": 128,
    "use_conv_bias": True,
    "use_bias": False,
    "mlp_bias": False,
    "attention_bias": False,
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
"""A ~0.85B Nemotron-H-shaped hybrid (24 layers: 10 Mamba2 + 2 attention + 12 MLP)."""

_LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

LLAMA_32_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": dict(_LLAMA3_ROPE, factor=32.0),
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
"""Llama-3.2-1B's shape: the 1.1B body with a tied 128k vocabulary."""

LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": dict(_LLAMA3_ROPE, factor=8.0),
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
"""Llama-3.1-8B's shape."""

QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
"""Qwen3-8B's shape (per-head q/k RMS norm)."""

NEMOTRON_H_8B: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": 131072,
    "hidden_size": 4096,
    # 52 layers: 24 Mamba2 (M), 4 attention (*) and 24 MLP (-)
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 21504,
    "mlp_hidden_act": "relu2",
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "chunk_size": 128,
    "use_conv_bias": True,
    "use_bias": False,
    "mlp_bias": False,
    "attention_bias": False,
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
"""Nemotron-H-8B's shape (a 52-layer Mamba2 / attention / MLP hybrid)."""

QWEN3_NEXT_1B_MTP: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "num_hidden_layers": 12,
    # Qwen3-Next's rhythm: three gated delta-rule layers, then one of full attention
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 3,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 1024,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
    },
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "mtp_num_hidden_layers": 1,
}
"""A ~1.2B Qwen3-Next-shaped hybrid with one MTP layer, for speculative method ``mtp``
(12 layers: 9 gated delta-rule + 3 attention, each with 16 experts of 512, 4 routed per token)."""

SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": LLAMA_1B,
    "nemotron-h-0.85b": NEMOTRON_H_085B,
    "llama-3.2-1b": LLAMA_32_1B,
    "llama-3.1-8b": LLAMA_31_8B,
    "qwen3-8b": QWEN3_8B,
    "nemotron-h-8b": NEMOTRON_H_8B,
    "qwen3-next-1b-mtp": QWEN3_NEXT_1B_MTP,
}
"""The model shapes by name, as HF ``config.json`` dicts."""


def shape_config(name: str) -> dict[str, Any]:
    """Return the HF config dict of shape ``name`` (a copy).

    :param name: a key of :data:`SHAPES`, a built-in preset name, a model
        directory (``config.json`` + safetensors), a ``.gguf`` file or an
        installed model's name (``smollm2``); a checkpoint's config is returned
        as its architecture reads it.
    :return: a deep copy, so that callers may edit it.
    :raises ConfigError: unknown name, listing the known ones; a directory of an
        unsupported architecture.
    """
    from backplane.models import presets

    if name in SHAPES:
        return json.loads(json.dumps(SHAPES[name]))
    if name in presets.PRESETS:
        return json.loads(json.dumps(presets.PRESETS[name]))
    if is_model_dir(name):
        from backplane.models.loader import read_config
        from backplane.models.registry import model_class

        config = read_config(name)
        config = model_class(config.get("architectures")).normalize_config(config)
        return json.loads(json.dumps(dict(config)))
    from backplane.cli.bench.latency.checkpoint import checkpoint_config, checkpoint_file

    gguf = checkpoint_file(name)
    if gguf is not None:
        return checkpoint_config(gguf)
    known = [*SHAPES, *sorted(presets.PRESETS), *sorted(presets.INSTALLED_MODELS)]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(
        f"unknown shape {name!r}{hint}; the shapes are: {', '.join(known)}, "
        "a model directory with a config.json, or a .gguf file"
    )


def is_model_dir(name: str) -> bool:
    """Whether shape ``name`` is a model directory rather than a named shape or preset.

    :param name: what ``--shapes`` / ``--model`` said.
    :return: ``True`` for a directory holding a ``config.json`` whose path is
        not also a shape's or a preset's name (the names win).
    """
    from backplane.models import presets

    if name in SHAPES or name in presets.PRESETS:
        return False
    path = Path(name)
    return path.is_dir() and (path / "config.json").is_file()
