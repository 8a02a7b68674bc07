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

On a tensor-parallel rank the weights arrive as the rank's slices (see
:meth:`~backplane.models.base.CausalLM.checkpoint_shard`) and the scales whole
(they are small); :func:`shard_row_scales` cuts each scale to the slice its
weight holds, as vLLM does: per-channel scales follow a column-parallel
shard's rows and are whole on a row-parallel one, block scales are cut by
block rows (column-parallel; row form repeats a block's scale on each of its
rows, so a shard boundary inside a block stays exact) or by block columns
(row-parallel), per-tensor scales and static ``input_scale`` values are whole
on every rank. A row-parallel shard whose columns do not start and end on the
scale blocks' boundaries cannot keep its scales as blocks of the checkpoint's
width: that projection is kept in full precision, its weights dequantised
exactly as they load (one warning lists them).

:func:`quantize_model` instead quantises a loaded full-precision model's
projections (``quantization="fp8"``): one scale per output row, dynamic
per-token activations. Embeddings, norms, the LM head, routers and gates stay
as they are.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from backplane.models.base import CausalLM, WeightLoadError
from backplane.models.linear import Linear, MergedLinear
from backplane.models.mixers import AttentionMixer
from backplane.models.parallel import ParamShard, ShardSlice, module_shards
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

    On a tensor-parallel rank a projection stays in full precision (its FP8
    weights dequantised as they load) where its shard cannot keep the
    checkpoint's scales (:func:`tp_scale_obstacle`); every rank decides alike.
    """
    scaled: set[str] = set()
    for key in keys:
        for suffix in _SCALE_SUFFIXES:
            if key.endswith(suffix):
                module = _module_of(lm, key, suffix)
                if module is not None:
                    scaled.add(module)
                break
    converted = 0
    unsplittable: list[tuple[str, str]] = []  # (projection, why its shard cannot)
    for name, (linear, parts) in _projections(lm).items():
        if name.rpartition(".")[2] in _READ_AS_MATRIX:
            continue
        have = [p in scaled for p in parts]
        obstacle = tp_scale_obstacle(linear, scheme) if all(have) else None
        if obstacle is not None:
            unsplittable.append((name, obstacle))
        elif all(have):
            convert_linear(linear, scheme.block_k, static=scheme.activations == "static")
            converted += 1
        elif any(have):
            logger.warning(
                "%s: only some of its parts (%s) are FP8 in the checkpoint; it stays in full "
                "precision and their weights are dequantised on load",
                name,
                ", ".join(p for p, h in zip(parts, have, strict=True) if h),
            )
    if unsplittable and lm.tp.rank == 0:
        # one warning for the group (every rank decides alike), however many layers
        shown = ", ".join(f"{n} ({why})" for n, why in unsplittable[:4])
        more = f" and {len(unsplittable) - 4} more" if len(unsplittable) > 4 else ""
        logger.warning(
            "FP8 checkpoint on %d tensor-parallel ranks: %s%s stay in full precision, their "
            "FP8 weights dequantised on load (exact, in the model dtype's memory); a "
            "tensor_parallel_size whose shards fall on the %dx%d scale blocks keeps them in FP8",
            lm.tp.size,
            shown,
            more,
            *scheme.block,
        )
    if not converted and not unsplittable:
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


def tp_scale_obstacle(linear: Linear, scheme: Fp8Scheme) -> str | None:
    """Why this rank's shard of ``linear`` cannot keep the checkpoint's weight scales, if it cannot.

    A column-parallel shard (output rows, any parts) always can: row-form
    scales (see :mod:`backplane.models.quant.fp8`) are per row, so a shard
    boundary inside a block of rows just repeats that block's scale. Per-tensor
    and per-channel scales are whole on a row-parallel shard. Block scales on a
    row-parallel shard (input columns) stay blocks of the checkpoint's width
    only where the shard's first and last columns fall on block boundaries;
    checking both ends of this rank's slice checks the boundaries it shares
    with its neighbours, so every rank of the group gets the same answer.

    :param linear: a projection, before :func:`convert_for_checkpoint` converts it.
    :param scheme: the checkpoint's scheme.
    :return: ``None`` where the shard can stay FP8 (and with one rank), else
        the reason, for the warning.
    """
    layout = module_shards(linear).get("weight")
    if layout is None or not layout.sharded or layout.dim == 0 or scheme.weights != "block":
        return None
    bk = scheme.block[1]
    if len(layout.parts) != 1:
        return f"its input columns are {len(layout.parts)} slices of {bk}-column scale blocks"
    part = layout.parts[0]
    if part.start % bk or (part.stop != part.total and part.stop % bk):
        return (
            f"its input columns [{part.start}, {part.stop}) of {part.total} cut "
            f"{bk}-column scale blocks"
        )
    return None


def shard_row_scales(
    scale: torch.Tensor,
    full_shape: tuple[int, int],
    shard: ShardSlice | ParamShard | None,
    scheme: Fp8Scheme,
) -> tuple[torch.Tensor, int]:
    """The row-form scales of a rank's shard of a checkpoint weight.

    The rank's weight is ``shard`` cut from the full ``[rows, cols]`` weight;
    the result scales it so that dequantising the shard gives exactly the same
    cut of the full weight dequantised (every element times the scale the
    checkpoint gives it).

    * Rows (``shard.dim == 0``: column-parallel, the vocabulary of the LM
      head, one part or several): the full row form's rows, cut as the
      weight's. Per-tensor scales come out repeated, per-channel scales
      sliced, block scales one row per weight row (rows of a block repeat its
      scales, so a boundary inside a block is exact).
    * Columns (``shard.dim == 1``, one part: row-parallel): per-tensor and
      per-channel scales whole. Block scales are cut by block columns; where
      the shard does not start on a block boundary, by finer column blocks of
      ``gcd(block columns, first column)`` columns (each within one checkpoint
      block, so still exact; :func:`tp_scale_obstacle` keeps such
      projections out of FP8, and their weights are dequantised with these).

    :param scale: the checkpoint's scale of the full weight (checkpoint form:
        one value, ``[rows, 1]`` or ``[ceil(rows / bn), ceil(cols / bk)]``).
    :param full_shape: ``(rows, cols)`` of the full weight.
    :param shard: the rank's cut of the full weight, ``None`` for all of it.
    :param scheme: the checkpoint's scheme (granularity and block).
    :return: ``(scales, block_k)``: float32 ``[shard rows, ceil(shard cols /
        block_k)]`` scales and the shard's input columns per scale, as
        :func:`~backplane.models.quant.fp8.dequantize_rows` takes them.
    :raises ValueError: the scale does not fit the weight, or block scales cut
        by several column slices.
    """
    rows, cols = full_shape
    full = row_scales(scale, rows, cols, scheme.weights, scheme.block)
    bk = scheme.block[1] if scheme.weights == "block" else cols
    if shard is None:
        return full, bk
    if shard.dim in (0, -2):
        return shard.take(full).contiguous(), bk
    parts = (shard.part,) if isinstance(shard, ShardSlice) else shard.parts
    if scheme.weights != "block":
        # one scale per row whatever the columns: whole on every column slice
        return full, sum(p.size for p in parts)
    if len(parts) != 1:
        raise ValueError(
            f"block scales of a weight cut into {len(shard.parts)} column slices are not "
            "supported; load it whole"
        )
    part = parts[0]
    # Checkpoint blocks [first, last) cover the slice; chunks of k columns from the slice's
    # first column each lie within one block, as k divides the block width and that column.
    k = math.gcd(bk, part.start)
    first, last = part.start // bk, -(-part.stop // bk)
    blocks = full[:, first:last]
    if k != bk:
        blocks = blocks.repeat_interleave(bk // k, dim=1)
    offset = (part.start - first * bk) // k
    return blocks[:, offset : offset + -(-part.size // k)].contiguous(), k


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
    # what a tensor-parallel rank holds of each target (empty with one rank)
    shards = lm.weight_shards()
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
            if mapped in targets:
                yield (
                    scale_name,
                    _projection_scales(targets, shards, owners, mapped, tensor, scheme),
                )
                continue
            weight_name = f"{base}.weight"
            weight = weights.pop(weight_name, None)
            if weight is None:
                scales[weight_name] = tensor
            else:
                shard = _arrived_shard(lm, shards, weight_name, weight)
                yield weight_name, _dequantize(weight, tensor, scheme, shard)
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
                yield (
                    name,
                    _dequantize(tensor, scale, scheme, _arrived_shard(lm, shards, name, tensor)),
                )
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


def _projection_scales(
    targets: dict[str, tuple[torch.Tensor, int | None]],
    shards: dict[str, ShardSlice | ParamShard],
    owners: dict[str, Linear],
    mapped: str,
    scale: torch.Tensor,
    scheme: Fp8Scheme,
) -> torch.Tensor:
    """The row-form ``weight_scale`` an FP8 projection (or merged part) ``mapped`` loads: the
    checkpoint's scale of the whole weight cut to this rank's shard of it."""
    weight_name = mapped[: -len("_scale")]
    local = tuple(targets[weight_name][0].shape)
    shard = shards.get(weight_name)
    full = local if shard is None else shard.full_shape(local)
    try:
        per_row, block_k = shard_row_scales(scale, full, shard, scheme)
    except ValueError as exc:
        raise WeightLoadError(f"{mapped}: {exc}", tensor=mapped) from None
    owner = owners[weight_name[: -len(".weight")]]
    if scheme.weights == "block" and block_k != owner.quant.block_k:
        # convert_for_checkpoint keeps such shards in full precision (tp_scale_obstacle)
        raise WeightLoadError(
            f"{mapped}: this rank's shard needs scales of {block_k} columns, the projection "
            f"was prepared for {owner.quant.block_k} (a bug in backplane's FP8 loading; load "
            "with tensor_parallel_size=1 meanwhile)",
            tensor=mapped,
        )
    return per_row


def _arrived_shard(
    lm: CausalLM, shards: dict[str, ShardSlice | ParamShard], ckpt_name: str, weight: torch.Tensor
) -> ShardSlice | None:
    """The slice of the full checkpoint tensor that ``weight`` (as read) is, ``None`` if whole.

    The loader reads a tensor sliced only for a :class:`ShardSlice` and only when the file's
    tensor has the full size (see :func:`~backplane.models.loader.iter_safetensors`); a
    :class:`ParamShard` of several slices is read whole and cut by ``load_weights``.
    """
    mapped = lm.checkpoint_to_module_name(ckpt_name)
    shard = shards.get(mapped) if mapped is not None else None
    if (
        isinstance(shard, ShardSlice)
        and weight.dim() == 2
        and weight.shape[shard.dim] == shard.part.size
    ):
        return shard
    return None


def _dequantize(
    weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme, shard: ShardSlice | None = None
) -> torch.Tensor:
    """A checkpoint's FP8 weight times its checkpoint-form scale, in float32.

    :param weight: the weight as read: whole, or the rank's ``shard`` of it.
    :param scale: the checkpoint's scale of the whole weight.
    :param scheme: the checkpoint's scheme.
    :param shard: which slice of the whole weight ``weight`` is (``None``: all of it).
    """
    # On a CUDA tensor-parallel rank the loader reads whole tensors (the scales) onto the
    # device and slices in host memory: dequantise where the scale is.
    weight = weight.to(scale.device)
    if weight.dim() != 2:
        return weight.float() * scale.float()
    full = tuple(weight.shape) if shard is None else shard.full_shape(weight.shape)
    per_row, block_k = shard_row_scales(scale, full, shard, scheme)
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
