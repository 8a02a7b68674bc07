"""Host launchers of the Triton attention kernels (shared by attention and MLA).

:func:`kv_append` writes rows into a paged cache; :func:`paged_prefill` and
:func:`paged_decode` attend a step's prefill/extend and decode sequences,
optionally appending this step's keys and values in the same launch. Grid
sizes come from the host side of the batch (``batch.host`` and the counts);
offsets and page tables are read on the device, so nothing synchronises.

The attention op runs once per layer per step, between the piecewise graphs'
replays, so its host path is kept short: what depends on the batch alone is
worked out once per step (:class:`StepPlan`, the backend's plan), what
depends on a layer's shapes and strides once per layout
(:class:`_PrefillLayout`, :class:`_DecodeLayout`, each holding the compiled
kernels it launched, so a later call builds one argument tuple and launches).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from backplane.backends.triton._common import (
    device_parallelism,
    dot_block,
    ieee_dot,
    interpreting,
    next_pow2,
)
from backplane.backends.triton.attention_configs import (
    _DECODE_CONFIGS,
    _PREFILL_CONFIGS,
    EARLY_MIN_SPLITS,
    KEYS_PER_SPLIT,
    _cfg,
    _configs_key,
    _decode_class,
    _launch_fitting,
    _prefill_class,
    choose_num_splits,
    early_block,
)
from backplane.backends.triton.attention_kernels import (
    _decode_kernel,
    _kv_append_kernel,
    _prefill_kernel,
)
from backplane.core.launch import KernelLauncher, cdiv, dependent_launch, int_key
from backplane.core.metadata import BatchMetadata

_PREFILL = KernelLauncher(_prefill_kernel)
_DECODE = KernelLauncher(_decode_kernel)
_KV_APPEND = KernelLauncher(_kv_append_kernel)

#: Stands in for "no sliding window": larger than any position.
_NO_WINDOW = 1 << 30
_LOG2E = 1.4426950408889634

#: the cache dtype stored scaled (``x / scale``, see :func:`kv_append`)
FP8_KV_DTYPE = torch.float8_e4m3fn

#: Forces the number of decode splits the attention and MLA ops ask for, when set
#: (tests); ``0`` = choose automatically.
_FORCED_SPLITS = {"value": 0}


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two cache views start at the same element of the same storage."""
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """A ``[T, H, D]`` view (``[T, D]`` gains a head axis) with a contiguous last dimension."""
    if x.dim() == 2:
        x = x.unsqueeze(1)
    return x if x.stride(-1) == 1 else x.contiguous()


def _rows_as_given(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`_as_rows` returns both ``k`` and ``v`` themselves (no view, no copy)."""
    return k.dim() == 3 and v.dim() == 3 and k.stride(-1) == 1 and v.stride(-1) == 1


def kv_append(
    src: torch.Tensor,
    cache_plane: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    v_src: torch.Tensor | None = None,
    v_plane: torch.Tensor | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``src[:num_tokens]`` into a cache plane at ``slot_mapping`` (``-1`` skipped).

    A ``float8_e4m3fn`` plane gets the rows divided by their scale, rounded to
    nearest-even and saturated at +-448 (other dtypes ignore the scales).

    :param src: ``[T, H, D]`` (or ``[T, D]``), last dimension contiguous.
    :param cache_plane: a ``[num_pages, page_size, H, D]`` (or ``[num_pages,
        page_size, D]``) view of the cache, last dimension contiguous.
    :param slot_mapping: ``[>= num_tokens]`` int64 device tensor.
    :param num_tokens: how many rows to write (host value).
    :param v_src: optional values, shaped like ``src``, written in the same launch...
    :param v_plane: ...into this plane, strided like ``cache_plane``.
    :param k_scale: an FP8 ``cache_plane`` holds ``src / k_scale``.
    :param v_scale: an FP8 ``v_plane`` holds ``v_src / v_scale``.
    """
    if num_tokens == 0:
        return
    src = _as_rows(src)
    if cache_plane.dim() == 3:
        cache_plane = cache_plane.unsqueeze(2)
    has_v = v_src is not None and v_plane is not None
    if has_v:
        v_src = _as_rows(v_src)
        if v_plane.dim() == 3:
            v_plane = v_plane.unsqueeze(2)
        if v_plane.stride() != cache_plane.stride() or v_src.shape != src.shape:
            kv_append(src, cache_plane, slot_mapping, num_tokens, k_scale=k_scale)
            kv_append(v_src, v_plane, slot_mapping, num_tokens, k_scale=v_scale)
            return
    else:
        v_src, v_plane = src, cache_plane
    _, page_size, H, D = cache_plane.shape
    _KV_APPEND.launch(
        (num_tokens,),
        (
            src,
            v_src,
            cache_plane,
            v_plane,
            slot_mapping,
            src.stride(0),
            src.stride(1),
            v_src.stride(0),
            v_src.stride(1),
            cache_plane.stride(0),
            cache_plane.stride(1),
            cache_plane.stride(2),
            float(k_scale),
            float(v_scale),
        ),
        src.device.index,
        PAGE_SIZE=page_size,
        H=H,
        D=D,
        BLOCK_H=next_pow2(H),
        BLOCK_D=next_pow2(D),
        HAS_V=has_v,
        KV_FP8=cache_plane.dtype == FP8_KV_DTYPE,
    )


def _plane_strides(plane: torch.Tensor) -> tuple[int, int, int]:
    """(page, offset, head) strides of a ``[P, page, H, D]`` or ``[P, page, D]`` cache view."""
    if plane.dim() == 3:
        return plane.stride(0), plane.stride(1), 0
    return plane.stride(0), plane.stride(1), plane.stride(2)


def _kv_fp8_mode(
    q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor, dk: int, dv: int
) -> int:
    """The ``KV_FP8`` of a launch over these cache planes: 0 for a 16- or 32-bit cache, 1
    for an e4m3 one whose tiles Triton widens, 2 where its key and value tiles are read as
    int32 words and widened to float16 in registers (16-bit queries on a GPU, every key and
    value row 4-byte aligned; see ``_e4m3_rows_to_f16``)."""
    if v_plane.dtype != FP8_KV_DTYPE:
        return 0
    words = (
        q.is_cuda
        and not interpreting()
        and q.dtype in (torch.float16, torch.bfloat16)
        and dk % 4 == 0
        and dv % 4 == 0
        and all(
            p.data_ptr() % 4 == 0 and all(s % 4 == 0 for s in _plane_strides(p))
            for p in (k_plane, v_plane)
        )
    )
    return 2 if words else 1


def _tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Device memory for the tensor descriptors a kernel builds (Triton's allocator hook)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


@functools.cache
def _tma_supported(device_index: int) -> bool:
    """Whether kernels on this device can load through tensor descriptors (sm90+, not interpreted).

    The first ``True`` installs a scratch allocator for in-kernel descriptors
    (any allocator handing out device memory serves; fla installs an
    equivalent one).
    """
    if interpreting() or not hasattr(tl, "make_tensor_descriptor"):
        return False
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    triton.set_allocator(_tma_scratch)
    return True


def _tma_rows_shape_ok(x: torch.Tensor, width: int) -> bool:
    """Whether ``x`` ``[T, H, D]`` is shaped to be a ``[T, H * D]`` descriptor of ``width``-wide blocks.

    Its pointer must be 16-byte aligned too, which varies per call.
    """
    return (
        x.stride(2) == 1
        and x.stride(1) == x.shape[2] == width
        and (x.stride(0) * x.element_size()) % 16 == 0
    )


def _head_dims(
    q: torch.Tensor, out: torch.Tensor, q_pe: torch.Tensor | None
) -> tuple[int, int, int, int, bool]:
    """``(num_heads, dk, dv, dpe, big)`` of an attention launch.

    :param q: ``[T, Hq, DK]`` queries.
    :param out: ``[T, Hq, DV]`` output.
    :param q_pe: the optional second query part ``[T, Hq, DPE]``.
    :return: the sizes, and ``big``: a head's dimensions exceed 256, which
        selects the smaller tiles in both launchers' configurations.
    """
    num_heads, dk = q.shape[1], q.shape[2]
    dv = out.shape[2]
    dpe = q_pe.shape[2] if q_pe is not None else 0
    return num_heads, dk, dv, dpe, max(dk, dv) + dpe > 256


class PrefillStep:
    """What the prefill launches of one step read from the batch's host arrays (every layer alike).

    :param batch: the step's metadata; its first ``num_prefill_seqs`` sequences prefill.
    """

    __slots__ = ("any_cached", "max_q", "num_seqs")

    def __init__(self, batch: BatchMetadata) -> None:
        n = batch.num_prefill_seqs
        host = batch.host
        #: prefill/extend sequences of the step
        self.num_seqs = n
        #: the longest prefill query (host value: sizes the grid and picks the tiles)
        self.max_q = int(host.query_lens[:n].max()) if n else 0
        #: whether any prefill sequence has cached keys to read from the pages
        self.any_cached = bool(host.cached_lens[:n].any()) if n else False


class StepPlan:
    """The Triton attention backend's plan: the host facts of one step, shared by its layers.

    The launchers work these out from the batch when no plan is given; a plan
    does it once per step instead of once per layer.

    :param batch: the step's metadata.
    """

    __slots__ = ("_splits", "batch", "prefill")

    def __init__(self, batch: BatchMetadata) -> None:
        #: the batch planned for (a plan serves no other)
        self.batch = batch
        #: the prefill part, ``None`` without prefill sequences
        self.prefill = PrefillStep(batch) if batch.num_prefill_seqs else None
        self._splits: dict[tuple[int, int], int] = {}

    def num_splits(self, programs_per_split: int, keys_per_split: int = KEYS_PER_SPLIT) -> int:
        """The decode's split count for layers of ``programs_per_split`` programs per split.

        :param programs_per_split: :attr:`_DecodeLayout.programs_per_split` of the layer.
        :param keys_per_split: :meth:`_DecodeLayout.split_keys` of the layer for the batch.
        :return: :func:`choose_num_splits` for the batch, worked out once per value.
        """
        key = (programs_per_split, keys_per_split)
        splits = self._splits.get(key)
        if splits is None:
            batch = self.batch
            splits = self._splits[key] = choose_num_splits(
                batch, programs_per_split, batch.device, keys_per_split
            )
        return splits


def prefill_layout(
    q: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    out: torch.Tensor,
    table: torch.Tensor,
    page_size: int,
    *,
    scale: float,
    group: int,
    sliding_window: int = 0,
    q_pe: torch.Tensor | None = None,
    kpe_plane: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> _PrefillLayout:
    """The fixed part of :func:`paged_prefill`'s launches for tensors laid out like these.

    A caller that knows its layout stays the same (an attention layer's
    cache, its q/k/v views) keeps the result and passes it as ``layout``.
    Arguments as for :func:`paged_prefill`, ``table`` the batch's block table.

    :return: the layout.
    """
    return _PrefillLayout(
        q, k_plane, v_plane, out, table, page_size, scale, group, sliding_window,
        q_pe, kpe_plane, k_new, v_new, k_scale, v_scale,
    )  # fmt: skip


def _prefill_layout_key(
    q: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    out: torch.Tensor,
    table: torch.Tensor,
    page_size: int,
    scale: float,
    group: int,
    sliding_window: int,
    q_pe: torch.Tensor | None,
    kpe_plane: torch.Tensor | None,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    k_scale: float,
    v_scale: float,
) -> tuple:
    """Everything :class:`_PrefillLayout` derives from (for callers that keep no layout)."""
    planes = (k_plane, v_plane) if kpe_plane is None else (k_plane, v_plane, kpe_plane)
    rows = () if k_new is None or v_new is None else (k_new, v_new)
    return (
        tuple((t.shape[1:], t.stride(), t.dtype) for t in (q, out, *planes, *rows)),
        None if q_pe is None else (q_pe.shape[1:], q_pe.stride(), q_pe.dtype),
        k_plane.data_ptr() == v_plane.data_ptr(),
        not (
            k_plane.data_ptr()
            | v_plane.data_ptr()
            | (k_plane if kpe_plane is None else kpe_plane).data_ptr()
        )
        & 15,
        q.device,
        table.stride(0),
        page_size,
        scale,
        group,
        sliding_window,
        k_scale,
        v_scale,
    )


def paged_prefill(
    batch: BatchMetadata,
    q: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    group: int,
    sliding_window: int = 0,
    q_pe: torch.Tensor | None = None,
    kpe_plane: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    configs: list[dict] | None = None,
    step: PrefillStep | None = None,
    layout: _PrefillLayout | None = None,
) -> None:
    """Attend the prefill/extend queries of ``batch`` over their keys, writing ``out`` rows.

    :param batch: the step's metadata; its prefill sequences come first.
    :param q: ``[T, Hq, DK]``.
    :param k_plane: keys, ``[P, page, Hkv, DK]`` (or ``[P, page, DK]`` for one shared head).
    :param v_plane: values, like ``k_plane`` with ``DV``.
    :param out: ``[T, Hq, DV]``; rows ``[0, num_prefill_tokens)`` are written.
    :param scale: softmax scale.
    :param group: query heads per kv head.
    :param sliding_window: ``0`` = full causal attention.
    :param q_pe: optional second query part (MLA rotary part), ``[T, Hq, DPE]``.
    :param kpe_plane: the matching key part.
    :param k_new: optional ``[T, Hkv, DK]`` keys of this step: when given, this
        call appends the prefill tokens' rows to ``k_plane`` (at
        ``slot_mapping``) and reads each sequence's own chunk from them
        (contiguous rows), only the cached prefix from the pages; without it
        every key, the chunk's included, must already be in the pages.
    :param v_new: the values matching ``k_new``, appended to ``v_plane``.
    :param k_scale: a ``float8_e4m3fn`` cache holds ``key / k_scale`` (and
        its rotary part, the same); other dtypes ignore the scales.
    :param v_scale: a ``float8_e4m3fn`` cache holds ``value / v_scale``.
    :param configs: launch configurations to try in order (tuning scripts);
        ``None`` = the defaults for the shape.
    :param step: the step's :class:`PrefillStep` (from the backend's plan);
        ``None`` reads it from the batch.
    :param layout: :func:`prefill_layout`'s result for these tensors' layout
        (the same planes), kept by the caller; ``None`` looks it up.
    """
    n = batch.num_prefill_seqs
    if n == 0:
        return
    if step is None:
        step = PrefillStep(batch)
    max_q = step.max_q
    if layout is None:
        layout_key = _prefill_layout_key(
            q, k_plane, v_plane, out, batch.block_table, batch.page_size,
            scale, group, sliding_window, q_pe, kpe_plane, k_new, v_new, k_scale, v_scale,
        )  # fmt: skip
        layout = _PREFILL_LAYOUTS.get(layout_key)
        if layout is None:
            layout = _PREFILL_LAYOUTS[layout_key] = prefill_layout(
                q, k_plane, v_plane, out, batch.block_table, batch.page_size,
                scale=scale, group=group, sliding_window=sliding_window,
                q_pe=q_pe, kpe_plane=kpe_plane, k_new=k_new, v_new=v_new,
                k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
    if layout.has_pe:
        qpe, kpe = q_pe, kpe_plane
    else:
        qpe, kpe = q, k_plane
    if layout.from_input:
        if layout.rows_as_given:
            kn, vn = k_new, v_new
        else:
            kn, vn = _as_rows(k_new), _as_rows(v_new)
    else:
        if layout.appending:
            kv_append(
                k_new, k_plane, batch.slot_mapping, batch.num_prefill_tokens, v_new, v_plane,
                k_scale=layout.k_scale, v_scale=layout.v_scale,
            )  # fmt: skip
        kn, vn = k_plane, v_plane  # unused: any tensors serve as placeholders
    # In-kernel descriptors cost a scratch allocation per launch: worth it
    # for long prompts only (at 4k tokens loads are as fast without).
    use_tma = (
        max_q >= 4096
        and layout.tma_shapes
        and not (kn.data_ptr() | vn.data_ptr()) & 15
        and _tma_supported(q.device.index if q.device.index is not None else 0)
    )
    paged_keys = not layout.from_input or step.any_cached
    if configs is None:
        cfg_id: Any = _prefill_class(layout.big, max_q, layout.dk)
        configs = _PREFILL_CONFIGS[cfg_id]
    else:
        cfg_id = _configs_key(configs)
    qsl, cached, table, slots = (
        batch.query_start_loc,
        batch.cached_lens,
        batch.block_table,
        batch.slot_mapping,
    )
    num_rows = kn.shape[0]
    args = (
        q, qpe, k_plane, kpe, v_plane, kn, vn, out, qsl, cached, table, slots, num_rows,
        *layout.tail,
    )  # fmt: skip
    device = q.device.index
    num_heads = layout.num_heads
    # As in paged_decode: with every pointer 16-byte aligned, the compiled
    # kernel is found by a key of what varies per call, the rest is the layout's.
    aligned = (
        layout.planes_aligned
        and not (
            q.data_ptr()
            | qpe.data_ptr()
            | kn.data_ptr()
            | vn.data_ptr()
            | out.data_ptr()
            | qsl.data_ptr()
            | cached.data_ptr()
            | table.data_ptr()
            | slots.data_ptr()
        )
        & 15
    )
    if aligned:
        hit_key = (cfg_id, use_tma, paged_keys, int_key(num_rows), out.dtype, kn.dtype, vn.dtype,
                   qsl.dtype, cached.dtype, table.dtype, slots.dtype)  # fmt: skip
        hit = layout.hits.get(hit_key)
        if hit is not None:
            kernel, block_m = hit
            kernel.launch(num_heads, cdiv(max_q, block_m), n, device, *args)
            return
    meta = dict(layout.meta, USE_TMA=use_tma, PAGED_KEYS=paged_keys)
    key = (*layout.config_key, use_tma, paged_keys, layout.windowed, cfg_id)
    launch_key = (layout.spec_key, hit_key) if aligned else None
    choice = _launch_fitting(
        _PREFILL,
        lambda c: (num_heads, cdiv(max_q, c["BLOCK_M"]), n),
        key,
        configs,
        args,
        meta,
        launch_key,
    )
    if aligned:
        kernel = _PREFILL.lookup((launch_key, choice), device)
        if kernel is not None:
            layout.hits[hit_key] = (kernel, configs[choice]["BLOCK_M"])


class _PrefillLayout:
    """What a prefill launch derives from a layer's shapes and strides alone (cached)."""

    def __init__(
        self,
        q: torch.Tensor,
        k_plane: torch.Tensor,
        v_plane: torch.Tensor,
        out: torch.Tensor,
        table: torch.Tensor,
        page_size: int,
        scale: float,
        group: int,
        sliding_window: int,
        q_pe: torch.Tensor | None,
        kpe_plane: torch.Tensor | None,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        num_heads, dk, dv, dpe, big = _head_dims(q, out, q_pe)
        kv_fp8 = k_plane.dtype == FP8_KV_DTYPE
        #: the scales of an FP8 cache (appends divide by them), else 1.0
        self.k_scale, self.v_scale = (k_scale, v_scale) if kv_fp8 else (1.0, 1.0)
        has_pe = q_pe is not None
        self.num_heads, self.dk, self.big, self.has_pe = num_heads, dk, big, has_pe
        qpe = q_pe if has_pe else q
        kpe = kpe_plane if has_pe else k_plane
        #: this step's keys and values are given (appended by the launch or before it)
        self.appending = k_new is not None and v_new is not None
        #: ... and given as ``[T, H, D]`` rows with a contiguous last dimension
        self.rows_as_given = self.appending and _rows_as_given(k_new, v_new)
        kn, vn = (_as_rows(k_new), _as_rows(v_new)) if self.appending else (k_plane, v_plane)
        #: the chunk's keys come from this step's rows (the kernel appends them)
        self.from_input = (
            self.appending
            and not has_pe
            and kn.dtype == k_plane.dtype
            and vn.dtype == v_plane.dtype
        )
        if not self.from_input:
            kn, vn = k_plane, v_plane
        #: the rows could be tensor descriptors (their pointers and the device aside)
        self.tma_shapes = (
            self.from_input
            and q.is_cuda
            and dot_block(dk) == dk
            and dot_block(dv) == dv
            and _tma_rows_shape_ok(kn, dk)
            and _tma_rows_shape_ok(vn, dv)
        )
        self.windowed = sliding_window > 0
        #: the launch's arguments after the row count
        self.tail = (
            q.stride(0),
            q.stride(1),
            qpe.stride(0),
            qpe.stride(1),
            *_plane_strides(k_plane),
            *_plane_strides(kpe),
            *_plane_strides(v_plane),
            kn.stride(0),
            kn.stride(1) if self.from_input else 0,
            vn.stride(0),
            vn.stride(1) if self.from_input else 0,
            out.stride(0),
            out.stride(1),
            table.stride(0),
            # an FP8 cache's keys are read as stored: k_scale rides on the scores
            scale * _LOG2E * self.k_scale,
            group,
            sliding_window if self.windowed else _NO_WINDOW,
            num_heads // group,
            float(self.v_scale),
        )
        self.meta = dict(
            DK=dk,
            DPE=dpe,
            DV=dv,
            PAGE_SIZE=page_size,
            BLOCK_DK=dot_block(dk),
            BLOCK_DPE=dot_block(dpe) if has_pe else 16,
            BLOCK_DV=dot_block(dv),
            HAS_PE=has_pe,
            V_FROM_K=_same_storage(v_plane, k_plane) and dv == dk,
            # an FP8 cache's tiles are widened to the queries' dtype for the dots
            IEEE=ieee_dot(q.dtype if kv_fp8 else k_plane.dtype),
            CHUNK_FROM_INPUT=self.from_input,
            WINDOWED=self.windowed,
            APPEND=self.from_input,
            KV_FP8=_kv_fp8_mode(q, k_plane, v_plane, dk, dv),
        )
        #: the config choice's key, less what a step decides
        self.config_key = ("prefill", dk, dpe, dv, k_plane.dtype, q.dtype, self.from_input)
        #: the cache planes are 16-byte aligned (Triton specialises on it)
        self.planes_aligned = not (k_plane.data_ptr() | kpe.data_ptr() | v_plane.data_ptr()) & 15
        #: (compiled kernel, its BLOCK_M) by what else a launch specialises on (aligned launches)
        self.hits: dict[tuple, tuple[Any, int]] = {}
        #: what the kernel specialises on that the layout fixes
        self.spec_key = (
            tuple(self.meta.items()),
            tuple(int_key(v) if type(v) is int else type(v) for v in self.tail),
            self.planes_aligned,
            q.dtype,
            qpe.dtype,
            k_plane.dtype,
            kpe.dtype,
            v_plane.dtype,
        )


#: the fixed part of prefill launches, by layout (see :class:`_PrefillLayout`)
_PREFILL_LAYOUTS: dict[tuple, _PrefillLayout] = {}


#: Per device: every arrival-counter buffer of the split-KV decode handed out
#: (the last is the current one), all zero between launches.
_ARRIVALS: dict[torch.device, list[torch.Tensor]] = {}


def _arrivals(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` zeroed int32 counters on ``device``, kept across launches.

    The decode kernel leaves every counter it used at zero again, so one
    buffer serves every layer and step. It grows to the next power of two;
    outgrown buffers are kept, never freed: a CUDA graph captured with one
    replays into it (a graph holds no reference to its buffers, and freed
    memory would be handed to other tensors).
    """
    bufs = _ARRIVALS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < count:
        bufs.append(torch.zeros(next_pow2(max(count, 1024)), dtype=torch.int32, device=device))
    return bufs[-1]


#: Per device and use: every scratch buffer of split partials handed out (the last is current).
_PARTIALS: dict[tuple[torch.device, str], list[torch.Tensor]] = {}


def _partials(device: torch.device, use: str, count: int) -> torch.Tensor:
    """At least ``count`` float32 scratch elements for the splits' partial results.

    ``use`` names the buffer (``"out"``: partial outputs, ``"lse"``: their
    log2-sum-exps). Shared by every decode launch on ``device``: launches on
    one stream run one after another, and each merges its splits before it
    ends. Grown and kept as :func:`_arrivals`.
    """
    bufs = _PARTIALS.setdefault((device, use), [])
    if not bufs or bufs[-1].numel() < count:
        bufs.append(torch.empty(next_pow2(max(count, 4096)), dtype=torch.float32, device=device))
    return bufs[-1]


def decode_layout(
    q: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    out: torch.Tensor,
    table: torch.Tensor,
    page_size: int,
    *,
    scale: float,
    group: int,
    sliding_window: int = 0,
    q_pe: torch.Tensor | None = None,
    kpe_plane: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> _DecodeLayout:
    """The fixed part of :func:`paged_decode`'s launches for tensors laid out like these.

    A caller that knows its layout stays the same (an attention layer's
    cache, its q/k/v views) keeps the result and passes it as ``layout``; it
    also records the planes' alignment, so only the per-step pointers are
    checked per launch. Arguments as for :func:`paged_decode`, ``table`` the
    batch's block table.
    """
    append = k_new is not None and v_new is not None
    kn, vn = (_as_rows(k_new), _as_rows(v_new)) if append else (q, q)
    qpe = q if q_pe is None else q_pe
    kpe = k_plane if kpe_plane is None else kpe_plane
    layout = _DecodeLayout(
        q, qpe, k_plane, kpe, v_plane, out, kn, vn, table, page_size,
        scale, group, sliding_window, q_pe is not None, append, k_scale, v_scale,
    )  # fmt: skip
    layout.rows_as_given = append and _rows_as_given(k_new, v_new)
    return layout


def paged_decode(
    batch: BatchMetadata,
    q: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    group: int,
    sliding_window: int = 0,
    q_pe: torch.Tensor | None = None,
    kpe_plane: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_splits: int | None = None,
    configs: list[dict] | None = None,
    layout: _DecodeLayout | None = None,
    min_split_keys: int | None = None,
) -> None:
    """Split-KV decode for the decode sequences of ``batch``, writing their ``out`` rows.

    One launch: the last split of each (sequence, head block) to finish merges
    the splits (see ``_decode_kernel``). Arguments as for
    :func:`paged_prefill`, except that ``k_new``/``v_new`` (this step's
    ``[T, Hkv, D]`` rows), when given, are appended to the pages by the kernel
    for the decode tokens, which must then not be appended before;
    ``num_splits`` overrides :func:`choose_num_splits` (tests use it to force
    several splits); ``layout`` is :func:`decode_layout`'s result for these
    tensors' layout (the same planes), kept by the caller; ``None`` looks it up.
    ``min_split_keys``: the fewest keys a split of a sequence takes (see
    ``_decode_kernel``), :data:`KEYS_PER_SPLIT` by default, 0 (every context
    divided among all the splits) while a test forces the split count.
    """
    nd = batch.num_decode_seqs
    if nd == 0:
        return
    append = k_new is not None and v_new is not None
    if not append:
        kn, vn = q, q  # unused placeholders
    elif layout is not None and layout.rows_as_given:
        kn, vn = k_new, v_new
    else:
        kn, vn = _as_rows(k_new), _as_rows(v_new)
    qpe = q if q_pe is None else q_pe
    kpe = k_plane if kpe_plane is None else kpe_plane
    slots, seq_lens, table = batch.slot_mapping, batch.seq_lens, batch.block_table
    if layout is None:
        # Everything but the pointers, the batch and the split count is fixed
        # for a layer: worked out once per layout.
        layout_key = (
            q.shape[1:],
            q.stride(),
            q.dtype,
            qpe.shape[1:],
            qpe.stride(),
            out.shape[1:],
            out.stride(),
            k_plane.shape[1:],
            k_plane.stride(),
            k_plane.dtype,
            kpe.shape[1:],
            kpe.stride(),
            v_plane.shape[1:],
            v_plane.stride(),
            k_plane.data_ptr() == v_plane.data_ptr(),
            not (k_plane.data_ptr() | kpe.data_ptr() | v_plane.data_ptr()) & 15,
            kn.stride(),
            vn.stride(),
            q_pe is not None,
            append,
            table.stride(0),
            batch.page_size,
            scale,
            group,
            sliding_window,
            k_scale,
            v_scale,
        )
        layout = _DECODE_LAYOUTS.get(layout_key)
        if layout is None:
            layout = _DECODE_LAYOUTS[layout_key] = decode_layout(
                q, k_plane, v_plane, out, table, batch.page_size,
                scale=scale, group=group, sliding_window=sliding_window,
                q_pe=q_pe, kpe_plane=kpe_plane, k_new=k_new, v_new=v_new,
                k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
    # Loading the first tile before the wait for the queries pays where most
    # of the device is idle and the programs would wait on their page walks; a
    # full device hides that latency with other programs instead.
    early = layout.early_launch(nd)
    split_keys = layout.early if early else KEYS_PER_SPLIT
    if min_split_keys is None:
        min_split_keys = 0 if _FORCED_SPLITS["value"] else split_keys
    if num_splits is None:
        num_splits = choose_num_splits(batch, layout.programs_per_split, q.device, split_keys)
    if configs is None:
        if early:
            # splits of one early tile's keys, each read before the wait
            cfg_id: Any = layout.early_cfg_id
            configs = layout.early_configs
        else:
            cfg_id = _decode_class(layout.big, layout.dk, num_splits)
            configs = _DECODE_CONFIGS[cfg_id]
    else:
        cfg_id = _configs_key(configs)
    dev = q.device
    if num_splits > 1:
        rows = nd * layout.num_heads * num_splits
        partial = _partials(dev, "out", rows * layout.block_dv)
        lse = _partials(dev, "lse", rows)
        arrivals = _arrivals(dev, nd * layout.programs_per_split)
    else:
        partial = lse = arrivals = out  # unused placeholders
    nps, npt = batch.num_prefill_seqs, batch.num_prefill_tokens
    args = (
        q, qpe, k_plane, kpe, v_plane, out, partial, lse, arrivals, kn, vn,
        slots, seq_lens, table, nps, npt, *layout.tail,
    )  # fmt: skip
    # The common case, every pointer 16-byte aligned, gets a key cheaper than
    # one derived argument by argument (the planes' alignment is the layout's,
    # the scratch buffers are allocations of their own).
    aligned = (
        layout.planes_aligned
        and not (
            q.data_ptr()
            | qpe.data_ptr()
            | out.data_ptr()
            | kn.data_ptr()
            | vn.data_ptr()
            | slots.data_ptr()
            | seq_lens.data_ptr()
            | table.data_ptr()
        )
        & 15
    )
    device = dev.index
    if aligned:
        hit_key = (num_splits, min_split_keys, early, cfg_id, int_key(nps), int_key(npt), out.dtype,
                   kn.dtype, vn.dtype, slots.dtype, seq_lens.dtype, table.dtype)  # fmt: skip
        hit = layout.hits.get(hit_key)
        if hit is not None:
            hit.launch(nd, layout.programs_per_split, num_splits, device, *args)
            return
    meta = dict(
        layout.meta,
        NUM_SPLITS=num_splits,
        BLOCK_S=next_pow2(num_splits),
        MIN_SPLIT_KEYS=min_split_keys,
        EARLY=early,
    )
    key = (*layout.config_key, cfg_id)
    grid = (nd, layout.programs_per_split, num_splits)
    launch_key = (layout.spec_key, hit_key) if aligned else None
    choice = _launch_fitting(_DECODE, lambda c: grid, key, configs, args, meta, launch_key)
    if aligned:
        hit = _DECODE.lookup((launch_key, choice), device)
        if hit is not None:
            layout.hits[hit_key] = hit


class _DecodeLayout:
    """What a decode launch derives from a layer's shapes and strides alone (cached)."""

    def __init__(
        self,
        q: torch.Tensor,
        qpe: torch.Tensor,
        k_plane: torch.Tensor,
        kpe: torch.Tensor,
        v_plane: torch.Tensor,
        out: torch.Tensor,
        kn: torch.Tensor,
        vn: torch.Tensor,
        table: torch.Tensor,
        page_size: int,
        scale: float,
        group: int,
        sliding_window: int,
        has_pe: bool,
        append: bool,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        num_heads, dk, dv, dpe, big = _head_dims(q, out, qpe if has_pe else None)
        kv_fp8 = k_plane.dtype == FP8_KV_DTYPE
        if not kv_fp8:
            k_scale = v_scale = 1.0
        self.num_heads, self.dk, self.big = num_heads, dk, big
        #: this step's rows came as ``[T, H, D]`` with a contiguous last dimension
        #: (used as given; set by :func:`decode_layout`)
        self.rows_as_given = False
        block_h = min(dot_block(group), 16 if big else 64)
        head_blocks = cdiv(group, block_h)
        pdl = q.is_cuda and dependent_launch(q.device.index)
        #: programs per sequence and split: kv heads times head blocks
        self.programs_per_split = (num_heads // group) * head_blocks
        self.block_dv = dot_block(dv)
        #: the launch's integer and float arguments after the batch's
        self.tail = (
            kn.stride(0),
            kn.stride(1),
            vn.stride(0),
            vn.stride(1),
            q.stride(0),
            q.stride(1),
            qpe.stride(0),
            qpe.stride(1),
            *_plane_strides(k_plane),
            *_plane_strides(kpe),
            *_plane_strides(v_plane),
            out.stride(0),
            out.stride(1),
            table.stride(0),
            # an FP8 cache's keys are read as stored: k_scale rides on the scores
            scale * _LOG2E * k_scale,
            num_heads,
            group,
            sliding_window if sliding_window > 0 else _NO_WINDOW,
            float(k_scale),
            float(v_scale),
        )
        self.meta = dict(
            DK=dk,
            DPE=dpe,
            DV=dv,
            PAGE_SIZE=page_size,
            HEAD_BLOCKS=head_blocks,
            BLOCK_H=block_h,
            BLOCK_DK=dot_block(dk),
            BLOCK_DPE=dot_block(dpe) if has_pe else 16,
            BLOCK_DV=self.block_dv,
            HAS_PE=has_pe,
            V_FROM_K=_same_storage(v_plane, k_plane) and dv == dk,
            # an FP8 cache's tiles are widened to the queries' dtype for the dots
            IEEE=ieee_dot(q.dtype if kv_fp8 else k_plane.dtype),
            APPEND=append,
            PDL=pdl,
            KV_FP8=_kv_fp8_mode(q, k_plane, v_plane, dk, dv),
        )
        if pdl:
            self.meta["launch_pdl"] = True
        #: keys of the first tile a program may read before this step's rows are
        #: appended (it puts the new row in itself; plain keys and values of
        #: regular heads only), 0 for none; see :func:`early_block`
        self.early = 0
        if append and not has_pe and not big and not self.meta["V_FROM_K"]:
            widened = q.element_size() if kv_fp8 else k_plane.element_size()
            self.early = early_block(self.meta["BLOCK_DK"], self.block_dv, max(widened, 2))
        #: the launch configuration of early launches (tiles of the early tile's keys)
        self.early_configs = [_cfg(None, self.early, 4, 2)] if self.early else []
        self.early_cfg_id = ("early", self.early)
        #: programs that keep the device busy (see :func:`device_parallelism`)
        self.parallelism = device_parallelism(q.device)
        #: the config choice's key, less the configuration class
        self.config_key = ("decode", dk, dpe, dv, k_plane.dtype, q.dtype, block_h)
        #: the cache planes are 16-byte aligned (Triton specialises on it)
        self.planes_aligned = not (k_plane.data_ptr() | kpe.data_ptr() | v_plane.data_ptr()) & 15
        #: compiled kernels by what else a launch specialises on (aligned launches)
        self.hits: dict[tuple, Any] = {}
        #: what the kernel specialises on that the layout fixes
        self.spec_key = (
            tuple(self.meta.items()),
            tuple(int_key(v) if type(v) is int else type(v) for v in self.tail),
            self.planes_aligned,
            q.dtype,
            qpe.dtype,
            k_plane.dtype,
            kpe.dtype,
            v_plane.dtype,
        )

    def early_launch(self, num_decode_seqs: int) -> bool:
        """Whether a launch over ``num_decode_seqs`` sequences reads each split's first tile
        before its wait: where the layout has one and the device holds at least
        :data:`EARLY_MIN_SPLITS` splits of every sequence (its programs would otherwise
        wait on their page walks while other programs could run)."""
        return (
            self.early > 0
            and num_decode_seqs * self.programs_per_split * EARLY_MIN_SPLITS <= self.parallelism
        )

    def split_keys(self, num_decode_seqs: int) -> int:
        """About how many keys a decode split of such a launch is given (see
        :func:`choose_num_splits`): one early tile's in an early launch, else
        :data:`KEYS_PER_SPLIT`."""
        return self.early if self.early_launch(num_decode_seqs) else KEYS_PER_SPLIT


#: the fixed part of decode launches, by layout (see :class:`_DecodeLayout`)
_DECODE_LAYOUTS: dict[tuple, _DecodeLayout] = {}
