"""FP8 models from checkpoints: converting projections, reading FP8 tensors, quantising on load.

An FP8 checkpoint stores each quantised projection's ``weight`` in e4m3 next to
its scale (``weight_scale_inv`` or ``weight_scale``, and for static
activations ``input_scale``). Loading it:

1. :func:`convert_for_checkpoint` turns every projection whose checkpoint
   tensors all have scales into an FP8 projection (a merged q/k/v or gate/up
   projection only when every part is quantised);
2. :func:`fp8_checkpoint_tensors` rewrites the tensor stream the model loads:
   scales become row form under the module's ``weight_scale`` name, static
   ``input_scale`` values are set on their projection (the largest of a merged
   projection's parts), and an FP8 weight whose target stayed in full
   precision (MoE experts, MLA's ``kv_b_proj``, an unquantised sibling) is
   dequantised as it passes.

:func:`quantize_model` instead quantises a loaded full-precision model's
projections (``quantization="fp8"``): one scale per output row, dynamic
per-token activations. Embeddings, norms, the LM head, routers and gates stay
as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from backplane.core.errors import ConfigError
from backplane.models.base import CausalLM, WeightLoadError
from backplane.models.linear import Linear, MergedLinear
from backplane.models.mixers import AttentionMixer
from backplane.models.quant.fp8 import FP8_DTYPE, dequantize_rows, row_scales
from backplane.models.quant.projection import convert_linear, quantize_linear
from backplane.models.quant.scheme import Fp8Scheme

logger = logging.getLogger(__name__)

#: checkpoint tensor suffixes of weight scales, either layout
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
#: per-layer KV-cache scales a compressed-tensors checkpoint may carry (kept on the
#: attention layer as ``kv_cache_scales``, used by an FP8 KV cache)
_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")
#: projections whose weight a model reads as a matrix besides multiplying by it
#: (MLA splits ``kv_b_proj`` into per-head factors): always full precision, an
#: FP8 checkpoint's tensors dequantised as they load
_READ_AS_MATRIX = ("kv_b_proj",)
#: projections quantize_model leaves alone (by the module name's last part)
_KEEP_FULL_PRECISION = ("lm_head", "shared_expert_gate", *_READ_AS_MATRIX)


def checkpoint_keys(files: Iterable[Path]) -> list[str]:
    """The tensor names of safetensors files, read from their headers only.

    :param files: the checkpoint's files.
    :return: every tensor name.
    """
    from safetensors import safe_open

    keys: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            keys.extend(handle.keys())
    return keys


def _projections(lm: CausalLM) -> dict[str, tuple[Linear, tuple[str, ...]]]:
    """``{module name: (projection, the model-side checkpoint module names it loads)}``."""
    out: dict[str, tuple[Linear, tuple[str, ...]]] = {}
    for name, m in lm.named_modules():
        if isinstance(m, MergedLinear):
            parent = name.rpartition(".")[0]
            prefix = f"{parent}." if parent else ""
            out[name] = (m, tuple(prefix + part for part in m.part_names))
        elif isinstance(m, Linear):
            out[name] = (m, (name,))
    if lm.tie_word_embeddings:
        out.pop("lm_head", None)
    return out


def _module_of(lm: CausalLM, ckpt_name: str, suffix: str) -> str | None:
    """The model-side module name of checkpoint tensor ``ckpt_name`` (which ends in ``suffix``)."""
    mapped = lm.checkpoint_to_module_name(ckpt_name)
    return None if mapped is None or not mapped.endswith(suffix) else mapped[: -len(suffix)]


def convert_for_checkpoint(lm: CausalLM, keys: Iterable[str], scheme: Fp8Scheme) -> int:
    """Convert the projections an FP8 checkpoint stores quantised (before loading it).

    :param lm: the model, built in full precision and not yet loaded.
    :param keys: the checkpoint's tensor names (:func:`checkpoint_keys`).
    :param scheme: the checkpoint's scheme.
    :return: how many projections became FP8.
    :raises ConfigError: on a tensor-parallel rank (not supported with FP8 yet).
    """
    if lm.tp.enabled:
        raise ConfigError(
            "FP8 checkpoints do not load with tensor parallelism yet; use "
            "tensor_parallel_size=1 or the unquantised checkpoint"
        )
    scaled: set[str] = set()
    for key in keys:
        for suffix in _SCALE_SUFFIXES:
            if key.endswith(suffix):
                module = _module_of(lm, key, suffix)
                if module is not None:
                    scaled.add(module)
                break
    converted = 0
    for name, (linear, parts) in _projections(lm).items():
        if name.rpartition(".")[2] in _READ_AS_MATRIX:
            continue
        have = [p in scaled for p in parts]
        if all(have):
            convert_linear(linear, scheme.block_k, static=scheme.activations == "static")
            converted += 1
        elif any(have):
            logger.warning(
                "%s: only some of its parts (%s) are FP8 in the checkpoint; it stays in full "
                "precision and their weights are dequantised on load",
                name,
                ", ".join(p for p, h in zip(parts, have, strict=True) if h),
            )
    if not converted:
        logger.warning(
            "the checkpoint declares FP8 quantisation but no projection has all its scales; "
            "its weights load as stored"
        )
    logger.info(
        "FP8 checkpoint (%s weight scales, %s activations): %d projections kept in FP8",
        scheme.weights,
        scheme.activations,
        converted,
    )
    return converted


def fp8_checkpoint_tensors(
    lm: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], scheme: Fp8Scheme
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rewrite an FP8 checkpoint's tensor stream for a model :func:`convert_for_checkpoint` prepared.

    :param lm: the prepared model.
    :param tensors: ``(checkpoint name, tensor)`` pairs as read.
    :param scheme: the checkpoint's scheme.
    :return: the pairs :meth:`~backplane.models.base.CausalLM.load_weights` takes.
    :raises WeightLoadError: an FP8 weight without its scale, or a scale without its weight.
    """
    targets = lm.weight_targets()
    owners: dict[str, Linear] = {}
    for linear, parts in _projections(lm).values():
        if linear.quant is not None:
            owners.update(dict.fromkeys(parts, linear))
    static_seen: set[int] = set()
    weights: dict[str, torch.Tensor] = {}  # FP8 weights to dequantise, awaiting their scale
    scales: dict[str, torch.Tensor] = {}  # their scales, awaiting the weight
    for name, tensor in tensors:
        if name.endswith(_KV_SCALE_SUFFIXES):
            _keep_kv_scale(lm, name, tensor)
            continue
        if name.endswith(".input_scale"):
            module = _module_of(lm, name, ".input_scale")
            linear = owners.get(module) if module is not None else None
            if linear is not None and linear.quant.static:
                value = tensor.float().reshape(-1).amax().to(linear.input_scale.device)
                first = id(linear) not in static_seen
                static_seen.add(id(linear))
                with torch.no_grad():
                    linear.input_scale.copy_(value if first else linear.input_scale.max(value))
            continue
        suffix = next((s for s in _SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is not None:
            base = name[: -len(suffix)]
            scale_name = f"{base}.weight_scale"
            mapped = lm.checkpoint_to_module_name(scale_name)
            if mapped is None:
                continue
            target = targets.get(mapped)
            if target is not None:
                rows = target[0].shape[0]
                cols = owners[mapped[: -len(".weight_scale")]].in_features
                yield scale_name, row_scales(tensor, rows, cols, scheme.weights, scheme.block)
                continue
            weight = weights.pop(f"{base}.weight", None)
            if weight is None:
                scales[f"{base}.weight"] = tensor
            else:
                yield f"{base}.weight", _dequantize(weight, tensor, scheme)
            continue
        if tensor.dtype == FP8_DTYPE:
            mapped = lm.checkpoint_to_module_name(name)
            target = targets.get(mapped) if mapped is not None else None
            if mapped is None or (target is not None and target[0].dtype == FP8_DTYPE):
                yield name, tensor
                continue
            scale = scales.pop(name, None)
            if scale is None:
                weights[name] = tensor
            else:
                yield name, _dequantize(tensor, scale, scheme)
            continue
        yield name, tensor
    if weights:
        first = sorted(weights)[0]
        raise WeightLoadError(
            f"FP8 tensor {first!r} has no {scheme.scale_name} tensor next to it "
            f"({len(weights)} such tensors); the checkpoint is incomplete",
            tensor=first,
        )
    if scales:
        first = sorted(scales)[0]
        raise WeightLoadError(
            f"the checkpoint holds a scale for {first!r} but not that weight",
            tensor=first,
        )


def _keep_kv_scale(lm: CausalLM, name: str, tensor: torch.Tensor) -> None:
    """Keep a checkpoint's ``k_scale`` / ``v_scale`` on its attention layer."""
    leaf = name.rpartition(".")[2]
    module = _module_of(lm, name, f".{leaf}")
    try:
        mixer = lm.get_submodule(module) if module is not None else None
    except AttributeError:
        mixer = None
    if not isinstance(mixer, AttentionMixer):
        logger.debug("ignoring KV-cache scale %s (no attention layer of that name)", name)
        return
    scales = mixer.__dict__.setdefault("kv_cache_scales", {})
    scales[leaf] = float(tensor.float().reshape(-1).amax())


def _dequantize(weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme) -> torch.Tensor:
    """A checkpoint's FP8 weight times its checkpoint-form scale, in float32."""
    if weight.dim() != 2:
        return weight.float() * scale.float()
    rows, cols = weight.shape
    per_row = row_scales(scale, rows, cols, scheme.weights, scheme.block)
    block_k = scheme.block[1] if scheme.weights == "block" else cols
    return dequantize_rows(weight, per_row, block_k, torch.float32)


def quantize_model(lm: CausalLM, *, skip: Iterable[str] = _KEEP_FULL_PRECISION) -> int:
    """Quantise a loaded model's projections to FP8 (``quantization="fp8"``).

    :param lm: the model, its full-precision weights loaded.
    :param skip: last parts of module names left in full precision (the LM head, gates).
    :return: how many projections were quantised.

    On a tensor-parallel rank each projection's shard is quantised: a
    column-parallel shard gets the scales the whole projection's rows would
    get; a row-parallel shard's rows are scaled over its own columns, and its
    partial product is summed over the ranks in the activations' dtype.
    """
    keep = tuple(skip)
    done = 0
    for name, (linear, _) in _projections(lm).items():
        if linear.quant is not None or name.rpartition(".")[2] in keep:
            continue
        if linear.packed_weight is not None:
            continue
        if _shared(lm, linear.weight):
            continue
        quantize_linear(linear)
        done += 1
    logger.info(
        "quantised %d projections to FP8 (per-channel weights, per-token activations)", done
    )
    return done


def _shared(lm: nn.Module, weight: torch.Tensor) -> bool:
    """Whether another parameter of ``lm`` uses ``weight``'s memory (a tied matrix)."""
    if weight.device.type == "meta":
        # meta tensors have no memory (every data_ptr is 0): a tied matrix is one parameter
        # reached under two names
        found = lm.named_parameters(remove_duplicate=False)
        return sum(p is weight for _, p in found) > 1
    ptr = weight.data_ptr()
    return sum(p.data_ptr() == ptr for p in lm.parameters()) > 1
