"""Qwen3.5 text models (``Qwen3_5ForCausalLM``): gated DeltaNet + gated full attention, dense MLP.

The layer structure is Qwen3-Next's with separate ``in_proj_qkv`` /
``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` projections in the DeltaNet
layers and a dense MLP in every layer. Qwen3.5's multimodal rotary embedding
("mrope") reduces to the ordinary (partial) rotary embedding for text, where
the temporal, height and width positions are all the token position.

Checkpoints of the multimodal ``Qwen3_5ForConditionalGeneration`` load as
their language model: the nested ``text_config`` is used, weights under
``model.language_model.`` map to ``model.`` and the vision tower
(``model.visual.``) is skipped.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from backplane.models.base import ModelConfig
from backplane.models.mlp import MLP
from backplane.models.qwen3_next import Qwen3NextForCausalLM


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 dense text model; uses the ``attention``, ``delta`` and ``ssm`` (conv) families."""

    fused_qkvz: ClassVar[bool] = False
    ignored_checkpoint_patterns: ClassVar[tuple[str, ...]] = (r"^mtp\.", r"^model\.visual\.")
    checkpoint_prefixes: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.language_model.", "model."),
    )

    @classmethod
    def normalize_config(cls, config: ModelConfig) -> ModelConfig:
        """Lift ``text_config`` of a multimodal config (top-level keys it lacks are kept)."""
        text = config.get("text_config")
        if not text:
            return config
        merged = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
        merged.update(text)
        merged["architectures"] = config.get("architectures")
        if "tie_word_embeddings" in config:
            merged["tie_word_embeddings"] = config["tie_word_embeddings"]
        return ModelConfig(merged)

    def build_mlp(self, layer_id: int) -> nn.Module:
        """Dense gated MLP."""
        cfg = self.config
        return MLP(
            self.hidden_size, int(cfg["intermediate_size"]), act=cfg.get("hidden_act", "silu")
        )
