"""The memory floor of one tensor-parallel rank: the sizes one rank of ``N`` holds and reads.

Every rank reads its own memory at the same time, so a step over ``N`` ranks
can be no faster than the slowest rank's bytes at one device's bandwidth. A
rank holds its shard of each split layer and the whole of each replicated part
(norms, routers, key/value heads when there are fewer than ranks, an MLA latent
projection); the model built on the ``meta`` device for rank 0 of ``N`` says
exactly which is which, so nothing here repeats the sharding rules.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from backplane.cli.bench.latency.settings import FAMILIES
from backplane.cli.bench.latency.weights import WeightsInfo, cache_sizes

__all__ = ["rank_weights_info"]


def _meta_model(config: Any, dtype: Any, size: int) -> Any:
    """The model of ``config`` (a ``ModelConfig``) built on ``meta`` as rank 0 of ``size`` would."""
    from backplane.core.parallel import TensorParallel, set_tensor_parallel
    from backplane.engine.selection import select_backends_for
    from backplane.models.base import build_model
    from backplane.models.registry import model_class

    cls = model_class(config.get("architectures"))
    config = cls.normalize_config(config)
    backends = select_backends_for(dict.fromkeys(FAMILIES, "torch"), device="cpu")
    # group None: building a layer only reads the rank and size, it runs no collective
    previous = set_tensor_parallel(TensorParallel(rank=0, size=size, group=None))
    try:
        return build_model(cls, config, backends, dtype=dtype, device="meta")
    finally:
        set_tensor_parallel(previous)


def _bytes(model: Any) -> int:
    """Bytes of ``model``'s parameters, each tensor once (a tied matrix is one parameter)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def rank_weights_info(
    info: WeightsInfo, dtype: Any, tensor_parallel_size: int, quantization: str | None = None
) -> WeightsInfo:
    """The sizes one rank of a ``tensor_parallel_size``-way split model holds, for its floor.

    Each size of ``info`` (the whole model) is scaled by what one rank's model
    holds of it: all weights by the ratio of rank 0's parameter bytes to the
    whole model's, the embedding and LM head by their shard's share,
    routed experts evenly (tensor parallel inside the experts or expert
    parallel, each rank holds ``1 / N`` of them); the KV bytes per token and
    the recurrent state per sequence are rank 0's own cache specs (key/value
    heads replicated when the ranks outnumber them, SSM and delta-rule heads
    split).

    With ``quantization="fp8"`` both models are quantised as the engine
    quantises on load (each rank its own shard: an e4m3 byte per weight and a
    float32 scale per shard row) before their bytes are compared, and ``info``
    is to hold the whole quantised model's sizes
    (:func:`~.quantized.held_weights_info`).

    :param info: the whole model's sizes (:func:`~.weights.save_random_weights`
        or :func:`~.weights.folder_weights_info`); its ``folder`` holds the config.
    :param dtype: the ``torch.dtype`` the engine holds the weights and caches in.
    :param tensor_parallel_size: the number of ranks (1: ``info`` itself).
    :param quantization: ``"fp8"`` or ``None``, as the engine's ``quantization``.
    :return: one rank's sizes (``params`` and ``folder`` stay the whole model's).
    :raises UnevenSplitError: the model cannot be split over that many ranks.
    """
    from backplane.models.loader import read_config

    size = int(tensor_parallel_size)
    if size <= 1:
        return info
    # a config read for each build: normalising may change it in place
    whole = _meta_model(read_config(info.folder), dtype, 1)
    rank = _meta_model(read_config(info.folder), dtype, size)
    if quantization == "fp8":
        from backplane.models.quant.loading import quantize_model

        quantize_model(whole)
        quantize_model(rank)
    share = _bytes(rank) / max(_bytes(whole), 1)
    embedding_share = rank.embed_tokens.weight.numel() / max(whole.embed_tokens.weight.numel(), 1)
    head_share = embedding_share
    if not info.tied:
        head_share = rank.lm_head.weight.numel() / max(whole.lm_head.weight.numel(), 1)
    kv_bytes_per_token, state_bytes_per_seq = cache_sizes(rank, dtype)
    return dataclasses.replace(
        info,
        weight_bytes=round(info.weight_bytes * share),
        embedding_bytes=round(info.embedding_bytes * embedding_share),
        lm_head_bytes=round(info.lm_head_bytes * head_share),
        expert_bytes=info.expert_bytes // size,
        kv_bytes_per_token=kv_bytes_per_token,
        state_bytes_per_seq=state_bytes_per_seq,
    )
