"""Nemotron-H (``NemotronHForCausalLM``): a Mamba2 / attention / MLP / MoE hybrid.

The layer sequence comes from ``hybrid_override_pattern`` (one character per
layer: ``M`` Mamba2, ``*`` attention, ``-`` MLP, ``E`` MoE) or, in newer
configs, ``layers_block_type`` (``linear_attention`` / ``mamba``,
``full_attention`` / ``attention``, ``mlp``, ``moe``). Every block is
``x + mixer(norm(x))`` with a single mixer. Attention uses no positional
embedding; MLPs are non-gated (``relu2``); the MoE uses DeepSeek-style
group-limited sigmoid routing with a shared expert and optional latent
projections.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from backplane.core.errors import ConfigError
from backplane.models.base import CausalLM, ModelConfig
from backplane.models.mixers import AttentionMixer, Mamba2Mixer
from backplane.models.mlp import MLP
from backplane.models.moe import MoE
from backplane.models.norm import RMSNorm
from backplane.models.parallel import vocab_parallel_embedding

PATTERN_CHARS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_BLOCK_ALIASES = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}


def block_types(cfg: ModelConfig) -> list[str]:
    """The per-layer block kinds (``mamba``, ``attention``, ``mlp``, ``moe``).

    :raises ConfigError: for unknown pattern characters or block names.
    """
    pattern = cfg.get("hybrid_override_pattern")
    if pattern:
        bad = sorted(set(pattern) - set(PATTERN_CHARS))
        if bad:
            raise ConfigError(
                f"hybrid_override_pattern has unknown characters {bad}; expected M, *, - or E"
            )
        return [PATTERN_CHARS[c] for c in pattern]
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not types:
        raise ConfigError("Nemotron-H config needs hybrid_override_pattern or layers_block_type")
    out = []
    for t in types:
        if t not in _BLOCK_ALIASES:
            raise ConfigError(
                f"unknown Nemotron-H block type {t!r}; expected {sorted(_BLOCK_ALIASES)}"
            )
        out.append(_BLOCK_ALIASES[t])
    return out


class NemotronHBlock(nn.Module):
    """``x + mixer(norm(x))``, with the residual addition fused into the norm.

    Takes the previous block's output and the residual stream; returns its
    mixer's output (not yet added) and the residual stream.
    """

    def __init__(self, kind: str, mixer: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(hidden_size, eps)
        self.mixer = mixer

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the block.

        :param positions: ``[T]`` token positions.
        :param x: ``[T, hidden]``: the previous block's output, or the embeddings.
        :param residual: the residual stream, ``None`` for the first block.
        :return: ``(output, residual)``; the block's full result is their sum.
        """
        fused = self.norm.project_input(x, residual, self.mixer)
        if fused is not None:
            projected, residual = fused
            if self.kind in ("mamba", "attention"):
                return self.mixer(positions, None, projected=projected), residual
            return self.mixer(None, projected=projected), residual
        h, residual = self.norm.norm_input(x, residual)
        if self.kind in ("mamba", "attention"):
            return self.mixer(positions, h), residual
        return self.mixer(h), residual


class NemotronHForCausalLM(CausalLM):
    """Nemotron-H hybrids; uses the ``ssm`` and ``attention`` families."""

    def __init__(self, config: ModelConfig, backends: dict[str, Any]) -> None:
        super().__init__(config, backends)
        cfg = config
        hidden = int(cfg.require("hidden_size"))
        self.hidden_size = hidden
        eps = float(cfg.get("layer_norm_epsilon", 1e-5))
        kinds = block_types(cfg)
        self.num_layers = len(kinds)
        self.backbone = nn.Module()
        self.backbone.embeddings = vocab_parallel_embedding(self.vocab_size, hidden)
        self.backbone.layers = nn.ModuleList(
            [NemotronHBlock(k, self._mixer(i, k), hidden, eps) for i, k in enumerate(kinds)]
        )
        self.backbone.norm_f = RMSNorm(hidden, eps)
        self._finish_init(hidden)

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The input embedding."""
        return self.backbone.embeddings

    def _mixer(self, layer_id: int, kind: str) -> nn.Module:
        cfg = self.config
        hidden = self.hidden_size
        if kind == "mamba":
            return Mamba2Mixer(
                layer_id,
                self.backend("ssm"),
                hidden,
                num_heads=int(cfg.require("mamba_num_heads")),
                head_dim=int(cfg.require("mamba_head_dim")),
                d_state=int(cfg.require("ssm_state_size")),
                n_groups=int(cfg.get("n_groups", cfg.get("mamba_n_groups", 1))),
                conv_kernel=int(cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4))),
                conv_bias=bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
                proj_bias=bool(cfg.get("use_bias", False)),
                norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
                chunk_size=int(cfg.get("chunk_size", cfg.get("mamba_chunk_size", 256))),
                act=cfg.get("mamba_hidden_act", "silu"),
            )
        if kind == "attention":
            heads = int(cfg.require("num_attention_heads"))
            head_dim = int(cfg.get("head_dim") or cfg.get("attention_head_dim") or hidden // heads)
            return AttentionMixer(
                layer_id,
                self.backend("attention"),
                hidden,
                heads,
                int(cfg.get("num_key_value_heads", heads)),
                head_dim,
                bias=bool(cfg.get("attention_bias", False)),
                o_bias=bool(cfg.get("attention_bias", False)),
                rotary=None,
            )
        act = cfg.get("mlp_hidden_act", "relu2")
        bias = bool(cfg.get("mlp_bias", False))
        if kind == "mlp":
            return MLP(
                hidden, int(cfg.require("intermediate_size")), act=act, gated=False, bias=bias
            )
        return MoE(
            hidden,
            int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 0))),
            int(cfg.require("num_experts_per_tok")),
            int(cfg.require("moe_intermediate_size")),
            act=act,
            gated=False,
            router="sigmoid_grouped",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            n_group=int(cfg.get("n_group", 1)),
            topk_group=int(cfg.get("topk_group", 1)),
            shared_intermediate_size=int(cfg.get("moe_shared_expert_intermediate_size", 0)),
            shared_name="shared_experts",
            latent_size=cfg.get("moe_latent_size"),
            bias=bias,
        )

    def checkpoint_to_module_name(self, name: str) -> str | None:
        """Ignore multi-token-prediction weights."""
        if name.startswith("mtp."):
            return None
        return super().checkpoint_to_module_name(name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Embed, run every block, apply the final norm."""
        x = self.backbone.embeddings(input_ids)
        residual = None
        for layer in self.backbone.layers:
            x, residual = layer(positions, x, residual)
        if residual is None:
            return self.backbone.norm_f(x)
        return self.backbone.norm_f.add_and_norm(x, residual)[0]
