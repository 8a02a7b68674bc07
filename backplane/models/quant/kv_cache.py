"""An FP8 (e4m3) KV cache for a model's attention layers (``kv_cache_dtype="fp8"``).

Each attention layer's paged cache is allocated in ``float8_e4m3fn`` and holds
``key / k_scale`` and ``value / v_scale``, the layer's scales (given, or the
checkpoint's ``k_scale`` / ``v_scale`` of the layer, else 1.0), halving the cache's bytes against bfloat16. Only
attention backends that declare
:attr:`~backplane.core.families.AttentionBackend.supports_fp8_kv_cache` (the
torch one) run it; MLA layers keep the model's dtype.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from backplane.core.errors import ConfigError
from backplane.models.base import CausalLM
from backplane.models.mixers import AttentionMixer
from backplane.models.mixers.base import PagedMixer

logger = logging.getLogger(__name__)

#: ``kv_cache_dtype`` spellings and the cache dtype each means (``None``: the model's dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def use_fp8_kv_cache(lm: CausalLM, scales: dict[int, tuple[float, float]] | None = None) -> int:
    """Give every attention layer of ``lm`` an FP8 KV cache (before its caches are described).

    :param lm: the model.
    :param scales: ``{layer id: (k_scale, v_scale)}``; a layer left out takes
        the scales its checkpoint carried (``kv_cache_scales``, set while
        loading), else 1.0.
    :return: how many layers now cache in FP8.
    :raises ConfigError: the attention backend has no FP8 KV cache (naming it
        and the one that has), or the model has MLA layers.
    """
    scales = scales or {}
    layers = 0
    for name, m in lm.named_modules():
        if isinstance(m, AttentionMixer):
            backend = m.backend
            if not getattr(backend, "supports_fp8_kv_cache", False):
                raise ConfigError(
                    f"kv_cache_dtype='fp8' is not supported by the {backend.name!r} attention "
                    "backend; the torch attention backend supports it (backends: {attention: "
                    "torch}), or use kv_cache_dtype='auto'"
                )
            found = m.__dict__.get("kv_cache_scales", {})
            default = (found.get("k_scale", 1.0), found.get("v_scale", 1.0))
            k_scale, v_scale = scales.get(m.spec.layer_id, default)
            m.spec = dataclasses.replace(m.spec, k_scale=float(k_scale), v_scale=float(v_scale))
            m.kv_cache_dtype = torch.float8_e4m3fn
            layers += 1
        elif isinstance(m, PagedMixer):
            raise ConfigError(
                f"kv_cache_dtype='fp8' is not supported for {type(m).__name__} layers ({name}) "
                "yet; use kv_cache_dtype='auto' for this model"
            )
    logger.info("FP8 (e4m3) KV cache in %d attention layers", layers)
    return layers
