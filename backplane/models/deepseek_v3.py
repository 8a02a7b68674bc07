"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-head latent attention and a routed MoE.

The first ``first_k_dense_replace`` layers use a dense MLP, the rest a MoE with
shared experts and group-limited top-k routing (sigmoid scores,
``e_score_correction_bias``, ``routed_scaling_factor``). Multi-token-prediction
layers stored after the last decoder layer are ignored unless speculation asks
for them (:func:`backplane.models.mtp.attach_mtp`).
"""

from __future__ import annotations

from torch import nn

from backplane.models.base import DecoderLayer, DecoderOnlyLM
from backplane.models.mixers import MLAMixer
from backplane.models.mlp import MLP
from backplane.models.moe import MoE
from backplane.models.mtp import DeepseekMTP, MTPHost
from backplane.models.rotary import RotaryEmbedding, rope_parameters, yarn_mscale


class DeepseekV3ForCausalLM(MTPHost, DecoderOnlyLM):
    """DeepSeek-V3 / R1 style models; uses the ``mla`` family."""

    mtp_class = DeepseekMTP

    def build_layer(self, layer_id: int) -> nn.Module:
        """MLA + dense MLP or MoE layer."""
        cfg = self.config
        nope = int(cfg.require("qk_nope_head_dim"))
        rope_dim = int(cfg.require("qk_rope_head_dim"))
        params = rope_parameters(cfg)
        if not hasattr(self, "rotary"):
            self.rotary = RotaryEmbedding(
                rope_dim,
                params,
                self.max_model_len,
                interleaved=bool(cfg.get("rope_interleave", True)),
            )
        scale = (nope + rope_dim) ** -0.5
        if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
            m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
            scale = scale * m * m
        attn = MLAMixer(
            layer_id,
            self.backend("mla"),
            self.hidden_size,
            int(cfg["num_attention_heads"]),
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=int(cfg.require("kv_lora_rank")),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(cfg.require("v_head_dim")),
            scale=scale,
            rotary=self.rotary,
            bias=bool(cfg.get("attention_bias", False)),
            norm_eps=self.norm_eps,
        )
        act = cfg.get("hidden_act", "silu")
        if layer_id < int(cfg.get("first_k_dense_replace", 0)):
            mlp: nn.Module = MLP(self.hidden_size, int(cfg["intermediate_size"]), act=act)
        else:
            moe_inter = int(cfg.require("moe_intermediate_size"))
            mlp = MoE(
                self.hidden_size,
                int(cfg.require("n_routed_experts")),
                int(cfg.require("num_experts_per_tok")),
                moe_inter,
                act=act,
                router="sigmoid_grouped",
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                n_group=int(cfg.get("n_group", 1)),
                topk_group=int(cfg.get("topk_group", 1)),
                shared_intermediate_size=moe_inter * int(cfg.get("n_shared_experts", 0)),
                shared_name="shared_experts",
            )
        return DecoderLayer("self_attn", attn, mlp, self.hidden_size, self.norm_eps)
