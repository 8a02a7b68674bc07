"""Model implementations (HF-config compatible), the loader and built-in presets.

* :func:`load_model` — a local model directory or a preset name -> :class:`LoadedModel`;
* :data:`ARCHITECTURES` — the supported HF ``architectures`` names;
* :data:`PRESETS` — the built-in tiny models.
"""

from __future__ import annotations

from backplane.models.base import CausalLM, ModelConfig, WeightLoadError
from backplane.models.loaded import LoadedModel
from backplane.models.loader import load_model
from backplane.models.presets import PRESETS
from backplane.models.registry import ARCHITECTURES, model_class, supported_architectures

__all__ = [
    "ARCHITECTURES",
    "PRESETS",
    "CausalLM",
    "LoadedModel",
    "ModelConfig",
    "WeightLoadError",
    "load_model",
    "model_class",
    "supported_architectures",
]
