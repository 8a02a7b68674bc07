"""An FP8 (e4m3) KV cache for a model's attention and MLA layers (``kv_cache_dtype="fp8"``).

Each attention layer's paged cache is allocated in ``float8_e4m3fn`` and holds
``key / k_scale`` and ``value / v_scale``, the layer's scales (given, or the
checkpoint's ``k_scale`` / ``v_scale`` of the layer, else 1.0), halving the
cache's bytes against bfloat16. Each MLA layer's latent cache (the latent and
the rotary key) holds ``row / kv_scale``, one scale per layer (the ``k_scale``
given for the layer, else 1.0). Only backends that declare
``supports_fp8_kv_cache`` run it (:data:`FP8_KV_BACKENDS` names them); a model
whose backend does not is refused before any cache is allocated.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from backplane.core.errors import ConfigError
from backplane.models.base import CausalLM
from backplane.models.mixers import AttentionMixer, MLAMixer
from backplane.models.mixers.base import PagedMixer

logger = logging.getLogger(__name__)

#: ``kv_cache_dtype`` spellings and the cache dtype each means (``None``: the model's dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}

#: the in-tree backends with an FP8 KV cache, by family (for the refusal's advice)
FP8_KV_BACKENDS: dict[str, tuple[str, ...]] = {
    "attention": ("torch", "triton", "flashinfer"),
    "mla": ("torch", "triton"),
}


def _refuse(family: str, backend: object, layer: str) -> ConfigError:
    """The error for a layer whose backend has no FP8 KV cache, naming the ones that have."""
    name = getattr(backend, "name", type(backend).__name__)
    others = ", ".join(FP8_KV_BACKENDS[family])
    return ConfigError(
        f"kv_cache_dtype='fp8' is not supported by the {name!r} {family} backend (layer "
        f"{layer}); use the torch {family} backend (backends: {{{family}: torch}}) or another "
        f"with an FP8 KV cache ({others}), or kv_cache_dtype='auto'"
    )


def use_fp8_kv_cache(lm: CausalLM, scales: dict[int, tuple[float, float]] | None = None) -> int:
    """Give every attention and MLA layer of ``lm`` an FP8 KV cache (before its caches are described).

    :param lm: the model.
    :param scales: ``{layer id: (k_scale, v_scale)}``; an attention layer left
        out takes the scales its checkpoint carried (``kv_cache_scales``, set
        while loading), else 1.0; an MLA layer's latent takes the ``k_scale``
        given, else 1.0.
    :return: how many layers now cache in FP8.
    :raises ConfigError: a layer's backend has no FP8 KV cache (naming it and
        the ones that have), or the model has another kind of paged layer.
    """
    scales = scales or {}
    layers = 0
    for name, m in lm.named_modules():
        if isinstance(m, AttentionMixer):
            if not getattr(m.backend, "supports_fp8_kv_cache", False):
                raise _refuse("attention", m.backend, name)
            found = m.__dict__.get("kv_cache_scales", {})
            default = (found.get("k_scale", 1.0), found.get("v_scale", 1.0))
            k_scale, v_scale = scales.get(m.spec.layer_id, default)
            m.spec = dataclasses.replace(m.spec, k_scale=float(k_scale), v_scale=float(v_scale))
            m.kv_cache_dtype = torch.float8_e4m3fn
            layers += 1
        elif isinstance(m, MLAMixer):
            if not getattr(m.backend, "supports_fp8_kv_cache", False):
                raise _refuse("mla", m.backend, name)
            kv_scale = scales.get(m.spec.layer_id, (1.0, 1.0))[0]
            m.spec = dataclasses.replace(m.spec, kv_scale=float(kv_scale))
            m.kv_cache_dtype = torch.float8_e4m3fn
            layers += 1
        elif isinstance(m, PagedMixer):
            raise ConfigError(
                f"kv_cache_dtype='fp8' is not supported for {type(m).__name__} layers ({name}) "
                "yet; use kv_cache_dtype='auto' for this model"
            )
    logger.info("FP8 (e4m3) KV cache in %d attention and MLA layers", layers)
    return layers
