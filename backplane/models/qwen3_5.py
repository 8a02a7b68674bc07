"""Qwen3.5 text models (``Qwen3_5ForCausalLM``): gated DeltaNet + gated full attention, dense MLP.

The layer structure is Qwen3-Next's with separate ``in_proj_qkv`` /
``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` projections in the DeltaNet
layers and a dense MLP in every layer. Qwen3.5's multimodal rotary embedding
("mrope") reduces to the ordinary (partial) rotary embedding for text, where
the temporal, height and width positions are all the token position.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from backplane.models.layers import MLP
from backplane.models.qwen3_next import Qwen3NextForCausalLM


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 dense text model; uses the ``attention``, ``delta`` and ``ssm`` (conv) families."""

    fused_qkvz: ClassVar[bool] = False
    ignored_checkpoint_patterns: ClassVar[tuple[str, ...]] = (r"^mtp\.", r"^model\.visual\.")

    def build_mlp(self, layer_id: int) -> nn.Module:
        """Dense gated MLP."""
        cfg = self.config
        return MLP(
            self.hidden_size, int(cfg["intermediate_size"]), act=cfg.get("hidden_act", "silu")
        )
