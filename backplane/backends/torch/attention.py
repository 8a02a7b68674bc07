"""Reference paged attention in plain torch (any device, float32/bfloat16/float16).

One cached op, ``backplane_torch::attention``, does a whole layer's step:

1. appends this step's keys and values to the paged KV cache at
   ``slot_mapping`` (``-1`` rows are skipped), vectorised over all tokens;
2. attends, causally and optionally within a sliding window, over each
   sequence's cached prefix plus its new tokens, with grouped-query heads
   (query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``):

   * prefill/extend sequences: a loop over sequences, each gathering its pages
     and scoring its queries in bounded chunks;
   * decode sequences: one vectorised pass over the whole decode batch through
     the dense ``block_table``, masked by each sequence's length.

Scores, softmax and the weighted sum run in float32 whatever the activation
dtype. Host counts come from ``batch.host``; every index tensor is a device
tensor of the batch, so the op never synchronises with the device.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from backplane.backends.torch._common import gather_pages, query_chunk, write_slots
from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.families import AttentionBackend, AttentionLayerSpec
from backplane.core.forward_context import get_forward_context
from backplane.core.metadata import BatchMetadata


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """Causal (and windowed) mask: ``[..., queries, keys]`` from broadcastable positions."""
    allowed = k_pos <= q_pos
    if sliding_window > 0:
        allowed = allowed & (k_pos > q_pos - sliding_window)
    return allowed


def _prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    buf: torch.Tensor,
    batch: BatchMetadata,
    scale: float,
    sliding_window: int,
) -> None:
    """Attention for the prefill/extend sequences, one sequence at a time."""
    host = batch.host
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    for i in range(batch.num_prefill_seqs):
        start, end = int(host.query_start_loc[i]), int(host.query_start_loc[i + 1])
        cached, total = int(host.cached_lens[i]), int(host.seq_lens[i])
        # Keys older than the window of the first query can never be attended to.
        lo = max(0, cached + 1 - sliding_window) if sliding_window > 0 else 0
        pages = batch.page_indices[int(host.page_indptr[i]) : int(host.page_indptr[i + 1])]
        keys = gather_pages(k_cache, pages, total)[lo:].float()
        values = gather_pages(v_cache, pages, total)[lo:].float()
        k_pos = torch.arange(lo, total, device=q.device)
        chunk = query_chunk(num_heads, total - lo)
        for c0 in range(start, end, chunk):
            c1 = min(end, c0 + chunk)
            rows = c1 - c0
            qc = q[c0:c1].float().reshape(rows, num_kv_heads, group, head_dim)
            q_pos = torch.arange(cached + c0 - start, cached + c1 - start, device=q.device)
            scores = torch.einsum("lkgd,skd->kgls", qc, keys).mul_(scale)
            mask = _allowed(q_pos[:, None], k_pos[None, :], sliding_window)
            scores.masked_fill_(~mask, -math.inf)
            probs = torch.softmax(scores, dim=-1)
            o = torch.einsum("kgls,skd->lkgd", probs, values)
            buf[c0:c1].copy_(o.reshape(rows, num_heads, head_dim))


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    buf: torch.Tensor,
    batch: BatchMetadata,
    scale: float,
    sliding_window: int,
) -> None:
    """Attention for all decode sequences at once, through the dense block table."""
    first, nd = batch.num_prefill_seqs, batch.num_decode_seqs
    t0, t1 = batch.num_prefill_tokens, batch.num_tokens
    _, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    # The whole dense table, not just the pages of the longest sequence: its width
    # is fixed by the engine's persistent input buffers, so a decode step captured
    # in a CUDA graph stays valid as sequences grow (masking does the rest).
    table = batch.block_table[first : first + nd].to(torch.long)
    num_pages = table.shape[1]
    keys = k_cache[table].reshape(nd, num_pages * page_size, num_kv_heads, head_dim).float()
    values = v_cache[table].reshape(nd, num_pages * page_size, num_kv_heads, head_dim).float()
    seq_lens = batch.seq_lens[first : first + nd].to(device=q.device, dtype=torch.long)
    k_pos = torch.arange(num_pages * page_size, device=q.device)
    # The decode query sits at position seq_len - 1; keys past it are other data.
    mask = _allowed((seq_lens - 1)[:, None], k_pos[None, :], sliding_window)
    qd = q[t0:t1].float().reshape(nd, num_kv_heads, group, head_dim)
    scores = torch.einsum("nkgd,nskd->nkgs", qd, keys).mul_(scale)
    scores.masked_fill_(~mask[:, None, None, :], -math.inf)
    probs = torch.softmax(scores, dim=-1)
    o = torch.einsum("nkgs,nskd->nkgd", probs, values)
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
    :param out: optional ``[T, num_heads, head_dim]`` buffer.
    :return: the output, or an empty sentinel when ``out`` is given.
    """
    batch = get_forward_context().batch
    n = batch.num_tokens
    buf = output_buffer(out, q.shape, q.dtype, q.device)
    k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]
    page_size = kv_cache.shape[2]
    slots = batch.slot_mapping[:n]
    write_slots(k_cache, k[:n], slots, page_size)
    write_slots(v_cache, v[:n], slots, page_size)
    if batch.num_prefill_seqs:
        _prefill(q, k_cache, v_cache, buf, batch, scale, sliding_window)
    if batch.num_decode_seqs:
        _decode(q, k_cache, v_cache, buf, batch, scale, sliding_window)
    return finish_output(out, buf, n)


class TorchAttentionBackend(AttentionBackend):
    """Reference attention backend: plain torch ops, any device, no planning."""

    name = "torch"

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
            q, k, v, kv_cache, layer.softmax_scale, layer.sliding_window, out=out
        )

    def dynamic_ops(self) -> tuple[Any, ...]:
        """The one custom op this backend's forward calls."""
        return (torch.ops.backplane_torch.attention.default,)
