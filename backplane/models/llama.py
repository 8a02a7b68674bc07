"""Llama (``LlamaForCausalLM``): GQA attention with RoPE (incl. "llama3" scaling) and a gated MLP."""

from __future__ import annotations

from torch import nn

from backplane.models.base import DecoderLayer, DecoderOnlyLM
from backplane.models.mlp import MLP


class LlamaForCausalLM(DecoderOnlyLM):
    """Llama 2/3 and compatible checkpoints; uses the ``attention`` family."""

    #: q/k RMS norm per head (Qwen3); ``None`` for Llama
    qk_norm: str | None = None

    def build_layer(self, layer_id: int) -> nn.Module:
        """Attention + gated MLP layer."""
        cfg = self.config
        attn = self.attention_mixer(
            layer_id, qk_norm=self.qk_norm, sliding_window=self.sliding_window(layer_id)
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
