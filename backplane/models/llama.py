"""Llama (``LlamaForCausalLM``): GQA attention with RoPE (incl. "llama3" scaling) and a gated MLP."""

from __future__ import annotations

from torch import nn

from backplane.models.base import DecoderLayer, DecoderOnlyLM
from backplane.models.mixers import AttentionMixer
from backplane.models.mlp import MLP
from backplane.models.rotary import RotaryEmbedding, rope_parameters


def attention_head_dim(config) -> int:
    """``head_dim`` from the config, or ``hidden_size // num_attention_heads``."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


class LlamaForCausalLM(DecoderOnlyLM):
    """Llama 2/3 and compatible checkpoints; uses the ``attention`` family."""

    #: q/k RMS norm per head (Qwen3); ``None`` for Llama
    qk_norm: str | None = None

    def build_layer(self, layer_id: int) -> nn.Module:
        """Attention + gated MLP layer."""
        cfg = self.config
        head_dim = attention_head_dim(cfg)
        if not hasattr(self, "rotary"):
            params = rope_parameters(cfg)
            rot = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
            self.rotary = RotaryEmbedding(rot, params, self.max_model_len)
        bias = bool(cfg.get("attention_bias", False))
        attn = AttentionMixer(
            layer_id,
            self.backend("attention"),
            self.hidden_size,
            int(cfg["num_attention_heads"]),
            int(cfg.get("num_key_value_heads", cfg["num_attention_heads"])),
            head_dim,
            bias=bias,
            qk_norm=self.qk_norm,
            norm_eps=self.norm_eps,
            rotary=self.rotary,
            sliding_window=self.sliding_window(layer_id),
        )
        mlp = MLP(
            self.hidden_size,
            int(cfg["intermediate_size"]),
            act=cfg.get("hidden_act", "silu"),
            bias=bool(cfg.get("mlp_bias", False)),
        )
        return DecoderLayer("self_attn", attn, mlp, self.hidden_size, self.norm_eps)

    def sliding_window(self, layer_id: int) -> int:
        """The sliding window of layer ``layer_id`` (0 = full attention)."""
        return 0
