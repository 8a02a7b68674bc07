"""Reference multi-head latent attention (DeepSeek MLA) in plain torch.

The cache holds, per token, the normalised latent ``kv_c`` (``kv_lora_rank``
values) followed by the rotary key ``k_pe`` shared by all heads:
``[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]``. For head ``h``
the key is ``[w_uk[h] @ kv_c, k_pe]`` and the value ``w_uv[h] @ kv_c``.

One cached op, ``backplane_torch::mla``, appends this step's latents at
``slot_mapping`` and attends causally:

* prefill/extend sequences (many queries per sequence) use the *expanded*
  form: the sequence's cached latents are expanded once into per-head keys
  and values, then ordinary attention runs over them in bounded query chunks;
* decode sequences (one query each) use the *weight-absorbed* form, vectorised
  over the decode batch: ``q_nope[h] @ w_uk[h]`` moves the query into latent
  space, scores are taken directly against the cached latents and rotary keys,
  the probability-weighted latent is summed and only then mapped to the value
  space with ``w_uv[h]`` — the cache is never expanded.

A ``float8_e4m3fn`` cache holds ``row / kv_scale`` (the layer's scale), rounded
to nearest and saturated at +-448; its rows are read back times ``kv_scale``.

All arithmetic is float32; host counts come from ``batch.host`` and index
tensors from the batch's device tensors, so the op never synchronises.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from backplane.backends.torch._common import (
    decode_table,
    gather_pages,
    query_chunk,
    slots_known_valid,
    write_slots,
)
from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.families import MLABackend, MLALayerSpec
from backplane.core.forward_context import get_forward_context
from backplane.core.metadata import BatchMetadata


def _to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Rows ``x`` as a cache of ``cache_dtype`` stores them (``x / scale``, saturated, for FP8)."""
    if cache_dtype != torch.float8_e4m3fn:
        return x
    limit = torch.finfo(cache_dtype).max
    # e4m3fn has no infinity: a value past the largest one would become NaN
    return (x.float() / scale).clamp_(-limit, limit).to(cache_dtype)


def _from_cache(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache rows in float32 (times ``scale`` for an FP8 cache)."""
    if rows.dtype != torch.float8_e4m3fn:
        return rows.float()
    return rows.float().mul_(scale)


def _prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    buf: torch.Tensor,
    batch: BatchMetadata,
    scale: float,
    kv_scale: float = 1.0,
) -> None:
    """Expanded attention for the prefill/extend sequences, one sequence at a time."""
    host = batch.host
    num_heads = q_nope.shape[1]
    rank = w_uk.shape[2]
    for i in range(batch.num_prefill_seqs):
        start, end = int(host.query_start_loc[i]), int(host.query_start_loc[i + 1])
        cached, total = int(host.cached_lens[i]), int(host.seq_lens[i])
        pages = batch.page_indices[int(host.page_indptr[i]) : int(host.page_indptr[i + 1])]
        rows = _from_cache(gather_pages(latent_cache, pages, total), kv_scale)
        latent, k_pe = rows[:, :rank], rows[:, rank:]
        k_nope = torch.einsum("sl,hnl->hsn", latent, w_uk)  # [H, S, nope]
        values = torch.einsum("sl,hvl->hsv", latent, w_uv)  # [H, S, v]
        k_pos = torch.arange(total, device=q_nope.device)
        chunk = query_chunk(num_heads, total)
        for c0 in range(start, end, chunk):
            c1 = min(end, c0 + chunk)
            qn = q_nope[c0:c1].float()
            qp = q_pe[c0:c1].float()
            scores = torch.einsum("lhn,hsn->hls", qn, k_nope)
            scores += torch.einsum("lhr,sr->hls", qp, k_pe)
            scores.mul_(scale)
            q_pos = torch.arange(cached + c0 - start, cached + c1 - start, device=q_nope.device)
            scores.masked_fill_(k_pos[None, :] > q_pos[:, None], -math.inf)
            probs = torch.softmax(scores, dim=-1)
            buf[c0:c1].copy_(torch.einsum("hls,hsv->lhv", probs, values))


def _decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    buf: torch.Tensor,
    batch: BatchMetadata,
    scale: float,
    kv_scale: float = 1.0,
) -> None:
    """Weight-absorbed attention for all decode sequences at once."""
    first, nd = batch.num_prefill_seqs, batch.num_decode_seqs
    t0, t1 = batch.num_prefill_tokens, batch.num_tokens
    page_size = latent_cache.shape[1]
    rank = w_uk.shape[2]
    table = decode_table(batch)
    num_pages = table.shape[1]
    rows = latent_cache.index_select(0, table.reshape(-1))
    rows = _from_cache(rows.view(nd, num_pages * page_size, -1), kv_scale)
    latent, k_pe = rows[..., :rank], rows[..., rank:]
    q_latent = torch.einsum("nhd,hdl->nhl", q_nope[t0:t1].float(), w_uk)
    scores = torch.einsum("nhl,nsl->nhs", q_latent, latent)
    scores += torch.einsum("nhr,nsr->nhs", q_pe[t0:t1].float(), k_pe)
    scores.mul_(scale)
    seq_lens = batch.seq_lens[first : first + nd].to(device=q_nope.device, dtype=torch.long)
    k_pos = torch.arange(num_pages * page_size, device=q_nope.device)
    scores.masked_fill_((k_pos[None, :] >= seq_lens[:, None])[:, None, :], -math.inf)
    probs = torch.softmax(scores, dim=-1)
    out_latent = torch.einsum("nhs,nsl->nhl", probs, latent)
    buf[t0:t1].copy_(torch.einsum("nhl,hvl->nhv", out_latent, w_uv))


@cached_op(
    "backplane_torch::mla",
    mutates_args=("latent_cache", "out"),
    output_shape=MLABackend.output_shape,
)
def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    kv_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Append latents to the cache and attend; the batch comes from the forward context.

    :param q_nope: ``[T, H, qk_nope_head_dim]``.
    :param q_pe: ``[T, H, qk_rope_head_dim]``, RoPE applied.
    :param kv_c: ``[T, kv_lora_rank]``.
    :param k_pe: ``[T, qk_rope_head_dim]``, RoPE applied.
    :param latent_cache: ``[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]``.
    :param w_uk: ``[H, qk_nope_head_dim, kv_lora_rank]``.
    :param w_uv: ``[H, v_head_dim, kv_lora_rank]``.
    :param scale: softmax scale.
    :param kv_scale: a ``float8_e4m3fn`` cache holds ``row / kv_scale`` (other
        dtypes ignore it).
    :param out: optional ``[T, H, v_head_dim]`` buffer.
    :return: the output, or an empty sentinel when ``out`` is given.
    """
    batch = get_forward_context().batch
    n = batch.num_tokens
    (shape, dtype) = MLABackend.output_shape(q_nope, q_pe, kv_c, k_pe, latent_cache, w_uk, w_uv)
    buf = output_buffer(out, shape, dtype, q_nope.device)
    rank = kv_c.shape[1]
    page_size = latent_cache.shape[1]
    slots = batch.slot_mapping[:n]
    write_slots(
        (latent_cache[..., :rank], latent_cache[..., rank:]),
        (
            _to_cache(kv_c[:n], latent_cache.dtype, kv_scale),
            _to_cache(k_pe[:n], latent_cache.dtype, kv_scale),
        ),
        slots,
        page_size,
        all_valid=slots_known_valid(batch),
    )
    wk, wv = w_uk.float(), w_uv.float()
    if batch.num_prefill_seqs:
        _prefill(q_nope, q_pe, latent_cache, wk, wv, buf, batch, scale, kv_scale)
    if batch.num_decode_seqs:
        _decode(q_nope, q_pe, latent_cache, wk, wv, buf, batch, scale, kv_scale)
    return finish_output(out, buf, n)


class TorchMLABackend(MLABackend):
    """Reference MLA backend: absorbed decode, expanded prefill, plain torch ops."""

    name = "torch"
    supports_fp8_kv_cache = True

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        layer: MLALayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append the latent and rotary key and attend (see :class:`MLABackend`).

        :param q_nope: ``[T, H, qk_nope_head_dim]``.
        :param q_pe: ``[T, H, qk_rope_head_dim]``.
        :param kv_c: ``[T, kv_lora_rank]``.
        :param k_pe: ``[T, qk_rope_head_dim]``.
        :param latent_cache: the layer's latent cache.
        :param w_uk: ``[H, qk_nope_head_dim, kv_lora_rank]``.
        :param w_uv: ``[H, v_head_dim, kv_lora_rank]``.
        :param layer: the layer's constants.
        :param out: optional ``[T, H, v_head_dim]`` buffer.
        :return: the output, or an empty sentinel when ``out`` is given.
        """
        expected = {
            "w_uk": (layer.num_heads, layer.qk_nope_head_dim, layer.kv_lora_rank),
            "w_uv": (layer.num_heads, layer.v_head_dim, layer.kv_lora_rank),
        }
        for name, tensor in (("w_uk", w_uk), ("w_uv", w_uv)):
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(
                    f"MLA layer {layer.layer_id}: {name} has shape {tuple(tensor.shape)}, "
                    f"expected {expected[name]} [heads, head dim, kv_lora_rank]"
                )
        return mla_attention(
            q_nope,
            q_pe,
            kv_c,
            k_pe,
            latent_cache,
            w_uk,
            w_uv,
            layer.scale,
            float(layer.kv_scale),
            out=out,
        )

    def dynamic_ops(self) -> tuple[Any, ...]:
        """The one custom op this backend's forward calls."""
        return (torch.ops.backplane_torch.mla.default,)
