"""The memory floor of a model the engine holds quantised: FP8 projections, an FP8 KV cache.

``--quantization fp8`` has the engine quantise the saved full-precision
projections on load, and ``--kv-cache-dtype fp8`` stores the KV cache in
e4m3. The bytes a step then reads are counted from the model's own rules: the
model is built on the ``meta`` device (no memory), the engine's quantisation
(:func:`~backplane.models.quant.loading.quantize_model`) and FP8 cache
(:func:`~backplane.models.quant.kv_cache.use_fp8_kv_cache`) are applied to
it, and the sizes of its parameters and cache tensors are read back. What the
rules leave alone (embeddings, norms, the LM head, routed experts) keeps its
size in the run's dtype.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from backplane.cli.bench.latency.settings import FAMILIES
from backplane.cli.bench.latency.weights import WeightsInfo, cache_sizes

__all__ = ["held_weights_info", "is_held_quantized"]


def is_held_quantized(quantization: str | None, kv_cache_dtype: str) -> bool:
    """Whether the engine holds weights or KV cache in a form other than the run's dtype.

    :param quantization: ``"fp8"`` or ``None``.
    :param kv_cache_dtype: ``"auto"`` or ``"fp8"``.
    :return: ``True`` when :func:`held_weights_info` changes any size.
    """
    return quantization is not None or kv_cache_dtype != "auto"


def _meta_model(path: str, dtype: Any) -> Any:
    """The model of a saved folder or a GGUF file, built on the ``meta`` device (no weights).

    :param path: an HF folder (``config.json`` + safetensors) or a ``.gguf`` file.
    :param dtype: the ``torch.dtype`` the engine holds it in.
    :return: the built ``CausalLM``.
    """
    from backplane.engine.selection import select_backends_for
    from backplane.models.base import build_model
    from backplane.models.registry import model_class

    file = Path(path)
    if file.suffix.lower() == ".gguf" and file.is_file():
        from backplane.models.gguf import open_gguf_checkpoint

        config = open_gguf_checkpoint(file).config
    else:
        from backplane.models.loader import read_config

        config = read_config(file)
    cls = model_class(config.get("architectures"))
    config = cls.normalize_config(config)
    backends = select_backends_for(dict.fromkeys(FAMILIES, "torch"), device="cpu")
    return build_model(cls, config, backends, dtype=dtype, device="meta")


def _parameter_bytes(model: Any) -> int:
    """Bytes of ``model``'s parameters, each tensor once (a tied matrix is one parameter)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def held_weights_info(
    info: WeightsInfo, dtype: Any, *, quantization: str | None, kv_cache_dtype: str
) -> WeightsInfo:
    """The sizes of ``info``'s model as the engine holds it with these options.

    FP8 projections change the weight bytes by what quantising changes in the
    model's parameters (an e4m3 byte per weight and a float32 scale per output
    row in place of the weight in ``dtype``); an FP8 KV cache gives the KV
    bytes per token of the layers' e4m3 caches. The embedding, the LM head,
    routed experts and the recurrent state are as in ``info``.

    :param info: the sizes of the saved model in ``dtype`` (its ``folder`` is
        read for the config).
    :param dtype: the ``torch.dtype`` of the run.
    :param quantization: ``"fp8"`` or ``None``.
    :param kv_cache_dtype: ``"auto"`` or ``"fp8"``.
    :return: a copy of ``info`` with the held sizes.
    :raises ConfigError: a model the engine would refuse these options for
        (e.g. an FP8 KV cache for a layer kind without one).
    """
    if not is_held_quantized(quantization, kv_cache_dtype):
        return info
    model = _meta_model(info.folder, dtype)
    changes: dict[str, Any] = {}
    if quantization == "fp8":
        from backplane.models.quant.loading import quantize_model

        before = _parameter_bytes(model)
        quantize_model(model)
        changes["weight_bytes"] = info.weight_bytes + _parameter_bytes(model) - before
    if kv_cache_dtype != "auto":
        from backplane.models.quant.kv_cache import use_fp8_kv_cache

        use_fp8_kv_cache(model)
        changes["kv_bytes_per_token"], _ = cache_sizes(model, dtype)
    return dataclasses.replace(info, **changes)
