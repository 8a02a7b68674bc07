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

The kernels are written generally enough to serve MLA too (see
:mod:`backplane.backends.triton.mla`): the key may come in two parts (a main
part and a rotary part, each with its own query part) and the value may be a
view of the key's storage.

Grid sizes come from the host side of the batch (``batch.host`` and the counts);
offsets and page tables are read on the device, so nothing synchronises.
"""

from __future__ import annotations

import functools
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
    interpreting,
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
    k_src_ptr,
    v_src_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cp,
    stride_co,
    stride_ch,
    PAGE_SIZE: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_V: tl.constexpr,
):
    """Copy token ``pid``'s ``[H, D]`` key row (and value row) into cache slot ``slot_mapping[pid]``.

    Keys and values go in one launch: on small batches a launch costs more
    host time than the copy.
    """
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    hs = tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    # The scalar is broadcast to a block first: the interpreter rejects scalar-by-block masks.
    valid = (hs[:, None] * 0 + slot) >= 0
    mask = (hs[:, None] < H) & (ds[None, :] < D) & valid
    slot = tl.maximum(slot, 0)
    dst = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_co
    dst += hs[:, None] * stride_ch + ds[None, :]
    x = tl.load(k_src_ptr + t * stride_kt + hs[:, None] * stride_kh + ds[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, x.to(k_cache_ptr.dtype.element_ty), mask=mask)
    if HAS_V:
        y = tl.load(v_src_ptr + t * stride_vt + hs[:, None] * stride_vh + ds[None, :], mask=mask)
        tl.store(v_cache_ptr + dst, y.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fold_tile(acc, m_i, l_i, s, keep, v, qk_scale, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """Fold one tile of raw scores ``s`` ``[M, N]`` and values ``v`` ``[N, DV]`` into the softmax state.

    ``MASKED`` tiles hide the scores where ``keep`` is false; rows with
    nothing visible yet keep ``m = -inf`` and are shifted by 0 (no ``inf -
    inf``). Unmasked tiles have a finite maximum in every row, so they fold
    the scale into one multiply-add and skip the guards.

    :return: the updated ``(acc, m_i, l_i)``.
    """
    if MASKED:
        s = tl.where(keep, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _dot_t(a, b, IEEE: tl.constexpr):
    """``a @ b^T`` with exact float32 products when ``IEEE``."""
    if IEEE:
        return tl.dot(a, tl.trans(b), input_precision="ieee")
    return tl.dot(a, tl.trans(b))


@triton.jit
def _paged_tile(
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
    DK: tl.constexpr,
    DPE: tl.constexpr,
    DV: tl.constexpr,
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
    """Fold the ``BLOCK_N`` keys from position ``start``, read through the page table, into the state.

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
    s = _dot_t(q, k, IEEE)
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
        s += _dot_t(qpe, kpe, IEEE)
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
    if MASK == 2:
        keep = (
            n_mask[None, :]
            & (offs_n[None, :] <= q_pos[:, None])
            & (offs_n[None, :] > q_pos[:, None] - window)
        )
    else:
        keep = n_mask[None, :]
    return _fold_tile(acc, m_i, l_i, s, keep, v, qk_scale, MASK != 0, IEEE)


@triton.jit
def _chunk_tile(
    acc,
    m_i,
    l_i,
    q,
    start,
    offs_m,
    q_len,
    window,
    row0,
    kn_ptr,
    vn_ptr,
    k_desc,
    v_desc,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    kvh,
    qk_scale,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    IEEE: tl.constexpr,
    USE_TMA: tl.constexpr,
    MASK: tl.constexpr,
):
    """Fold ``BLOCK_N`` keys of the sequence's own chunk, read from this step's contiguous k/v rows.

    Positions are relative to the chunk (query ``i`` sees chunk keys
    ``i - window < j <= i``). ``MASK`` ``0`` tiles lie below every row's
    diagonal and inside every window: they load without bounds (through the
    tensor-memory accelerator when ``USE_TMA``); ``MASK`` ``2`` tiles apply
    the causal and window limits per row.

    :return: the updated ``(acc, m_i, l_i)``.
    """
    offs_n = start + tl.arange(0, BLOCK_N)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    rows = (row0 + offs_n).to(tl.int64)
    if MASK == 0:
        if USE_TMA:
            k = k_desc.load([row0 + start, kvh * DK])
            v = v_desc.load([row0 + start, kvh * DV])
        else:
            k = tl.load(
                kn_ptr + rows[:, None] * stride_knt + kvh * stride_knh + dk[None, :],
                mask=dk[None, :] < DK,
                other=0.0,
            )
            v = tl.load(
                vn_ptr + rows[:, None] * stride_vnt + kvh * stride_vnh + dv[None, :],
                mask=dv[None, :] < DV,
                other=0.0,
            )
        keep = offs_n[None, :] >= 0
    else:
        # Rows past the chunk (the next sequence's, or padding) are never read.
        n_mask = offs_n < q_len
        k = tl.load(
            kn_ptr + rows[:, None] * stride_knt + kvh * stride_knh + dk[None, :],
            mask=n_mask[:, None] & (dk[None, :] < DK),
            other=0.0,
        )
        v = tl.load(
            vn_ptr + rows[:, None] * stride_vnt + kvh * stride_vnh + dv[None, :],
            mask=n_mask[:, None] & (dv[None, :] < DV),
            other=0.0,
        )
        keep = (
            n_mask[None, :]
            & (offs_n[None, :] <= offs_m[:, None])
            & (offs_n[None, :] > offs_m[:, None] - window)
        )
    s = _dot_t(q, k, IEEE)
    return _fold_tile(acc, m_i, l_i, s, keep, v, qk_scale, MASK != 0, IEEE)


@triton.jit
def _prefill_kernel(
    q_ptr,
    qpe_ptr,
    k_ptr,
    kpe_ptr,
    v_ptr,
    kn_ptr,
    vn_ptr,
    o_ptr,
    qsl_ptr,
    cached_ptr,
    bt_ptr,
    slot_ptr,
    num_rows,
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
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_ot,
    stride_oh,
    stride_bt,
    qk_scale,
    group,
    window,
    num_kv_heads,
    DK: tl.constexpr,
    DPE: tl.constexpr,
    DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_PE: tl.constexpr,
    V_FROM_K: tl.constexpr,
    IEEE: tl.constexpr,
    CHUNK_FROM_INPUT: tl.constexpr,
    USE_TMA: tl.constexpr,
    PAGED_KEYS: tl.constexpr,
    WINDOWED: tl.constexpr,
    APPEND: tl.constexpr,
):
    """Causal (optionally windowed) attention of one query block of one head.

    The cached prefix is read through the page table. With
    ``CHUNK_FROM_INPUT`` the sequence's own chunk is read from this step's
    contiguous ``kn``/``vn`` rows (the same values the append wrote to the
    pages), which spares the page gather where most prefill work lies;
    otherwise every key comes from the pages. ``PAGED_KEYS`` (false when no
    sequence has a cached prefix and the chunk comes from the input) and
    ``WINDOWED`` leave out the loops a batch cannot need. With ``APPEND``
    (which needs ``CHUNK_FROM_INPUT``) the programs of each GQA group's first
    head also write their query block's key/value rows to the pages at
    ``slot_mapping``: no append launch, and nothing in this launch reads
    those slots (prefixes lie before every chunk).

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

        if APPEND:
            if h % group == 0:
                slots = tl.load(slot_ptr + rows, mask=m_mask, other=-1)
                w_mask = m_mask & (slots >= 0)
                slots = tl.maximum(slots, 0).to(tl.int64)
                dst = (slots // PAGE_SIZE)[:, None] * stride_kp + (slots % PAGE_SIZE)[
                    :, None
                ] * stride_ko
                kr = tl.load(
                    kn_ptr + rows[:, None] * stride_knt + kvh * stride_knh + dk[None, :],
                    mask=w_mask[:, None] & (dk[None, :] < DK),
                )
                tl.store(
                    k_ptr + dst + kvh * stride_kh + dk[None, :],
                    kr.to(k_ptr.dtype.element_ty),
                    mask=w_mask[:, None] & (dk[None, :] < DK),
                )
                dst = (slots // PAGE_SIZE)[:, None] * stride_vp + (slots % PAGE_SIZE)[
                    :, None
                ] * stride_vo
                vr = tl.load(
                    vn_ptr + rows[:, None] * stride_vnt + kvh * stride_vnh + dv[None, :],
                    mask=w_mask[:, None] & (dv[None, :] < DV),
                )
                tl.store(
                    v_ptr + dst + kvh * stride_vh + dv[None, :],
                    vr.to(v_ptr.dtype.element_ty),
                    mask=w_mask[:, None] & (dv[None, :] < DV),
                )

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

        if PAGED_KEYS:
            # Paged keys, absolute positions: the prefix only, or everything.
            first = cached + mblk * BLOCK_M  # position of the block's first query
            last = cached + tl.minimum((mblk + 1) * BLOCK_M, q_len) - 1
            if CHUNK_FROM_INPUT:
                hi = cached
            else:
                hi = last + 1
            # Keys in [full_lo, full_hi) are visible to every row of the block: at or
            # before the first query, inside the last query's window, below hi.
            if WINDOWED:
                lo = (tl.maximum(first - window + 1, 0) // BLOCK_N) * BLOCK_N
                full_lo = tl.cdiv(tl.maximum(last - window + 1, 0), BLOCK_N) * BLOCK_N
            else:
                lo = 0
                full_lo = 0
            full_hi = tl.minimum((first + 1) // BLOCK_N, hi // BLOCK_N) * BLOCK_N
            split = tl.minimum(full_lo, hi)
            bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
            if WINDOWED:
                for start in range(lo, split, BLOCK_N):
                    acc, m_i, l_i = _paged_tile(
                        acc, m_i, l_i, q, qpe, start, hi, q_pos, window, bt_row,
                        k_ptr, kpe_ptr, v_ptr,
                        stride_kp, stride_ko, stride_kh, stride_ep, stride_eo, stride_eh,
                        stride_vp, stride_vo, stride_vh, kvh, qk_scale, DK, DPE, DV,
                        PAGE_SIZE, BLOCK_N, BLOCK_DK, BLOCK_DPE, BLOCK_DV, HAS_PE, V_FROM_K, IEEE, 2,
                    )  # fmt: skip
            for start in range(full_lo, full_hi, BLOCK_N):
                acc, m_i, l_i = _paged_tile(
                    acc, m_i, l_i, q, qpe, start, hi, q_pos, window, bt_row,
                    k_ptr, kpe_ptr, v_ptr,
                    stride_kp, stride_ko, stride_kh, stride_ep, stride_eo, stride_eh,
                    stride_vp, stride_vo, stride_vh, kvh, qk_scale, DK, DPE, DV,
                    PAGE_SIZE, BLOCK_N, BLOCK_DK, BLOCK_DPE, BLOCK_DV, HAS_PE, V_FROM_K, IEEE, 0,
                )  # fmt: skip
            for start in range(tl.maximum(full_hi, split), hi, BLOCK_N):
                acc, m_i, l_i = _paged_tile(
                    acc, m_i, l_i, q, qpe, start, hi, q_pos, window, bt_row,
                    k_ptr, kpe_ptr, v_ptr,
                    stride_kp, stride_ko, stride_kh, stride_ep, stride_eo, stride_eh,
                    stride_vp, stride_vo, stride_vh, kvh, qk_scale, DK, DPE, DV,
                    PAGE_SIZE, BLOCK_N, BLOCK_DK, BLOCK_DPE, BLOCK_DV, HAS_PE, V_FROM_K, IEEE, 2,
                )  # fmt: skip

        if CHUNK_FROM_INPUT:
            # The chunk's own keys, positions relative to the chunk.
            if USE_TMA:
                k_desc = tl.make_tensor_descriptor(
                    kn_ptr,
                    shape=[num_rows, num_kv_heads * DK],
                    strides=[stride_knt, 1],
                    block_shape=[BLOCK_N, DK],
                )
                v_desc = tl.make_tensor_descriptor(
                    vn_ptr,
                    shape=[num_rows, num_kv_heads * DV],
                    strides=[stride_vnt, 1],
                    block_shape=[BLOCK_N, DV],
                )
            else:
                k_desc = kn_ptr
                v_desc = vn_ptr
            first_c = mblk * BLOCK_M
            last_c = tl.minimum(first_c + BLOCK_M, q_len) - 1
            if WINDOWED:
                lo_c = (tl.maximum(first_c - window + 1, 0) // BLOCK_N) * BLOCK_N
                full_lo_c = tl.cdiv(tl.maximum(last_c - window + 1, 0), BLOCK_N) * BLOCK_N
            else:
                lo_c = 0
                full_lo_c = 0
            full_hi_c = ((first_c + 1) // BLOCK_N) * BLOCK_N
            split_c = tl.minimum(full_lo_c, last_c + 1)
            if WINDOWED:
                for start in range(lo_c, split_c, BLOCK_N):
                    acc, m_i, l_i = _chunk_tile(
                        acc, m_i, l_i, q, start, offs_m, q_len, window, q_start,
                        kn_ptr, vn_ptr, k_desc, v_desc, stride_knt, stride_knh, stride_vnt, stride_vnh,
                        kvh, qk_scale, DK, DV, BLOCK_N, BLOCK_DK, BLOCK_DV, IEEE, USE_TMA, 2,
                    )  # fmt: skip
            for start in range(full_lo_c, full_hi_c, BLOCK_N):
                acc, m_i, l_i = _chunk_tile(
                    acc, m_i, l_i, q, start, offs_m, q_len, window, q_start,
                    kn_ptr, vn_ptr, k_desc, v_desc, stride_knt, stride_knh, stride_vnt, stride_vnh,
                    kvh, qk_scale, DK, DV, BLOCK_N, BLOCK_DK, BLOCK_DV, IEEE, USE_TMA, 0,
                )  # fmt: skip
            for start in range(tl.maximum(full_hi_c, split_c), last_c + 1, BLOCK_N):
                acc, m_i, l_i = _chunk_tile(
                    acc, m_i, l_i, q, start, offs_m, q_len, window, q_start,
                    kn_ptr, vn_ptr, k_desc, v_desc, stride_knt, stride_knh, stride_vnt, stride_vnh,
                    kvh, qk_scale, DK, DV, BLOCK_N, BLOCK_DK, BLOCK_DV, IEEE, USE_TMA, 2,
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
    o_ptr,
    po_ptr,
    plse_ptr,
    arrivals_ptr,
    kn_ptr,
    vn_ptr,
    slot_ptr,
    seq_lens_ptr,
    bt_ptr,
    first_seq,
    first_tok,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
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
    num_heads,
    group,
    window,
    DK: tl.constexpr,
    DPE: tl.constexpr,
    DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_PE: tl.constexpr,
    V_FROM_K: tl.constexpr,
    IEEE: tl.constexpr,
    APPEND: tl.constexpr,
):
    """One split of the keys of one decode sequence, for one block of a GQA group's heads.

    With ``APPEND`` the program whose split holds the sequence's last position
    first writes this step's key/value row (``kn``/``vn`` at the token's slot)
    to the pages, then reads it back with the rest: the decode tokens need no
    append launch of their own.

    With one split the program writes its rows of ``out``. With several it
    writes its normalised partial output and log2-sum-exp to
    ``po[seq, head, split, :]`` and ``plse[seq, head, split]`` (``-inf`` for
    an empty split) and counts itself in at ``arrivals[seq, head block]``;
    the program that arrives last merges the splits into ``out`` and resets
    the counter to zero for the next launch. Merging in the same launch saves
    a kernel launch per layer, which is most of an eager decode's cost at
    small batches.
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

    if APPEND:
        slot = tl.load(slot_ptr + tok)
        if (slot >= 0) & (seq_len - 1 >= lo) & (seq_len - 1 < hi):
            slot = slot.to(tl.int64)
            page = slot // PAGE_SIZE
            off = slot % PAGE_SIZE
            kr = tl.load(kn_ptr + tok * stride_knt + kvh * stride_knh + dk, mask=dk < DK)
            tl.store(
                k_ptr + page * stride_kp + off * stride_ko + kvh * stride_kh + dk,
                kr.to(k_ptr.dtype.element_ty),
                mask=dk < DK,
            )
            vr = tl.load(vn_ptr + tok * stride_vnt + kvh * stride_vnh + dv, mask=dv < DV)
            tl.store(
                v_ptr + page * stride_vp + off * stride_vo + kvh * stride_vh + dv,
                vr.to(v_ptr.dtype.element_ty),
                mask=dv < DV,
            )
            # The row is read back by other threads of this program below.
            tl.debug_barrier()

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    # Whole tiles need no bounds check; only the split's last, partial tile does.
    full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _paged_tile(
            acc, m_i, l_i, q, qpe, start, hi, lo, window, bt_row,
            k_ptr, kpe_ptr, v_ptr,
            stride_kp, stride_ko, stride_kh, stride_ep, stride_eo, stride_eh,
            stride_vp, stride_vo, stride_vh, kvh, qk_scale, DK, DPE, DV,
            PAGE_SIZE, BLOCK_N, BLOCK_DK, BLOCK_DPE, BLOCK_DV, HAS_PE, V_FROM_K, IEEE, 0,
        )  # fmt: skip
    for start in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = _paged_tile(
            acc, m_i, l_i, q, qpe, start, hi, lo, window, bt_row,
            k_ptr, kpe_ptr, v_ptr,
            stride_kp, stride_ko, stride_kh, stride_ep, stride_eo, stride_eh,
            stride_vp, stride_vo, stride_vh, kvh, qk_scale, DK, DPE, DV,
            PAGE_SIZE, BLOCK_N, BLOCK_DK, BLOCK_DPE, BLOCK_DV, HAS_PE, V_FROM_K, IEEE, 1,
        )  # fmt: skip

    empty = l_i == 0.0
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    out_rows = o_ptr + tok * stride_ot + heads[:, None] * stride_oh + dv[None, :]
    out_mask = h_mask[:, None] & (dv[None, :] < DV)
    if NUM_SPLITS == 1:
        tl.store(out_rows, acc.to(o_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        row0 = (j.to(tl.int64) * num_heads + heads) * NUM_SPLITS
        tl.store(po_ptr + (row0 + split)[:, None] * BLOCK_DV + dv[None, :], acc, mask=out_mask)
        tl.store(plse_ptr + row0 + split, lse, mask=h_mask)
        # Every thread's partial stores come before the (releasing) arrival.
        tl.debug_barrier()
        counter = arrivals_ptr + j * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
            ss = tl.arange(0, BLOCK_S)
            # Loads bypass L1 (".cg"): the other splits were written by other SMs.
            lses = tl.load(
                plse_ptr + row0[:, None] + ss[None, :],
                mask=h_mask[:, None] & (ss[None, :] < NUM_SPLITS),
                other=float("-inf"),
                cache_modifier=".cg",
            )
            m = tl.max(lses, 1)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            total = tl.sum(tl.exp2(lses - m_safe[:, None]), 1)
            merged = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
            # One split at a time keeps registers at one [BLOCK_H, BLOCK_DV] tile
            # whatever the number of splits (MLA rows are 512 wide).
            for s in range(NUM_SPLITS):
                w = tl.exp2(
                    tl.load(plse_ptr + row0 + s, mask=h_mask, other=0.0, cache_modifier=".cg")
                    - m_safe
                )
                part = tl.load(
                    po_ptr + (row0 + s)[:, None] * BLOCK_DV + dv[None, :],
                    mask=out_mask,
                    other=0.0,
                    cache_modifier=".cg",
                )
                merged += part * w[:, None]
            merged = merged / tl.where(total == 0.0, 1.0, total)[:, None]
            tl.store(out_rows, merged.to(o_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter, 0)


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
    "long": [_cfg(128, 128, 8, 3), _cfg(128, 128, 8, 2), _cfg(128, 64, 8, 3), _cfg(64, 32, 4, 2)],
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


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """A ``[T, H, D]`` view (``[T, D]`` gains a head axis) with a contiguous last dimension."""
    if x.dim() == 2:
        x = x.unsqueeze(1)
    return x if x.stride(-1) == 1 else x.contiguous()


def kv_append(
    src: torch.Tensor,
    cache_plane: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    v_src: torch.Tensor | None = None,
    v_plane: torch.Tensor | None = None,
) -> None:
    """Write ``src[:num_tokens]`` into a cache plane at ``slot_mapping`` (``-1`` skipped).

    :param src: ``[T, H, D]`` (or ``[T, D]``), last dimension contiguous.
    :param cache_plane: a ``[num_pages, page_size, H, D]`` (or ``[num_pages,
        page_size, D]``) view of the cache, last dimension contiguous.
    :param slot_mapping: ``[>= num_tokens]`` int64 device tensor.
    :param num_tokens: how many rows to write (host value).
    :param v_src: optional values, shaped like ``src``, written in the same launch...
    :param v_plane: ...into this plane, strided like ``cache_plane``.
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
            kv_append(src, cache_plane, slot_mapping, num_tokens)
            kv_append(v_src, v_plane, slot_mapping, num_tokens)
            return
    else:
        v_src, v_plane = src, cache_plane
    _, page_size, H, D = cache_plane.shape
    _kv_append_kernel[(num_tokens,)](
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
        PAGE_SIZE=page_size,
        H=H,
        D=D,
        BLOCK_H=next_pow2(H),
        BLOCK_D=next_pow2(D),
        HAS_V=has_v,
    )


def _plane_strides(plane: torch.Tensor) -> tuple[int, int, int]:
    """(page, offset, head) strides of a ``[P, page, H, D]`` or ``[P, page, D]`` cache view."""
    if plane.dim() == 3:
        return plane.stride(0), plane.stride(1), 0
    return plane.stride(0), plane.stride(1), plane.stride(2)


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


def _tma_rows_ok(x: torch.Tensor, width: int) -> bool:
    """Whether ``x`` ``[T, H, D]`` can be a ``[T, H * D]`` tensor descriptor of ``width``-wide blocks."""
    size = x.element_size()
    return (
        x.stride(2) == 1
        and x.stride(1) == x.shape[2] == width
        and (x.data_ptr() % 16) == 0
        and (x.stride(0) * size) % 16 == 0
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
    configs: list[dict] | None = None,
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
    appending = k_new is not None and v_new is not None
    if appending:
        k_new, v_new = _as_rows(k_new), _as_rows(v_new)
    from_input = (
        appending and not has_pe and k_new.dtype == k_plane.dtype and v_new.dtype == v_plane.dtype
    )
    if from_input:
        block_dk, block_dv = dot_block(dk), dot_block(dv)
        # In-kernel descriptors cost a scratch allocation per launch: worth it
        # for long prompts only (at 4k tokens loads are as fast without).
        use_tma = (
            max_q >= 4096
            and q.is_cuda
            and block_dk == dk
            and block_dv == dv
            and _tma_rows_ok(k_new, dk)
            and _tma_rows_ok(v_new, dv)
            and _tma_supported(q.device.index if q.device.index is not None else 0)
        )
        kn, vn = k_new, v_new
    else:
        if appending:
            kv_append(k_new, k_plane, batch.slot_mapping, batch.num_prefill_tokens, v_new, v_plane)
        use_tma = False
        kn, vn = k_plane, v_plane  # unused: any tensors serve as placeholders
    paged_keys = not from_input or bool(batch.host.cached_lens[:n].any())
    args = (
        q,
        qpe,
        k_plane,
        kpe,
        v_plane,
        kn,
        vn,
        out,
        batch.query_start_loc,
        batch.cached_lens,
        batch.block_table,
        batch.slot_mapping,
        kn.shape[0],
        q.stride(0),
        q.stride(1),
        qpe.stride(0),
        qpe.stride(1),
        *_plane_strides(k_plane),
        *_plane_strides(kpe),
        *_plane_strides(v_plane),
        kn.stride(0),
        kn.stride(1) if from_input else 0,
        vn.stride(0),
        vn.stride(1) if from_input else 0,
        out.stride(0),
        out.stride(1),
        batch.block_table.stride(0),
        scale * _LOG2E,
        group,
        sliding_window if sliding_window > 0 else _NO_WINDOW,
        num_heads // group,
    )
    meta = dict(
        DK=dk,
        DPE=dpe,
        DV=dv,
        PAGE_SIZE=batch.page_size,
        BLOCK_DK=dot_block(dk),
        BLOCK_DPE=dot_block(dpe) if has_pe else 16,
        BLOCK_DV=dot_block(dv),
        HAS_PE=has_pe,
        V_FROM_K=v_from_k,
        IEEE=ieee_dot(k_plane.dtype),
        CHUNK_FROM_INPUT=from_input,
        USE_TMA=use_tma,
        PAGED_KEYS=paged_keys,
        WINDOWED=sliding_window > 0,
        APPEND=from_input,
    )
    key = (
        "prefill",
        dk,
        dpe,
        dv,
        k_plane.dtype,
        q.dtype,
        from_input,
        use_tma,
        paged_keys,
        sliding_window > 0,
        cfg_id,
    )
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
    num_splits: int | None = None,
    configs: list[dict] | None = None,
) -> None:
    """Split-KV decode for the decode sequences of ``batch``, writing their ``out`` rows.

    One launch: the last split of each (sequence, head block) to finish merges
    the splits (see ``_decode_kernel``). Arguments as for
    :func:`paged_prefill`, except that ``k_new``/``v_new`` (this step's
    ``[T, Hkv, D]`` rows), when given, are appended to the pages by the kernel
    for the decode tokens, which must then not be appended before;
    ``num_splits`` overrides :func:`choose_num_splits` (tests use it to force
    several splits).
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
    if num_splits > 1:
        rows = nd * num_heads * num_splits
        # One allocation: the partial outputs, then their log2-sum-exps.
        scratch = torch.empty(rows * (block_dv + 1), dtype=torch.float32, device=q.device)
        partial, lse = scratch[: rows * block_dv], scratch[rows * block_dv :]
        arrivals = _arrivals(q.device, nd * num_kv_heads * head_blocks)
    else:
        partial = lse = arrivals = out  # unused placeholders
    qpe = q_pe if has_pe else q
    kpe = kpe_plane if has_pe else k_plane
    v_from_k = _same_storage(v_plane, k_plane) and dv == dk
    append = k_new is not None and v_new is not None
    if append:
        kn, vn = _as_rows(k_new), _as_rows(v_new)
    else:
        kn, vn = q, q  # unused placeholders
    args = (
        q,
        qpe,
        k_plane,
        kpe,
        v_plane,
        out,
        partial,
        lse,
        arrivals,
        kn,
        vn,
        batch.slot_mapping,
        batch.seq_lens,
        batch.block_table,
        batch.num_prefill_seqs,
        batch.num_prefill_tokens,
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
        batch.block_table.stride(0),
        scale * _LOG2E,
        num_heads,
        group,
        sliding_window if sliding_window > 0 else _NO_WINDOW,
    )
    meta = dict(
        DK=dk,
        DPE=dpe,
        DV=dv,
        PAGE_SIZE=batch.page_size,
        NUM_SPLITS=num_splits,
        HEAD_BLOCKS=head_blocks,
        BLOCK_H=block_h,
        BLOCK_S=next_pow2(num_splits),
        BLOCK_DK=dot_block(dk),
        BLOCK_DPE=dot_block(dpe) if has_pe else 16,
        BLOCK_DV=block_dv,
        HAS_PE=has_pe,
        V_FROM_K=v_from_k,
        IEEE=ieee_dot(k_plane.dtype),
        APPEND=append,
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
    k_plane, v_plane = kv_cache.unbind(1)
    # Both kernels append their own tokens' keys and values (no append launch).
    group = q.shape[1] // k.shape[1]
    paged_prefill(
        batch,
        q,
        k_plane,
        v_plane,
        buf,
        scale=scale,
        group=group,
        sliding_window=sliding_window,
        k_new=k,
        v_new=v,
    )
    paged_decode(
        batch,
        q,
        k_plane,
        v_plane,
        buf,
        scale=scale,
        group=group,
        sliding_window=sliding_window,
        k_new=k,
        v_new=v,
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
