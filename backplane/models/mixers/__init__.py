"""The mixers: a layer's projections around the one op family that needs the cache.

* :class:`AttentionMixer` -> ``attention`` (Llama, Qwen3, Nemotron-H, and the
  output-gated attention of Qwen3-Next / Qwen3.5);
* :class:`MLAMixer` -> ``mla`` (DeepSeek-V3);
* :class:`Mamba2Mixer` -> ``ssm`` (``conv`` and ``scan``; Nemotron-H);
* :class:`GatedDeltaNetMixer` -> ``ssm`` (``conv``) and ``delta`` (Qwen3-Next, Qwen3.5).

Each derives from :class:`CachedMixer`, which holds the layer's bound cache tensors.
"""

from __future__ import annotations

from backplane.models.mixers.attention import AttentionMixer
from backplane.models.mixers.base import CachedMixer
from backplane.models.mixers.gated_delta import GatedDeltaNetMixer
from backplane.models.mixers.mamba2 import Mamba2Mixer
from backplane.models.mixers.mla import MLAMixer

__all__ = [
    "AttentionMixer",
    "CachedMixer",
    "GatedDeltaNetMixer",
    "MLAMixer",
    "Mamba2Mixer",
]
