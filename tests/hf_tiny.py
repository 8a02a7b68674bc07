"""Tiny Hugging Face model configs and helpers shared by the parity and end-to-end tests."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import transformers

VOCAB = 96


def llama() -> Any:
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_bias=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    )


def qwen3() -> Any:
    return transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def nemotron_h() -> Any:
    return transformers.NemotronHConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        hybrid_override_pattern="M*-ME",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=24,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
    )


def deepseek_v3() -> Any:
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        max_position_embeddings=64,
    )


def deepseek_v3_q_proj() -> Any:
    """DeepSeek-V2-Lite style attention: a plain ``q_proj`` (no ``q_lora_rank``), pairs
    ``(i, i + d/2)`` rotated (``rope_interleave`` off)."""
    cfg = deepseek_v3()
    cfg.q_lora_rank = None
    cfg.rope_interleave = False
    return cfg


def deepseek_v3_q_proj_bias() -> Any:
    """A plain ``q_proj`` (never biased) next to a biased ``kv_a_proj_with_mqa``."""
    cfg = deepseek_v3()
    cfg.q_lora_rank = None
    cfg.attention_bias = True
    return cfg


def qwen3_5() -> Any:
    return transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        max_position_embeddings=64,
    )


def qwen3_next() -> Any:
    return transformers.Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        decoder_sparse_step=1,
        mlp_only_layers=[2],
        max_position_embeddings=64,
    )


@contextlib.contextmanager
def hf_torch_path(module_name: str) -> Iterator[None]:
    """Make a transformers modeling module use its own torch code.

    transformers binds fla / mamba-ssm / causal-conv1d kernels at import time
    when those packages are installed; their Triton kernels need a GPU, so the
    reference runs swap every such wrapped function back to the torch original.
    """
    mod = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    saved = {}
    for attr, value in vars(mod).items():
        wrapped = getattr(value, "__wrapped__", None)
        if (
            callable(value)
            and wrapped is not None
            and getattr(value, "__module__", "") == mod.__name__
        ):
            saved[attr] = value
    try:
        for attr, value in saved.items():
            setattr(mod, attr, value.__wrapped__)
        yield
    finally:
        for attr, value in saved.items():
            setattr(mod, attr, value)
