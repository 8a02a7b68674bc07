"""Qwen3-Next (``Qwen3NextForCausalLM``): gated DeltaNet + gated full attention + MoE.

``layer_types`` (or every ``full_attention_interval``-th layer) chooses full
attention, the rest are gated DeltaNet layers. Full attention has an output
gate, zero-centred q/k norms and partial rotary embeddings. Feed-forward layers
are a softmax-routed MoE with a sigmoid-gated shared expert, except those in
``mlp_only_layers`` (dense). Multi-token-prediction weights (``mtp.*``) are ignored
unless speculation asks for them (:func:`backplane.models.mtp.attach_mtp`).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from backplane.models.base import DecoderLayer, DecoderOnlyLM
from backplane.models.mixers import GatedDeltaNetMixer
from backplane.models.mlp import MLP
from backplane.models.moe import MoE
from backplane.models.mtp import MTPHost, Qwen3NextMTP


def layer_types(cfg) -> list[str]:
    """``layer_types`` from the config, or derived from ``full_attention_interval``."""
    types = cfg.get("layer_types")
    if types:
        return list(types)
    interval = int(cfg.get("full_attention_interval", 4))
    n = int(cfg["num_hidden_layers"])
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


class Qwen3NextForCausalLM(MTPHost, DecoderOnlyLM):
    """Qwen3-Next; uses the ``attention``, ``delta`` and ``ssm`` (its causal conv) families."""

    mtp_class = Qwen3NextMTP

    zero_centered_norms = True
    ignored_checkpoint_patterns: ClassVar[tuple[str, ...]] = (r"^mtp\.",)
    #: Qwen3-Next packs q/k/v/z per key head; Qwen3.5 uses separate projections.
    fused_qkvz: ClassVar[bool] = True

    def build_layer(self, layer_id: int) -> nn.Module:
        """Delta or attention mixer + MoE or dense MLP."""
        cfg = self.config
        kind = layer_types(cfg)[layer_id]
        if kind == "full_attention":
            mixer: nn.Module = self.attention_mixer(
                layer_id, qk_norm="rms_zero_centered", output_gate=True
            )
            name = "self_attn"
        elif kind == "linear_attention":
            mixer = GatedDeltaNetMixer(
                layer_id,
                self.backend("ssm"),
                self.backend("delta"),
                self.hidden_size,
                num_k_heads=int(cfg.require("linear_num_key_heads")),
                num_v_heads=int(cfg.require("linear_num_value_heads")),
                k_head_dim=int(cfg.require("linear_key_head_dim")),
                v_head_dim=int(cfg.require("linear_value_head_dim")),
                conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
                fused_qkvz=self.fused_qkvz,
                norm_eps=self.norm_eps,
                act=cfg.get("hidden_act", "silu"),
            )
            name = "linear_attn"
        else:
            from backplane.core.errors import ConfigError

            raise ConfigError(f"layer {layer_id}: unknown layer type {kind!r}")
        return DecoderLayer(
            name, mixer, self.build_mlp(layer_id), self.hidden_size, self.norm_eps, True
        )

    def build_mlp(self, layer_id: int) -> nn.Module:
        """Sparse MoE on ``decoder_sparse_step`` layers outside ``mlp_only_layers``, else dense."""
        cfg = self.config
        act = cfg.get("hidden_act", "silu")
        num_experts = int(cfg.get("num_experts", 0))
        step = int(cfg.get("decoder_sparse_step", 1))
        if (
            num_experts > 0
            and layer_id not in (cfg.get("mlp_only_layers") or [])
            and (layer_id + 1) % step == 0
        ):
            return MoE(
                self.hidden_size,
                num_experts,
                int(cfg.require("num_experts_per_tok")),
                int(cfg.require("moe_intermediate_size")),
                act=act,
                router="softmax",
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0)),
                shared_name="shared_expert",
                shared_gate=True,
            )
        return MLP(self.hidden_size, int(cfg["intermediate_size"]), act=act)
