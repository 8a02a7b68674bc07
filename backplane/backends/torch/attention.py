"""Reference paged attention in plain torch (any device, float32/float64/bfloat16/float16).

One cached op, ``backplane_torch::attention``, does a whole layer's step:

1. appends this step's keys and values to the paged KV cache at
   ``slot_mapping`` (``-1`` rows are skipped), vectorised over all tokens;
2. attends, causally and optionally within a sliding window, over each
   sequence's cached prefix plus its new tokens, with grouped-query heads
   (query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``),
   through ``torch.nn.functional.scaled_dot_product_attention`` (on CPU its
   fused kernel works block by block and skips the blocks a causal mask hides):

   * prefill/extend sequences: one call per sequence; a fresh prompt attends to
     its own keys and values as given (no gather from the cache) with
     ``is_causal``, a sequence with cached context gathers its pages once and
     passes an explicit position mask;
   * decode sequences: one call for the whole decode batch, the pages of every
     sequence gathered with one index op through the dense ``block_table``,
     each sequence's query heads of one KV head folded into that head's query
     rows (so grouped heads need no expansion), masked by each sequence's
     length.

Half-precision inputs attend in float32; float32 and float64 attend in their own
dtype. A ``float8_e4m3fn`` cache holds ``key / k_scale`` and ``value / v_scale``
(the layer's scales), saturated at +-448; the keys and values are read back
times their scale in the attention dtype, and a fresh prompt then attends to
the rounded keys and values from the cache, as later steps do. Host counts come from ``batch.host``; every index tensor is a device
tensor of the batch, so the op never synchronises with the device.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from backplane.backends.torch._common import (
    SlotIndex,
    decode_table,
    gather_kv_pages,
    kv_page_rows,
    query_chunk,
    slots_known_valid,
)
from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.families import AttentionBackend, AttentionLayerSpec
from backplane.core.forward_context import get_forward_context
from backplane.core.metadata import BatchMetadata

#: Devices whose SDPA kernels stream over key blocks and never hold a whole score
#: matrix (the CPU kernel); elsewhere SDPA may fall back to a kernel that does, so
#: prefill queries are scored in chunks of at most ``MAX_SCORE_ELEMENTS`` scores.
_STREAMING_DEVICES = frozenset({"cpu"})


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """Causal (and windowed) mask: ``[..., queries, keys]`` from broadcastable positions."""
    allowed = k_pos <= q_pos
    if sliding_window > 0:
        allowed = allowed & (k_pos > q_pos - sliding_window)
    return allowed


#: cache dtypes stored scaled (see the module docstring)
_FP8_DTYPES = (torch.float8_e4m3fn,)


def _to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as a cache of ``cache_dtype`` stores it (scaled and saturated for FP8)."""
    if cache_dtype not in _FP8_DTYPES:
        return x
    limit = torch.finfo(cache_dtype).max
    # e4m3fn has no infinity: a value past the largest one would become NaN
    return (x.float() / scale).clamp_(-limit, limit).to(cache_dtype)


def _from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache rows ``x`` in the attention dtype (times ``scale`` for an FP8 cache)."""
    if x.dtype in _FP8_DTYPES:
        y = x.to(dtype)
        return y if scale == 1.0 else y.mul_(scale)
    return x if x.dtype == dtype else x.to(dtype)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention runs in: float32 for half types, else the input's own."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    buf: torch.Tensor,
    batch: BatchMetadata,
    scale: float,
    sliding_window: int,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Attention for the prefill/extend sequences, one SDPA call per sequence (or query chunk)."""
    host = batch.host
    num_heads = q.shape[1]
    dtype = _compute_dtype(q.dtype)
    chunked = q.device.type not in _STREAMING_DEVICES
    for i in range(batch.num_prefill_seqs):
        start, end = int(host.query_start_loc[i]), int(host.query_start_loc[i + 1])
        cached, total = int(host.cached_lens[i]), int(host.seq_lens[i])
        # Keys older than the window of the first query can never be attended to.
        lo = max(0, cached + 1 - sliding_window) if sliding_window > 0 else 0
        if cached == 0 and k.dtype == kv_cache.dtype:
            # A fresh prompt's keys are exactly this step's (just written to the cache).
            keys, values = k[start:end], v[start:end]
        else:
            pages = batch.page_indices[int(host.page_indptr[i]) : int(host.page_indptr[i + 1])]
            keys, values = gather_kv_pages(kv_cache, pages)
            keys, values = keys[lo:total], values[lo:total]
        # [1, heads, tokens, head_dim] views; SDPA takes them strided
        keys = _from_cache(keys, dtype, kv_scales[0]).transpose(0, 1).unsqueeze(0)
        values = _from_cache(values, dtype, kv_scales[1]).transpose(0, 1).unsqueeze(0)
        chunk = query_chunk(num_heads, total - lo) if chunked else end - start
        for c0 in range(start, end, chunk):
            c1 = min(end, c0 + chunk)
            p0, p1 = cached + c0 - start, cached + c1 - start  # query positions [p0, p1)
            qc = q[c0:c1].to(dtype).transpose(0, 1).unsqueeze(0)
            # keys past the chunk's last query are never attended to
            kc, vc = keys[:, :, : p1 - lo], values[:, :, : p1 - lo]
            if p0 == 0 and sliding_window == 0:
                o = F.scaled_dot_product_attention(
                    qc, kc, vc, is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                q_pos = torch.arange(p0, p1, device=q.device)
                k_pos = torch.arange(lo, p1, device=q.device)
                mask = _allowed(q_pos[:, None], k_pos[None, :], sliding_window)
                o = F.scaled_dot_product_attention(
                    qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True
                )
            buf[c0:c1].copy_(o[0].transpose(0, 1))


class StepPlan:
    """What every layer's op derives from the step's batch alone, computed once per step.

    The backend's :meth:`TorchAttentionBackend.plan` builds it before the layers
    run (op by op, so the host values hold for the step); a captured decode graph
    gets none and each op builds its own inside the graph, from the persistent
    device tensors. Masks for sliding windows are built on first use and kept.

    :param batch: the step's metadata.
    :param page_size: tokens per page of the caches.
    """

    def __init__(self, batch: BatchMetadata, page_size: int) -> None:
        self.batch = batch
        self.page_size = page_size
        n = batch.num_tokens
        self.slots = SlotIndex.of(
            batch.slot_mapping[:n], page_size, all_valid=slots_known_valid(batch)
        )
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        if batch.num_decode_seqs:
            first, nd = batch.num_prefill_seqs, batch.num_decode_seqs
            table = decode_table(batch)
            self.decode_pages = table.reshape(-1)
            self.decode_rows = kv_page_rows(self.decode_pages)
            self.num_keys = table.shape[1] * page_size
            self.seq_lens = batch.seq_lens[first : first + nd].to(torch.long)

    def decode_mask(self, sliding_window: int, dtype: torch.dtype) -> torch.Tensor:
        """``[nd, 1, 1, keys]`` additive mask (0 or -inf) of the gathered keys of each decode query.

        Additive in the attention dtype rather than boolean: SDPA's CPU kernel
        would convert a boolean mask on every call.
        """
        mask = self._masks.get((sliding_window, dtype))
        if mask is None:
            k_pos = torch.arange(self.num_keys, device=self.seq_lens.device)
            # The decode query sits at position seq_len - 1; keys past it are other data.
            allowed = _allowed((self.seq_lens - 1)[:, None], k_pos[None, :], sliding_window)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            mask.masked_fill_(~allowed, -math.inf)
            mask = self._masks[(sliding_window, dtype)] = mask[:, None, None, :]
        return mask


def _decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    buf: torch.Tensor,
    plan: StepPlan,
    scale: float,
    sliding_window: int,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Attention for all decode sequences at once, through the dense block table."""
    batch = plan.batch
    nd = batch.num_decode_seqs
    t0, t1 = batch.num_prefill_tokens, batch.num_tokens
    _, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    dtype = _compute_dtype(q.dtype)
    # One gather of whole pages for the whole batch, seen as [nd, kv_heads, keys, head_dim].
    shape = (nd, plan.num_keys, num_kv_heads, head_dim)
    keys, values = gather_kv_pages(kv_cache, plan.decode_pages, plan.decode_rows)
    keys, values = keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)
    keys, values = _from_cache(keys, dtype, kv_scales[0]), _from_cache(values, dtype, kv_scales[1])
    # One query per sequence: the group's heads become the KV head's query rows.
    qd = q[t0:t1]
    if qd.dtype != dtype:
        qd = qd.to(dtype)
    qd = qd.reshape(nd, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(
        qd,
        keys,
        values,
        attn_mask=plan.decode_mask(sliding_window, dtype),
        scale=scale,
    )
    buf[t0:t1].copy_(o.reshape(nd, num_heads, head_dim))


@cached_op(
    "backplane_torch::attention",
    mutates_args=("kv_cache", "out"),
    output_shape=AttentionBackend.output_shape,
)
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    scale: float,
    sliding_window: int,
    k_scale: float,
    v_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Append ``k``/``v`` to the paged cache and attend; the batch comes from the forward context.

    :param q: ``[T, num_heads, head_dim]``.
    :param k: ``[T, num_kv_heads, head_dim]``.
    :param v: ``[T, num_kv_heads, head_dim]``.
    :param kv_cache: ``[num_pages, 2, page_size, num_kv_heads, head_dim]``, written
        at ``slot_mapping``.
    :param scale: softmax scale.
    :param sliding_window: attend to at most this many most recent keys; ``0`` = all.
    :param k_scale: an FP8 cache holds ``k / k_scale`` (ignored for other dtypes).
    :param v_scale: an FP8 cache holds ``v / v_scale``.
    :param out: optional ``[T, num_heads, head_dim]`` buffer.
    :return: the output, or an empty sentinel when ``out`` is given.
    """
    ctx = get_forward_context()
    batch = ctx.batch
    n = batch.num_tokens
    buf = output_buffer(out, q.shape, q.dtype, q.device)
    k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]
    page_size = kv_cache.shape[2]
    plan = ctx.plan("attention")
    if not (isinstance(plan, StepPlan) and plan.batch is batch and plan.page_size == page_size):
        plan = StepPlan(batch, page_size)
    rows = (
        _to_cache(k[:n], kv_cache.dtype, k_scale),
        _to_cache(v[:n], kv_cache.dtype, v_scale),
    )
    plan.slots.write((k_cache, v_cache), rows)
    kv_scales = (k_scale, v_scale)
    if batch.num_prefill_seqs:
        _prefill(q, k, v, kv_cache, buf, batch, scale, sliding_window, kv_scales)
    if batch.num_decode_seqs:
        _decode(q, kv_cache, buf, plan, scale, sliding_window, kv_scales)
    return finish_output(out, buf, n)


class TorchAttentionBackend(AttentionBackend):
    """Reference attention backend: plain torch ops, any device.

    Its plan is the step's :class:`StepPlan` (slot indices, decode pages and
    masks shared by every layer), except for a captured decode graph.
    """

    name = "torch"
    supports_fp8_kv_cache = True

    def plan(self, batch: BatchMetadata) -> StepPlan | None:
        """Derive the step's slot indices, decode pages and masks once for all layers.

        :param batch: the step's metadata.
        :return: the plan, or ``None`` for a decode graph (its ops build theirs
            inside the graph).
        """
        if batch.mode.is_decode_graph:
            return None
        return StepPlan(batch, batch.page_size)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: AttentionLayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append this step's keys/values to the cache and attend (see :class:`AttentionBackend`).

        :param q: ``[T, num_heads, head_dim]``, RoPE applied.
        :param k: ``[T, num_kv_heads, head_dim]``, RoPE applied.
        :param v: ``[T, num_kv_heads, head_dim]``.
        :param kv_cache: the layer's paged KV cache.
        :param layer: the layer's constants.
        :param out: optional ``[T, num_heads, head_dim]`` buffer.
        :return: the output, or an empty sentinel when ``out`` is given.
        """
        if layer.num_heads % layer.num_kv_heads:
            raise ValueError(
                f"attention layer {layer.layer_id}: num_heads={layer.num_heads} is not a "
                f"multiple of num_kv_heads={layer.num_kv_heads}"
            )
        if q.shape[1:] != (layer.num_heads, layer.head_dim) or k.shape[1:] != (
            layer.num_kv_heads,
            layer.head_dim,
        ):
            raise ValueError(
                f"attention layer {layer.layer_id}: q {tuple(q.shape)} / k {tuple(k.shape)} do "
                f"not match num_heads={layer.num_heads}, num_kv_heads={layer.num_kv_heads}, "
                f"head_dim={layer.head_dim}"
            )
        return paged_attention(
            q,
            k,
            v,
            kv_cache,
            layer.softmax_scale,
            layer.sliding_window,
            float(layer.k_scale),
            float(layer.v_scale),
            out=out,
        )

    def dynamic_ops(self) -> tuple[Any, ...]:
        """The one custom op this backend's forward calls."""
        return (torch.ops.backplane_torch.attention.default,)
