"""Paged attention in Triton: ragged prefill/extend and split-KV decode, with the KV append.

One cached op, ``backplane_triton::attention``, runs at most two kernels, and
each appends its own tokens' keys and values to the paged cache at
``slot_mapping`` (``-1`` = padding, skipped), so no launch is spent on the
append alone (the op runs per layer per step; at small batches launches cost
more than the work):

1. ``_prefill_kernel`` attends every prefill/extend query to its sequence's
   keys, with causal and optional sliding-window masks; one program per
   ``(sequence, query block, query head)``. The cached prefix is read from
   the pages, the sequence's own chunk from this step's contiguous key/value
   rows (through tensor descriptors on sm90+ for long prompts): a prompt's
   keys need no page gather;
2. ``_decode_kernel`` attends the one query of each decode sequence, split
   along the keys into ``num_splits`` parts so that long contexts fill the
   device; one program per ``(sequence, kv head x head block, split)`` serving
   every query head of its GQA group, so each key/value page is read once.
   The last split of a sequence to finish merges the splits by their
   log-sum-exp, in the same launch.

``_kv_append_kernel`` alone serves MLA's latent cache and layouts the prefill
kernel cannot read from the step's rows.

A ``float8_e4m3fn`` cache holds ``key / k_scale`` and ``value / v_scale`` (the
layer's scales), rounded to nearest-even and saturated at +-448 as the torch
backend stores them; the kernels read it as stored, the scores carry
``k_scale`` and the outputs ``v_scale``. The prefill then reads every key
from the pages, after one append launch, so the step's own keys are attended
to as rounded, like those of later steps. e4m3 needs a GPU of compute
capability 8.9 or newer (Triton converts to it there only).

The kernels are written generally enough to serve MLA too (see
:mod:`backplane.backends.triton.mla`): the key may come in two parts (a main
part and a rotary part, each with its own query part) and the value may be a
view of the key's storage.

The kernels live in :mod:`~backplane.backends.triton.attention_kernels`, their
launch configurations in :mod:`~backplane.backends.triton.attention_configs` and
the host launchers in :mod:`~backplane.backends.triton.attention_launch`; this
module holds the op and the backend.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from backplane.backends.triton.attention_launch import (
    _FORCED_SPLITS,
    StepPlan,
    decode_layout,
    kv_append,
    paged_decode,
    paged_prefill,
    prefill_layout,
)
from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.families import AttentionBackend, AttentionLayerSpec
from backplane.core.forward_context import get_forward_context
from backplane.core.metadata import BatchMetadata


class _LayerLayouts:
    """The prefill and decode layouts of one layer's calls (each worked out on first use)."""

    __slots__ = ("decode", "decode_rows", "prefill")

    def __init__(self) -> None:
        self.prefill: Any = None
        self.decode: Any = None
        self.decode_rows: Any = None  # decode without the in-kernel append


class _CacheLayouts:
    """The launch layouts worked out for one layer's cache, by the layout of a call's tensors.

    A layer calls the op with the same cache tensor and identically laid out
    q/k/v views every step, so a few strides find its layout (the planes'
    shapes, strides and alignment are the cache's, fixed while it lives).
    No tensor is kept: a view of the cache would keep it alive.
    """

    __slots__ = ("__weakref__", "cache", "layouts")

    def __init__(self, kv_cache: torch.Tensor) -> None:
        key = id(kv_cache)
        # Forgotten with the cache: a later tensor may get its id.
        self.cache = weakref.ref(kv_cache, lambda _: _CACHE_LAYOUTS.pop(key, None))
        self.layouts: dict[tuple, _LayerLayouts] = {}


#: by ``id`` of the cache tensor (checked against the weak reference)
_CACHE_LAYOUTS: dict[int, _CacheLayouts] = {}


def _layer_layouts(
    kv_cache: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    batch: BatchMetadata,
    scale: float,
    group: int,
    sliding_window: int,
    kv_scales: tuple[float, float],
) -> _LayerLayouts:
    """The layouts of this call, found by the call's strides under its cache."""
    entry = _CACHE_LAYOUTS.get(id(kv_cache))
    if entry is None or entry.cache() is not kv_cache:
        entry = _CACHE_LAYOUTS[id(kv_cache)] = _CacheLayouts(kv_cache)
    sig = (
        q.shape[1:],
        q.stride(),
        k.shape[1:],
        k.stride(),
        v.stride(),
        out.stride(),
        q.dtype,
        k.dtype,
        v.dtype,
        batch.block_table.stride(0),
        batch.page_size,
        scale,
        sliding_window,
        kv_scales,
    )
    layouts = entry.layouts.get(sig)
    if layouts is None:
        layouts = entry.layouts[sig] = _LayerLayouts()
    return layouts


@cached_op(
    "backplane_triton::attention",
    mutates_args=("kv_cache", "out"),
    output_shape=AttentionBackend.output_shape,
)
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    sliding_window: int,
    scale: float,
    k_scale: float,
    v_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Append ``k``/``v`` to the paged cache and attend (see the module docstring).

    The step's facts come from the backend's plan when the forward context
    holds one for this batch (:meth:`TritonAttentionBackend.plan`), else from
    the batch; the launches' fixed part is kept per cache and layout.

    :param q: ``[T, Hq, D]``.
    :param k: ``[T, Hkv, D]``.
    :param v: ``[T, Hkv, D]``.
    :param kv_cache: ``[P, 2, page, Hkv, D]``, written at ``slot_mapping``.
    :param sliding_window: ``0`` = full causal attention.
    :param scale: softmax scale.
    :param k_scale: a ``float8_e4m3fn`` cache holds ``k / k_scale`` (other
        dtypes ignore it).
    :param v_scale: a ``float8_e4m3fn`` cache holds ``v / v_scale``.
    :param out: optional ``[T, Hq, D]`` buffer.
    :return: the output or the empty sentinel.
    """
    ctx = get_forward_context()
    batch = ctx.batch
    # The engine's calls pass a matching buffer: checked here, explained by
    # output_buffer only when it does not match.
    if out is not None and out.shape == q.shape and out.dtype == q.dtype and out.device == q.device:
        buf = out
    else:
        buf = output_buffer(out, q.shape, q.dtype, q.device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    plan = ctx.plans.get("attention")
    if plan is not None and plan.batch is not batch:
        plan = None  # made for another batch: not this step's facts
    k_plane, v_plane = kv_cache.unbind(1)
    group = q.shape[1] // k.shape[1]
    layouts = _layer_layouts(
        kv_cache, q, k, v, buf, batch, scale, group, sliding_window, (k_scale, v_scale)
    )
    # Both kernels append their own tokens' keys and values (no append launch).
    if batch.num_prefill_seqs:
        layout = layouts.prefill
        if layout is None:
            layout = layouts.prefill = prefill_layout(
                q, k_plane, v_plane, buf, batch.block_table, batch.page_size,
                scale=scale, group=group, sliding_window=sliding_window, k_new=k, v_new=v,
                k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        paged_prefill(
            batch, q, k_plane, v_plane, buf,
            scale=scale, group=group, sliding_window=sliding_window, k_new=k, v_new=v,
            step=plan.prefill if plan is not None else None, layout=layout,
        )  # fmt: skip
    if batch.num_decode_seqs:
        # Rows that are positions of one sequence's chunk read each other's keys:
        # every row is appended before any attends, and the kernel appends nothing.
        shared = batch.mode.rows_share_pages
        if shared:
            first = batch.num_prefill_tokens
            kv_append(
                k[first:], k_plane, batch.slot_mapping[first:], batch.num_decode_tokens,
                v[first:], v_plane, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        k_new, v_new = (None, None) if shared else (k, v)
        layout = layouts.decode_rows if shared else layouts.decode
        if layout is None:
            layout = decode_layout(
                q, k_plane, v_plane, buf, batch.block_table, batch.page_size,
                scale=scale, group=group, sliding_window=sliding_window, k_new=k_new,
                v_new=v_new, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
            if shared:
                layouts.decode_rows = layout
            else:
                layouts.decode = layout
        splits = _FORCED_SPLITS["value"]
        if not splits and plan is not None:
            splits = plan.num_splits(
                layout.programs_per_split, layout.split_keys(batch.num_decode_seqs)
            )
        paged_decode(
            batch, q, k_plane, v_plane, buf,
            scale=scale, group=group, sliding_window=sliding_window, k_new=k_new,
            v_new=v_new, num_splits=splits or None, layout=layout,
        )  # fmt: skip
    return finish_output(out, buf, batch.num_tokens)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with the Triton kernels of :mod:`.attention_kernels` (GQA, sliding window)."""

    name = "triton"
    supports_fp8_kv_cache = True

    def plan(self, batch: BatchMetadata) -> StepPlan | None:
        """Work out the step's prefill facts once for every layer (split counts on first use).

        A decode graph gets none: its launches, split counts included, are fixed
        when it is captured (each layer works its split count out from the capture
        batch), and its replays read every length on the device. So nothing is
        planned per replayed step, and chained draft steps can be captured over
        this backend.

        :param batch: the step's metadata.
        :return: the :class:`~.attention_launch.StepPlan` the op reads, or ``None``.
        """
        if batch.mode.is_decode_graph:
            return None
        return StepPlan(batch)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: AttentionLayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append this step's keys/values and attend; see :meth:`AttentionBackend.forward`."""
        return paged_attention(
            q,
            k,
            v,
            kv_cache,
            int(layer.sliding_window),
            float(layer.softmax_scale),
            float(layer.k_scale),
            float(layer.v_scale),
            out,
        )

    def dynamic_ops(self) -> tuple:
        """The attention op runs eagerly between captured graph segments."""
        return (torch.ops.backplane_triton.attention.default,)
