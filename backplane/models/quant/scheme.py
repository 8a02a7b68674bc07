"""What a checkpoint's ``quantization_config`` asks for, as an :class:`Fp8Scheme`.

Two FP8 layouts load: Hugging Face's ``quant_method: "fp8"`` (block-wise
``weight_scale_inv`` with ``weight_block_size``, as DeepSeek-V3 ships, or one
``weight_scale`` per tensor) and compressed-tensors' ``float-quantized`` format
(llm-compressor: ``weight_scale`` per tensor, channel or block, optional static
``input_scale``). Every other method is refused by :func:`scheme_from_config`
with one line naming it and what is supported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backplane.core.errors import ConfigError

#: what the refusals and the engine's ``quantization`` option say is supported
SUPPORTED = (
    "FP8 checkpoints (quant_method 'fp8', or 'compressed-tensors' in the float-quantized "
    "format) and quantization='fp8' on a full-precision checkpoint"
)

#: weight scale granularities
GRANULARITIES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's projections are quantised to FP8 (e4m3).

    :param weights: weight scale granularity, one of :data:`GRANULARITIES`.
    :param block: ``(rows, columns)`` of a weight block (``"block"`` only).
    :param activations: ``"dynamic"`` (scales computed per step) or
        ``"static"`` (the checkpoint's ``input_scale``, one per projection).
    :param scale_name: the checkpoint's name of the weight scale
        (``weight_scale`` or ``weight_scale_inv``).
    :param ignore: checkpoint module names (or ``re:`` patterns) left unquantised.
    """

    weights: str = "channel"
    block: tuple[int, int] = (128, 128)
    activations: str = "dynamic"
    scale_name: str = "weight_scale"
    ignore: tuple[str, ...] = field(default=())

    @property
    def block_k(self) -> int | None:
        """Input columns per weight scale, or ``None`` for one per row (tensor, channel)."""
        return self.block[1] if self.weights == "block" else None


def scheme_from_config(quant: Any, origin: str) -> Fp8Scheme:
    """Read a ``quantization_config`` (or refuse it).

    :param quant: the ``quantization_config`` value of ``config.json``.
    :param origin: where it came from, for the messages
        (``.../config.json: quantization_config``).
    :return: the scheme of an FP8 checkpoint.
    :raises ConfigError: a method or format backplane does not load, naming it
        and what is supported.
    """
    if not isinstance(quant, dict):
        raise ConfigError(
            f"{origin}: quantization_config must be a JSON object, got {quant!r}; supported: "
            f"{SUPPORTED}"
        )
    method = str(quant.get("quant_method", "unknown")).lower()
    if method == "fp8":
        return _hf_fp8(quant, origin)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, origin)
    raise ConfigError(
        f"{origin} declares quant_method {method!r}, which backplane "
        f"cannot load; supported: {SUPPORTED}. Use such a checkpoint, the unquantised one, "
        "or a GGUF file of the model"
    )


def _hf_fp8(quant: dict[str, Any], origin: str) -> Fp8Scheme:
    fmt = str(quant.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ConfigError(
            f"{origin}: quant_method 'fp8' with fmt {fmt!r} is not supported; backplane loads "
            "e4m3 FP8 weights"
        )
    activations = str(quant.get("activation_scheme", "dynamic")).lower()
    if activations not in ("dynamic", "static"):
        raise ConfigError(
            f"{origin}: activation_scheme {activations!r} is not supported; use dynamic or static"
        )
    ignore = tuple(quant.get("modules_to_not_convert") or quant.get("ignored_layers") or ())
    block = quant.get("weight_block_size")
    if block:
        return Fp8Scheme(
            weights="block",
            block=_block(block, origin),
            activations=activations,
            scale_name="weight_scale_inv",
            ignore=ignore,
        )
    return Fp8Scheme(weights="tensor", activations=activations, ignore=ignore)


def _compressed_tensors(quant: dict[str, Any], origin: str) -> Fp8Scheme:
    fmt = str(quant.get("format", "unknown"))
    if fmt != "float-quantized":
        raise ConfigError(
            f"{origin}: compressed-tensors format {fmt!r} is not supported; backplane loads "
            f"its 'float-quantized' (FP8) format. Supported: {SUPPORTED}"
        )
    groups = quant.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(
            f"{origin}: compressed-tensors with {len(groups)} config_groups is not supported; "
            "backplane loads checkpoints with one FP8 group"
        )
    group = next(iter(groups.values()))
    weights = group.get("weights") or {}
    if weights.get("type") != "float" or int(weights.get("num_bits", 0)) != 8:
        raise ConfigError(
            f"{origin}: compressed-tensors weights of type {weights.get('type')!r} with "
            f"{weights.get('num_bits')} bits are not supported; backplane loads 8-bit float weights"
        )
    strategy = str(weights.get("strategy", "tensor"))
    if strategy not in GRANULARITIES:
        raise ConfigError(
            f"{origin}: compressed-tensors weight strategy {strategy!r} is not supported; "
            f"use one of {', '.join(GRANULARITIES)}"
        )
    acts = group.get("input_activations") or {}
    activations = "dynamic" if not acts or acts.get("dynamic", True) else "static"
    block = _block(weights.get("block_structure") or (128, 128), origin)
    return Fp8Scheme(
        weights=strategy,
        block=block,
        activations=activations,
        scale_name="weight_scale",
        ignore=tuple(quant.get("ignore") or ()),
    )


def _block(value: Any, origin: str) -> tuple[int, int]:
    try:
        rows, cols = (int(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{origin}: weight block size {value!r} must be two positive integers, e.g. [128, 128]"
        ) from None
    if rows < 1 or cols < 1:
        raise ConfigError(f"{origin}: weight block size {value!r} must be positive")
    return rows, cols
