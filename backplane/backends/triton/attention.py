"""Paged attention in Triton: KV append, ragged prefill/extend and split-KV decode.

One cached op, ``backplane_triton::attention``, runs three kernels (or four):

1. ``_kv_append_kernel`` writes this step's keys and values into the paged
   cache at ``slot_mapping`` (``-1`` = padding, skipped);
2. ``_prefill_kernel`` attends every prefill/extend query to its sequence's
   keys, read from the pages (the cached prefix and the chunk just appended),
   with causal and optional sliding-window masks; one program per
   ``(sequence, query block, query head)``;
3. ``_decode_kernel`` attends the one query of each decode sequence, split
   along the keys into ``num_splits`` parts so that long contexts fill the
   device; one program per ``(sequence, kv head x head block, split)`` serving
   every query head of its GQA group, so each key/value page is read once;
4. ``_decode_reduce_kernel`` merges the splits by their log-sum-exp.

The kernels are written generally enough to serve MLA too (see
:mod:`backplane.backends.triton.mla`): the key may come in two parts (a main
part and a rotary part, each with its own query part) and the value may be a
view of the key's storage.

Grid sizes come from the host side of the batch (``batch.host`` and the counts);
offsets and page tables are read on the device, so nothing synchronises.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from backplane.backends.triton._common import (
    MAX_KV_SPLITS,
    device_parallelism,
    dot_block,
    ieee_dot,
    next_pow2,
)
from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.families import AttentionBackend, AttentionLayerSpec
from backplane.core.forward_context import get_forward_context
from backplane.core.metadata import BatchMetadata

#: Stands in for "no sliding window": larger than any position.
_NO_WINDOW = 1 << 30
_LOG2E = 1.4426950408889634


# -- kernels ------------------------------------------------------------------


@triton.jit
def _kv_append_kernel(
    src_ptr,
    cache_ptr,
    slot_ptr,
    stride_st,
    stride_sh,
    stride_cp,
    stride_co,
    stride_ch,
    page_size,
    H,
    D,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Copy token ``pid``'s ``[H, D]`` row of ``src`` into the cache slot ``slot_mapping[pid]``."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    hs = tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    # The scalar is broadcast to a block first: the interpreter rejects scalar-by-block masks.
    valid = (hs[:, None] * 0 + slot) >= 0
    mask = (hs[:, None] < H) & (ds[None, :] < D) & valid
    slot = tl.maximum(slot, 0)
    page = slot // page_size
    off = slot % page_size
    x = tl.load(src_ptr + t * stride_st + hs[:, None] * stride_sh + ds[None, :], mask=mask)
    dst = cache_ptr + page * stride_cp + off * stride_co + hs[:, None] * stride_ch + ds[None, :]
    tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    qpe,
    start,
    hi,
    q_pos,
    window,
    bt_row,
    k_ptr,
    kpe_ptr,
    v_ptr,
    stride_kp,
    stride_ko,
    stride_kh,
    stride_ep,
    stride_eo,
    stride_eh,
    stride_vp,
    stride_vo,
    stride_vh,
    kvh,
    qk_scale,
    DK,
    DPE,
    DV,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_PE: tl.constexpr,
    V_FROM_K: tl.constexpr,
    IEEE: tl.constexpr,
    MASK: tl.constexpr,
):
    """Fold the ``BLOCK_N`` keys from ``start`` into one online-softmax state.

    Shared by the prefill and decode kernels. ``MASK`` says what is hidden:
    ``0`` nothing (the tile lies below every row's causal limit and inside its
    window, so no compare is spent), ``1`` the keys at or past ``hi``, ``2``
    those and, per row, keys past ``q_pos`` or ``window`` or more behind it.

    :return: the updated ``(acc, m_i, l_i)``.
    """
    offs_n = start + tl.arange(0, BLOCK_N)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    if MASK == 0:
        n_mask = offs_n >= 0
        page = tl.load(bt_row + offs_n // PAGE_SIZE).to(tl.int64)
    else:
        n_mask = offs_n < hi
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    off = offs_n % PAGE_SIZE
    k = tl.load(
        k_ptr
        + page[:, None] * stride_kp
        + off[:, None] * stride_ko
        + kvh * stride_kh
        + dk[None, :],
        mask=n_mask[:, None] & (dk[None, :] < DK),
        other=0.0,
    )
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if HAS_PE:
        de = tl.arange(0, BLOCK_DPE)
        kpe = tl.load(
            kpe_ptr
            + page[:, None] * stride_ep
            + off[:, None] * stride_eo
            + kvh * stride_eh
            + de[None, :],
            mask=n_mask[:, None] & (de[None, :] < DPE),
            other=0.0,
        )
        if IEEE:
            s += tl.dot(qpe, tl.trans(kpe), input_precision="ieee")
        else:
            s += tl.dot(qpe, tl.trans(kpe))
    s = s * qk_scale
    if MASK == 1:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    if MASK == 2:
        keep = (
            n_mask[None, :]
            & (offs_n[None, :] <= q_pos[:, None])
            & (offs_n[None, :] > q_pos[:, None] - window)
        )
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with nothing visible yet keep m = -inf; shift by 0 to avoid inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_FROM_K:
        v = k  # MLA: the value is the latent the key tile already holds
    else:
        v = tl.load(
            v_ptr
            + page[:, None] * stride_vp
            + off[:, None] * stride_vo
            + kvh * stride_vh
            + dv[None, :],
            mask=n_mask[:, None] & (dv[None, :] < DV),
            other=0.0,
        )
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    qpe_ptr,
    k_ptr,
    kpe_ptr,
    v_ptr,
    o_ptr,
    qsl_ptr,
    cached_ptr,
    bt_ptr,
    stride_qt,
    stride_qh,
    stride_pt,
    stride_ph,
    stride_kp,
    stride_ko,
    stride_kh,
    stride_ep,
    stride_eo,
    stride_eh,
    stride_vp,
    stride_vo,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    qk_scale,
    group,
    window,
    DK,
    DPE,
    DV,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_PE: tl.constexpr,
    V_FROM_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Causal (optionally windowed) attention of one query block of one head over the pages.

    The grid is ``(head, query block, sequence)``: the heads of a GQA group are
    neighbours, so they find their key tiles in L2, and the last (longest)
    query blocks start first, which balances the causal triangle.
    """
    h = tl.program_id(0)
    mblk = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if mblk * BLOCK_M < q_len:
        cached = tl.load(cached_ptr + seq)
        kvh = h // group
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < q_len
        q_pos = cached + offs_m
        rows = (q_start + offs_m).to(tl.int64)
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + h * stride_qh + dk[None, :],
            mask=m_mask[:, None] & (dk[None, :] < DK),
            other=0.0,
        ).to(k_ptr.dtype.element_ty)
        if HAS_PE:
            de = tl.arange(0, BLOCK_DPE)
            qpe = tl.load(
                qpe_ptr + rows[:, None] * stride_pt + h * stride_ph + de[None, :],
                mask=m_mask[:, None] & (de[None, :] < DPE),
                other=0.0,
            ).to(kpe_ptr.dtype.element_ty)
        else:
            qpe = q

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

        first = cached + mblk * BLOCK_M  # position of the block's first query
        last = cached + tl.minimum((mblk + 1) * BLOCK_M, q_len) - 1
        hi = last + 1
        lo = (tl.maximum(first - window + 1, 0) // BLOCK_N) * BLOCK_N
        # Keys in [full_lo, full_hi) are visible to every row of the block: at or
        # before the first query and inside the last query's window.
        full_lo = tl.cdiv(tl.maximum(last - window + 1, 0), BLOCK_N) * BLOCK_N
        full_hi = ((first + 1) // BLOCK_N) * BLOCK_N
        split = tl.minimum(full_lo, hi)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        for start in range(lo, split, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, qpe, start, hi, q_pos, window, bt_row,
                k_ptr, kpe_ptr, v_ptr,
                stride_kp, stride_ko, stride_kh, stride_ep, stride_eo, stride_eh,
                stride_vp, stride_vo, stride_vh, kvh, qk_scale, DK, DPE, DV,
                PAGE_SIZE, BLOCK_N, BLOCK_DK, BLOCK_DPE, BLOCK_DV, HAS_PE, V_FROM_K, IEEE, 2,
            )  # fmt: skip
        for start in range(full_lo, full_hi, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, qpe, start, hi, q_pos, window, bt_row,
                k_ptr, kpe_ptr, v_ptr,
                stride_kp, stride_ko, stride_kh, stride_ep, stride_eo, stride_eh,
                stride_vp, stride_vo, stride_vh, kvh, qk_scale, DK, DPE, DV,
                PAGE_SIZE, BLOCK_N, BLOCK_DK, BLOCK_DPE, BLOCK_DV, HAS_PE, V_FROM_K, IEEE, 0,
            )  # fmt: skip
        for start in range(tl.maximum(full_hi, split), hi, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, qpe, start, hi, q_pos, window, bt_row,
                k_ptr, kpe_ptr, v_ptr,
                stride_kp, stride_ko, stride_kh, stride_ep, stride_eo, stride_eh,
                stride_vp, stride_vo, stride_vh, kvh, qk_scale, DK, DPE, DV,
                PAGE_SIZE, BLOCK_N, BLOCK_DK, BLOCK_DPE, BLOCK_DV, HAS_PE, V_FROM_K, IEEE, 2,
            )  # fmt: skip
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            o_ptr + rows[:, None] * stride_ot + h * stride_oh + dv[None, :],
            acc.to(o_ptr.dtype.element_ty),
            mask=m_mask[:, None] & (dv[None, :] < DV),
        )


@triton.jit
def _decode_kernel(
    q_ptr,
    qpe_ptr,
    k_ptr,
    kpe_ptr,
    v_ptr,
    po_ptr,
    plse_ptr,
    seq_lens_ptr,
    bt_ptr,
    first_seq,
    first_tok,
    stride_qt,
    stride_qh,
    stride_pt,
    stride_ph,
    stride_kp,
    stride_ko,
    stride_kh,
    stride_ep,
    stride_eo,
    stride_eh,
    stride_vp,
    stride_vo,
    stride_vh,
    stride_bt,
    qk_scale,
    num_heads,
    group,
    window,
    DK,
    DPE,
    DV,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_PE: tl.constexpr,
    V_FROM_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One split of the keys of one decode sequence, for one block of a GQA group's heads.

    Writes the split's normalised partial output and its log2-sum-exp to the
    partial buffers ``po[seq, head, split, :]`` and ``plse[seq, head, split]``
    (``-inf`` for an empty split).
    """
    j = tl.program_id(0)
    kvh = tl.program_id(1) // HEAD_BLOCKS
    hb = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)
    seq = first_seq + j
    tok = (first_tok + j).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo0 = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - lo0, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = lo0 + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    in_group = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = in_group < group
    heads = kvh * group + in_group
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + tok * stride_qt + heads[:, None] * stride_qh + dk[None, :],
        mask=h_mask[:, None] & (dk[None, :] < DK),
        other=0.0,
    ).to(k_ptr.dtype.element_ty)
    if HAS_PE:
        de = tl.arange(0, BLOCK_DPE)
        qpe = tl.load(
            qpe_ptr + tok * stride_pt + heads[:, None] * stride_ph + de[None, :],
            mask=h_mask[:, None] & (de[None, :] < DPE),
            other=0.0,
        ).to(kpe_ptr.dtype.element_ty)
    else:
        qpe = q

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    # Whole tiles need no bounds check; only the split's last, partial tile does.
    full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, qpe, start, hi, lo, window, bt_row,
            k_ptr, kpe_ptr, v_ptr,
            stride_kp, stride_ko, stride_kh, stride_ep, stride_eo, stride_eh,
            stride_vp, stride_vo, stride_vh, kvh, qk_scale, DK, DPE, DV,
            PAGE_SIZE, BLOCK_N, BLOCK_DK, BLOCK_DPE, BLOCK_DV, HAS_PE, V_FROM_K, IEEE, 0,
        )  # fmt: skip
    for start in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, qpe, start, hi, lo, window, bt_row,
            k_ptr, kpe_ptr, v_ptr,
            stride_kp, stride_ko, stride_kh, stride_ep, stride_eo, stride_eh,
            stride_vp, stride_vo, stride_vh, kvh, qk_scale, DK, DPE, DV,
            PAGE_SIZE, BLOCK_N, BLOCK_DK, BLOCK_DPE, BLOCK_DV, HAS_PE, V_FROM_K, IEEE, 1,
        )  # fmt: skip

    empty = l_i == 0.0
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    row = (j.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
    tl.store(
        po_ptr + row[:, None] * BLOCK_DV + dv[None, :],
        acc,
        mask=h_mask[:, None] & (dv[None, :] < DV),
    )
    tl.store(plse_ptr + row, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(
    po_ptr,
    plse_ptr,
    o_ptr,
    first_tok,
    stride_ot,
    stride_oh,
    num_heads,
    DV,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Merge the splits of one (decode sequence, head) by their log2-sum-exp into ``out``.

    The partial rows are added one split at a time, so registers hold one
    ``[BLOCK_DV]`` row whatever the number of splits (MLA rows are 512 wide).
    """
    j = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ss = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    row0 = (j * num_heads + h) * NUM_SPLITS
    lse = tl.load(plse_ptr + row0 + ss, mask=ss < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse - m_safe), 0)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for s in range(NUM_SPLITS):
        w = tl.exp2(tl.load(plse_ptr + row0 + s) - m_safe)
        part = tl.load(po_ptr + (row0 + s) * BLOCK_DV + dv, mask=dv < DV, other=0.0)
        acc += part * w
    o = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(
        o_ptr + (first_tok + j) * stride_ot + h * stride_oh + dv,
        o.to(o_ptr.dtype.element_ty),
        mask=dv < DV,
    )


# -- launchers (shared with MLA) ------------------------------------------------

#: Index of the first config that fitted the device, per launch key.
_CONFIG_CHOICE: dict[tuple, int] = {}


def _cfg(block_m: int | None, block_n: int, num_warps: int, num_stages: int) -> dict:
    """One launch configuration (tile sizes, warps, pipeline stages)."""
    cfg = {"BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages}
    if block_m is not None:
        cfg["BLOCK_M"] = block_m
    return cfg


def _configs_key(configs: list[dict]) -> tuple:
    """A hashable identity of a caller-given configuration list (tuning scripts only)."""
    return tuple(tuple(sorted(c.items())) for c in configs)


# The defaults below come from benchmarks/tune_triton_attention.py on an H200
# (Llama-3-8B layer, bfloat16); see docs/benchmarks/triton.md. They are built once:
# the launchers run per layer per step, and the name doubles as the launch key.
_PREFILL_CONFIGS: dict[str, list[dict]] = {
    "big": [_cfg(32, 32, 8, 2), _cfg(16, 16, 8, 1)],
    "long": [_cfg(128, 128, 8, 2), _cfg(128, 64, 8, 3), _cfg(64, 32, 4, 2)],
    "medium": [_cfg(128, 64, 8, 3), _cfg(64, 32, 4, 2)],
    "short": [_cfg(64, 32, 4, 2)],
    "tiny": [_cfg(32, 32, 4, 2)],
}
# Split sequences (few of them, long contexts) stream long key ranges per program
# and prefer wide tiles; unsplit ones (many sequences) narrow tiles.
_DECODE_CONFIGS: dict[str, list[dict]] = {
    "big": [_cfg(None, 32, 8, 2), _cfg(None, 16, 8, 1)],
    "wide_head": [_cfg(None, 32, 4, 2)],
    "split": [_cfg(None, 128, 4, 2), _cfg(None, 64, 4, 2)],
    "unsplit": [_cfg(None, 64, 4, 2)],
}


def _prefill_class(big: bool, max_q: int, dk: int) -> str:
    """The shape class that picks the default prefill configurations."""
    if big:
        return "big"
    if max_q >= 2048 and dk <= 128:
        return "long"
    if max_q > 64:
        return "medium"
    return "tiny" if max_q <= 32 else "short"


def _decode_class(big: bool, dk: int, num_splits: int) -> str:
    """The shape class that picks the default decode configurations."""
    if big:
        return "big"
    if dk > 128:
        return "wide_head"
    return "split" if num_splits > 1 else "unsplit"


def _launch_fitting(kernel, grid, key: tuple, configs: list[dict], args: tuple, meta: dict) -> None:
    """Launch with the first config (fastest first) whose shared memory / registers fit.

    A config that does not fit raises ``OutOfResources`` when it is compiled,
    before anything is enqueued; the next one is tried and the choice is
    remembered per ``key``, so the search happens once per shape class.
    """
    start = _CONFIG_CHOICE.get(key, 0)
    for i in range(start, len(configs)):
        cfg = configs[i]
        try:
            kernel[grid(cfg)](*args, **meta, **cfg)
        except OutOfResources:
            if i == len(configs) - 1:
                raise
            continue
        _CONFIG_CHOICE[key] = i
        return


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two cache views start at the same element of the same storage."""
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


def kv_append(
    src: torch.Tensor, cache_plane: torch.Tensor, slot_mapping: torch.Tensor, num_tokens: int
) -> None:
    """Write ``src[:num_tokens]`` into a cache plane at ``slot_mapping`` (``-1`` skipped).

    :param src: ``[T, H, D]`` (or ``[T, D]``), last dimension contiguous.
    :param cache_plane: a ``[num_pages, page_size, H, D]`` (or ``[num_pages,
        page_size, D]``) view of the cache, last dimension contiguous.
    :param slot_mapping: ``[>= num_tokens]`` int64 device tensor.
    :param num_tokens: how many rows to write (host value).
    """
    if num_tokens == 0:
        return
    if src.dim() == 2:
        src = src.unsqueeze(1)
    if cache_plane.dim() == 3:
        cache_plane = cache_plane.unsqueeze(2)
    if src.stride(-1) != 1:
        src = src.contiguous()
    _, page_size, H, D = cache_plane.shape
    _kv_append_kernel[(num_tokens,)](
        src,
        cache_plane,
        slot_mapping,
        src.stride(0),
        src.stride(1),
        cache_plane.stride(0),
        cache_plane.stride(1),
        cache_plane.stride(2),
        page_size,
        H,
        D,
        BLOCK_H=next_pow2(H),
        BLOCK_D=next_pow2(D),
    )


def _plane_strides(plane: torch.Tensor) -> tuple[int, int, int]:
    """(page, offset, head) strides of a ``[P, page, H, D]`` or ``[P, page, D]`` cache view."""
    if plane.dim() == 3:
        return plane.stride(0), plane.stride(1), 0
    return plane.stride(0), plane.stride(1), plane.stride(2)


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
    configs: list[dict] | None = None,
) -> None:
    """Attend the prefill/extend queries of ``batch`` over their pages, writing ``out`` rows.

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
    :param configs: launch configurations to try in order (tuning scripts);
        ``None`` = the defaults for the shape.
    """
    n = batch.num_prefill_seqs
    if n == 0:
        return
    max_q = int(batch.host.query_lens[:n].max())
    num_heads, dk = q.shape[1], q.shape[2]
    dv = out.shape[2]
    has_pe = q_pe is not None
    dpe = q_pe.shape[2] if has_pe else 0
    big = max(dk, dv) + dpe > 256
    if configs is None:
        cfg_id: Any = _prefill_class(big, max_q, dk)
        configs = _PREFILL_CONFIGS[cfg_id]
    else:
        cfg_id = _configs_key(configs)
    qpe = q_pe if has_pe else q
    kpe = kpe_plane if has_pe else k_plane
    v_from_k = _same_storage(v_plane, k_plane) and dv == dk
    args = (
        q,
        qpe,
        k_plane,
        kpe,
        v_plane,
        out,
        batch.query_start_loc,
        batch.cached_lens,
        batch.block_table,
        q.stride(0),
        q.stride(1),
        qpe.stride(0),
        qpe.stride(1),
        *_plane_strides(k_plane),
        *_plane_strides(kpe),
        *_plane_strides(v_plane),
        out.stride(0),
        out.stride(1),
        batch.block_table.stride(0),
        scale * _LOG2E,
        group,
        sliding_window if sliding_window > 0 else _NO_WINDOW,
        dk,
        dpe,
        dv,
    )
    meta = dict(
        PAGE_SIZE=batch.page_size,
        BLOCK_DK=dot_block(dk),
        BLOCK_DPE=dot_block(dpe) if has_pe else 16,
        BLOCK_DV=dot_block(dv),
        HAS_PE=has_pe,
        V_FROM_K=v_from_k,
        IEEE=ieee_dot(k_plane.dtype),
    )
    key = ("prefill", dk, dpe, dv, k_plane.dtype, q.dtype, cfg_id)
    _launch_fitting(
        _prefill_kernel,
        lambda c: (num_heads, triton.cdiv(max_q, c["BLOCK_M"]), n),
        key,
        configs,
        args,
        meta,
    )


def choose_num_splits(batch: BatchMetadata, programs_per_split: int, device: torch.device) -> int:
    """Pick how many key splits each decode sequence gets.

    Enough splits to fill the device (about two programs per SM), but no more
    than one split per 128 keys of the longest context (host value), and at
    most :data:`MAX_KV_SPLITS`. The kernel derives each split's range from the
    sequence length on the device, so any value is correct for any lengths
    (a decode graph captured with one value replays correctly for others).
    """
    n = batch.num_decode_seqs
    if n == 0:
        return 1
    want = triton.cdiv(device_parallelism(device), max(n * programs_per_split, 1))
    by_len = triton.cdiv(max(batch.max_seq_len, 1), 128)
    return int(max(1, min(want, by_len, MAX_KV_SPLITS)))


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
    num_splits: int | None = None,
    configs: list[dict] | None = None,
) -> None:
    """Split-KV decode for the decode sequences of ``batch``, writing their ``out`` rows.

    Arguments as for :func:`paged_prefill`; ``num_splits`` overrides
    :func:`choose_num_splits` (tests use it to force several splits).
    """
    nd = batch.num_decode_seqs
    if nd == 0:
        return
    num_heads, dk = q.shape[1], q.shape[2]
    dv = out.shape[2]
    num_kv_heads = num_heads // group
    has_pe = q_pe is not None
    dpe = q_pe.shape[2] if has_pe else 0
    big = max(dk, dv) + dpe > 256
    block_h = min(dot_block(group), 16 if big else 64)
    head_blocks = triton.cdiv(group, block_h)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads * head_blocks, q.device)
    if configs is None:
        cfg_id: Any = _decode_class(big, dk, num_splits)
        configs = _DECODE_CONFIGS[cfg_id]
    else:
        cfg_id = _configs_key(configs)
    block_dv = dot_block(dv)
    partial = torch.empty(
        (nd, num_heads, num_splits, block_dv), dtype=torch.float32, device=q.device
    )
    lse = torch.empty((nd, num_heads, num_splits), dtype=torch.float32, device=q.device)
    qpe = q_pe if has_pe else q
    kpe = kpe_plane if has_pe else k_plane
    first_seq = batch.num_prefill_seqs
    first_tok = batch.num_prefill_tokens
    v_from_k = _same_storage(v_plane, k_plane) and dv == dk
    args = (
        q,
        qpe,
        k_plane,
        kpe,
        v_plane,
        partial,
        lse,
        batch.seq_lens,
        batch.block_table,
        first_seq,
        first_tok,
        q.stride(0),
        q.stride(1),
        qpe.stride(0),
        qpe.stride(1),
        *_plane_strides(k_plane),
        *_plane_strides(kpe),
        *_plane_strides(v_plane),
        batch.block_table.stride(0),
        scale * _LOG2E,
        num_heads,
        group,
        sliding_window if sliding_window > 0 else _NO_WINDOW,
        dk,
        dpe,
        dv,
    )
    meta = dict(
        PAGE_SIZE=batch.page_size,
        NUM_SPLITS=num_splits,
        HEAD_BLOCKS=head_blocks,
        BLOCK_H=block_h,
        BLOCK_DK=dot_block(dk),
        BLOCK_DPE=dot_block(dpe) if has_pe else 16,
        BLOCK_DV=block_dv,
        HAS_PE=has_pe,
        V_FROM_K=v_from_k,
        IEEE=ieee_dot(k_plane.dtype),
    )
    key = ("decode", dk, dpe, dv, k_plane.dtype, q.dtype, block_h, cfg_id)
    _launch_fitting(
        _decode_kernel,
        lambda c: (nd, num_kv_heads * head_blocks, num_splits),
        key,
        configs,
        args,
        meta,
    )
    _decode_reduce_kernel[(nd, num_heads)](
        partial,
        lse,
        out,
        first_tok,
        out.stride(0),
        out.stride(1),
        num_heads,
        dv,
        NUM_SPLITS=num_splits,
        BLOCK_S=next_pow2(num_splits),
        BLOCK_DV=block_dv,
    )


# -- the cached op ----------------------------------------------------------------


#: Forces the number of decode splits when set (tests); ``0`` = choose automatically.
_FORCED_SPLITS = {"value": 0}


def _attention_shape(q, k, v, kv_cache, sliding_window, scale, out=None):
    return tuple(q.shape), q.dtype


@cached_op(
    "backplane_triton::attention",
    mutates_args=("kv_cache", "out"),
    output_shape=_attention_shape,
)
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    sliding_window: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Append ``k``/``v`` to the paged cache and attend (see the module docstring).

    :param q: ``[T, Hq, D]``.
    :param k: ``[T, Hkv, D]``.
    :param v: ``[T, Hkv, D]``.
    :param kv_cache: ``[P, 2, page, Hkv, D]``, written at ``slot_mapping``.
    :param sliding_window: ``0`` = full causal attention.
    :param scale: softmax scale.
    :param out: optional ``[T, Hq, D]`` buffer.
    :return: the output or the empty sentinel.
    """
    batch = get_forward_context().batch
    buf = output_buffer(out, q.shape, q.dtype, q.device)
    num_tokens = batch.num_tokens
    if q.stride(-1) != 1:
        q = q.contiguous()
    kv_append(k, kv_cache[:, 0], batch.slot_mapping, num_tokens)
    kv_append(v, kv_cache[:, 1], batch.slot_mapping, num_tokens)
    group = q.shape[1] // k.shape[1]
    paged_prefill(
        batch,
        q,
        kv_cache[:, 0],
        kv_cache[:, 1],
        buf,
        scale=scale,
        group=group,
        sliding_window=sliding_window,
    )
    paged_decode(
        batch,
        q,
        kv_cache[:, 0],
        kv_cache[:, 1],
        buf,
        scale=scale,
        group=group,
        sliding_window=sliding_window,
        num_splits=_FORCED_SPLITS["value"] or None,
    )
    return finish_output(out, buf, num_tokens)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with the Triton kernels of this module (GQA, sliding window)."""

    name = "triton"

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
        return torch.ops.backplane_triton.attention(
            q, k, v, kv_cache, int(layer.sliding_window), float(layer.softmax_scale), out
        )

    def dynamic_ops(self) -> tuple:
        """The attention op runs eagerly between captured graph segments."""
        return (torch.ops.backplane_triton.attention.default,)
