"""Qwen3 (``Qwen3ForCausalLM``): Llama-style attention with per-head q/k RMS norm."""

from __future__ import annotations

from backplane.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models; uses the ``attention`` family.

    Layers listed as ``"sliding_attention"`` in ``layer_types`` (when
    ``use_sliding_window`` is set) attend within ``sliding_window`` tokens.
    """

    qk_norm = "rms"

    def sliding_window(self, layer_id: int) -> int:
        """``sliding_window`` for sliding layers, else 0."""
        cfg = self.config
        if not cfg.get("use_sliding_window", False):
            return 0
        types = cfg.get("layer_types") or []
        if layer_id < len(types) and types[layer_id] == "sliding_attention":
            return int(cfg.get("sliding_window") or 0)
        return 0
