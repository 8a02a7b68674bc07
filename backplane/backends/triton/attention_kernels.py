"""The Triton kernels of paged attention: the KV append, ragged prefill/extend and split-KV decode.

* ``_kv_append_kernel`` writes rows into a paged cache at ``slot_mapping``
  (``-1`` = padding, skipped); it serves MLA's latent cache and layouts the
  prefill kernel cannot read from the step's rows;
* ``_prefill_kernel`` attends every prefill/extend query to its sequence's
  keys (causal, optional sliding window), the cached prefix from the pages and
  the sequence's own chunk from this step's rows, appending those rows;
* ``_decode_kernel`` attends the one query of each decode sequence, split along
  the keys, the last split to finish merging the splits by their log-sum-exp.

The key may come in two parts (a main part and a rotary part, each with its
own query part) and the value may be a view of the key's storage, so MLA (see
:mod:`backplane.backends.triton.mla`) runs on the same kernels. The host side
is in :mod:`backplane.backends.triton.attention_launch`.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: the largest finite float8_e4m3fn value (it has no infinity)
_FP8_MAX = tl.constexpr(448.0)
#: the most ``splits x value width`` elements the decode merge reads unrolled (one
#: ``[heads, value]`` tile per split, all loads issued at once): Llama-shaped heads up to
#: 16 splits of 128; MLA's 512-wide latents keep the loop
MERGE_UNROLLED = tl.constexpr(2048)


@triton.jit
def _to_fp8(x, scale, dtype: tl.constexpr):
    """``x / scale`` rounded to the nearest ``dtype`` (e4m3) value, saturated at +-448.

    Divided exactly (not by a reciprocal) and rounded once to nearest-even, so
    the rows match what the torch backend stores for the same scale.
    """
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX)
    return y.to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def _to_cache(x, scale, dtype: tl.constexpr, KV_FP8: tl.constexpr):
    """Rows ``x`` as a cache of ``dtype`` holds them: ``x / scale`` in e4m3 when ``KV_FP8``."""
    if KV_FP8:
        return _to_fp8(x, scale, dtype)
    return x.to(dtype)


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
    k_scale,
    v_scale,
    PAGE_SIZE: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_V: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Copy token ``pid``'s ``[H, D]`` key row (and value row) into cache slot ``slot_mapping[pid]``.

    Keys and values go in one launch: on small batches a launch costs more
    host time than the copy. A ``KV_FP8`` cache gets ``key / k_scale`` and
    ``value / v_scale`` in e4m3.
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
    tl.store(
        k_cache_ptr + dst, _to_cache(x, k_scale, k_cache_ptr.dtype.element_ty, KV_FP8), mask=mask
    )
    if HAS_V:
        y = tl.load(v_src_ptr + t * stride_vt + hs[:, None] * stride_vh + ds[None, :], mask=mask)
        tl.store(
            v_cache_ptr + dst,
            _to_cache(y, v_scale, v_cache_ptr.dtype.element_ty, KV_FP8),
            mask=mask,
        )


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
def _e4m3_words_to_f16(w):
    """e4m3 values packed four to an int32 word (``[N, W]``, the first in the low byte)
    widened to float16: ``[N, 4 * W]``, in the packed order.

    Two ``cvt`` of byte pairs a word, in registers. Widened here, before the
    tile is laid out for the product, a value tile reaches the product the way
    a float16 one does (one transposing shared-memory pass); left to the
    compiler, an 8-bit tile is gathered byte by byte from shared memory in
    that layout, which costs more instructions than its bytes take to stream.
    """
    a, b, c, d = tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; .reg .b32 x, y; mov.b32 {lo, hi}, $4; "
        "cvt.rn.f16x2.e4m3x2 x, lo; cvt.rn.f16x2.e4m3x2 y, hi; "
        "mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
        "=h,=h,=h,=h,r",
        [w],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True,
        pack=1,
    )
    # value 4j + 2i + k is word j's (2i + k)-th byte
    v = tl.join(tl.join(a, c), tl.join(b, d))
    return tl.reshape(v, [w.shape[0], 4 * w.shape[1]])


@triton.jit
def _e4m3_rows_to_f16(rows, row_ok, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The ``D`` e4m3 values from each pointer of ``rows`` (4-byte aligned), read as
    int32 words and widened to float16: ``[len(rows), BLOCK_D]``, zero where ``row_ok``
    is false or past ``D``."""
    dw = tl.arange(0, BLOCK_D // 4)
    words = tl.load(
        rows.to(tl.pointer_type(tl.int32), bitcast=True)[:, None] + dw[None, :],
        mask=row_ok[:, None] & (dw[None, :] < D // 4),
        other=0,
    )
    return _e4m3_words_to_f16(words)


@triton.jit
def _page_rows(
    plane,
    page,
    off,
    kvh,
    stride_p,
    stride_o,
    stride_h,
    row_ok,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One KV head's rows at ``(page, off)`` of a cache plane: ``[len(page), BLOCK_D]``, zero
    where ``row_ok`` is false or past ``D``; as stored, or widened to float16 from int32
    words with ``KV_FP8 == 2`` (see :func:`_e4m3_rows_to_f16`)."""
    rows = plane + page * stride_p + off * stride_o + kvh * stride_h
    if KV_FP8 == 2:
        tile = _e4m3_rows_to_f16(rows, row_ok, D, BLOCK_D)
    else:
        d = tl.arange(0, BLOCK_D)
        tile = tl.load(
            rows[:, None] + d[None, :], mask=row_ok[:, None] & (d[None, :] < D), other=0.0
        )
    return tile


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
    KV_FP8: tl.constexpr,
):
    """Fold the ``BLOCK_N`` keys from position ``start``, read through the page table, into the state.

    Shared by the prefill and decode kernels. A ``KV_FP8`` cache's tiles are
    widened to the queries' dtype as stored (``key / k_scale``): the caller
    folds ``k_scale`` into ``qk_scale`` and ``v_scale`` into the output. With
    ``KV_FP8 == 2`` the key and value tiles are read as int32 words and widened
    to float16 by :func:`_e4m3_rows_to_f16` (the caller's queries are float16
    then). ``MASK`` says what is hidden:
    ``0`` nothing (the tile lies below every row's causal limit and inside its
    window, so no compare is spent), ``1`` the keys at or past ``hi``, ``2``
    those and, per row, keys past ``q_pos`` or ``window`` or more behind it.

    :return: the updated ``(acc, m_i, l_i)``.
    """
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASK == 0:
        n_mask = offs_n >= 0
        page = tl.load(bt_row + offs_n // PAGE_SIZE).to(tl.int64)
    else:
        n_mask = offs_n < hi
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    off = offs_n % PAGE_SIZE
    k = _page_rows(
        k_ptr, page, off, kvh, stride_kp, stride_ko, stride_kh, n_mask, DK, BLOCK_DK, KV_FP8
    )
    if KV_FP8 == 1:
        k = k.to(q.dtype)
    s = _dot_t(q, k, IEEE)
    if HAS_PE:
        kpe = _page_rows(
            kpe_ptr, page, off, kvh, stride_ep, stride_eo, stride_eh, n_mask, DPE, BLOCK_DPE, 0
        )
        if KV_FP8:
            kpe = kpe.to(qpe.dtype)
        s += _dot_t(qpe, kpe, IEEE)
    if V_FROM_K:
        v = k  # MLA: the value is the latent the key tile already holds
    else:
        v = _page_rows(
            v_ptr, page, off, kvh, stride_vp, stride_vo, stride_vh, n_mask, DV, BLOCK_DV, KV_FP8
        )
        if KV_FP8 == 1:
            v = v.to(q.dtype)
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
def _paged_kv(
    start,
    hi,
    bt_row,
    k_ptr,
    v_ptr,
    stride_kp,
    stride_ko,
    stride_kh,
    stride_vp,
    stride_vo,
    stride_vh,
    kvh,
    DK: tl.constexpr,
    DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """The key and value tiles of the ``BLOCK_N`` positions from ``start``, read through the
    page table as :func:`_paged_tile` reads them, zero at or past ``hi``: as stored, or
    widened to float16 with ``KV_FP8 == 2``.

    :return: ``(k [BLOCK_N, BLOCK_DK], v [BLOCK_N, BLOCK_DV])``.
    """
    offs_n = start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hi
    page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    off = offs_n % PAGE_SIZE
    k = _page_rows(
        k_ptr, page, off, kvh, stride_kp, stride_ko, stride_kh, n_mask, DK, BLOCK_DK, KV_FP8
    )
    v = _page_rows(
        v_ptr, page, off, kvh, stride_vp, stride_vo, stride_vh, n_mask, DV, BLOCK_DV, KV_FP8
    )
    return k, v


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


# Counts that change from step to step are not specialised on (Triton would
# compile a variant for 1 and for multiples of 16), so a serving mix of step
# shapes does not stall on compiles. The block table's row stride is one of
# them: outside captured graphs the table is as wide as the step's longest
# sequence needs.
@triton.jit(do_not_specialize=["num_rows", "stride_bt"])
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
    v_scale,
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
    KV_FP8: tl.constexpr,
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

    A ``KV_FP8`` cache (e4m3, every key read from the pages: the host leaves
    ``CHUNK_FROM_INPUT`` off) is read as stored; ``qk_scale`` carries the
    layer's ``k_scale`` and the output is multiplied by ``v_scale``.

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
        )
        if not KV_FP8:
            q = q.to(k_ptr.dtype.element_ty)
        elif KV_FP8 == 2:
            # the tiles are widened to float16 (see _paged_tile): so are the queries
            q = q.to(tl.float16)
        if HAS_PE:
            de = tl.arange(0, BLOCK_DPE)
            qpe = tl.load(
                qpe_ptr + rows[:, None] * stride_pt + h * stride_ph + de[None, :],
                mask=m_mask[:, None] & (de[None, :] < DPE),
                other=0.0,
            )
            if not KV_FP8:
                qpe = qpe.to(kpe_ptr.dtype.element_ty)
            elif KV_FP8 == 2:
                qpe = qpe.to(tl.float16)
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
                        PAGE_SIZE, BLOCK_N, BLOCK_DK, BLOCK_DPE, BLOCK_DV, HAS_PE, V_FROM_K, IEEE, 2, KV_FP8,
                    )  # fmt: skip
            for start in range(full_lo, full_hi, BLOCK_N):
                acc, m_i, l_i = _paged_tile(
                    acc, m_i, l_i, q, qpe, start, hi, q_pos, window, bt_row,
                    k_ptr, kpe_ptr, v_ptr,
                    stride_kp, stride_ko, stride_kh, stride_ep, stride_eo, stride_eh,
                    stride_vp, stride_vo, stride_vh, kvh, qk_scale, DK, DPE, DV,
                    PAGE_SIZE, BLOCK_N, BLOCK_DK, BLOCK_DPE, BLOCK_DV, HAS_PE, V_FROM_K, IEEE, 0, KV_FP8,
                )  # fmt: skip
            for start in range(tl.maximum(full_hi, split), hi, BLOCK_N):
                acc, m_i, l_i = _paged_tile(
                    acc, m_i, l_i, q, qpe, start, hi, q_pos, window, bt_row,
                    k_ptr, kpe_ptr, v_ptr,
                    stride_kp, stride_ko, stride_kh, stride_ep, stride_eo, stride_eh,
                    stride_vp, stride_vo, stride_vh, kvh, qk_scale, DK, DPE, DV,
                    PAGE_SIZE, BLOCK_N, BLOCK_DK, BLOCK_DPE, BLOCK_DV, HAS_PE, V_FROM_K, IEEE, 2, KV_FP8,
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
        if KV_FP8:
            acc = acc * v_scale
        tl.store(
            o_ptr + rows[:, None] * stride_ot + h * stride_oh + dv[None, :],
            acc.to(o_ptr.dtype.element_ty),
            mask=m_mask[:, None] & (dv[None, :] < DV),
        )


# see _prefill_kernel for the counts left unspecialised
@triton.jit(do_not_specialize=["first_seq", "first_tok", "stride_bt"])
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
    k_scale,
    v_scale,
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
    PDL: tl.constexpr,
    KV_FP8: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr,
    EARLY: tl.constexpr,
):
    """One split of the keys of one decode sequence, for one block of a GQA group's heads.

    A sequence's keys are divided among its first ``active`` splits (whole
    tiles each, all but the last the same size): as many as its
    ``MIN_SPLIT_KEYS``-key blocks rounded up to a power of two, at most
    ``NUM_SPLITS`` (all of them when ``MIN_SPLIT_KEYS`` is 0), worked out from
    the sequence's length on the device. A decode graph is captured with the
    split count of the longest context; a short sequence replayed in it leaves
    its other splits idle (they write nothing and do not count in) instead of
    spreading a few keys over every split and merging them all.

    With ``APPEND`` the program whose split holds the sequence's last position
    first writes this step's key/value row (``kn``/``vn`` at the token's slot)
    to the pages, then reads it back with the rest: the decode tokens need no
    append launch of their own. With ``EARLY`` (``APPEND`` and plain keys and
    values) the split's first tile is read before the wait for the previous
    kernel, and this step's row is put in it from ``kn``/``vn`` (as the cache
    stores it) instead of read back.

    With one split the program writes its rows of ``out``. With several it
    writes its normalised partial output and log2-sum-exp to
    ``po[seq, head, split, :]`` and ``plse[seq, head, split]`` (``-inf`` for
    an empty split) and counts itself in at ``arrivals[seq, head block]``;
    the program that arrives last merges the splits into ``out`` and resets
    the counter to zero for the next launch. Merging in the same launch saves
    a kernel launch per layer, which is most of an eager decode's cost at
    small batches.

    A ``KV_FP8`` cache (e4m3) gets ``key / k_scale`` and ``value / v_scale``
    appended and is read as stored, widened to the float32 queries' dtype, or
    for 16-bit queries to float16 (the queries too, which must then stay
    within float16's range); ``qk_scale`` carries
    ``k_scale`` and the (partial) outputs are multiplied by ``v_scale``.
    """
    if PDL:
        # Launched as a programmatic dependent: the next kernel's programs may
        # be scheduled once all of these run.
        tl.extra.cuda.gdc_launch_dependents()
    j = tl.program_id(0)
    kvh = tl.program_id(1) // HEAD_BLOCKS
    hb = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)
    seq = first_seq + j
    tok = (first_tok + j).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo0 = tl.maximum(seq_len - window, 0)
    span = seq_len - lo0
    if MIN_SPLIT_KEYS > 0:
        # the host's rule for an eager step, per sequence: its MIN_SPLIT_KEYS-key
        # blocks rounded up to a power of two, at most the launch's splits
        blocks = tl.cdiv(span, MIN_SPLIT_KEYS)
        want = tl.full([], 1, tl.int32)
        for _ in tl.static_range(7):  # 2**7 > MAX_KV_SPLITS
            want = tl.where(want < blocks, want * 2, want)
        want = tl.minimum(want, NUM_SPLITS)
    else:
        want = NUM_SPLITS
    per_split = tl.maximum(tl.cdiv(tl.cdiv(span, want), BLOCK_N), 1) * BLOCK_N
    # splits past the keys stay idle; an empty sequence still has one (empty) split
    active = tl.maximum(tl.cdiv(span, per_split), 1)
    lo = lo0 + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    if EARLY:
        # The split's first tile, before the wait: the lengths and page table
        # were written before this step's first kernel and the pages by earlier
        # steps, so the page walk overlaps the previous kernel's tail. The one
        # row this step writes (the new position's) is put in below.
        k_first, v_first = _paged_kv(
            lo, hi, bt_row, k_ptr, v_ptr,
            stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, kvh,
            DK, DV, PAGE_SIZE, BLOCK_N, BLOCK_DK, BLOCK_DV, KV_FP8,
        )  # fmt: skip
    if PDL:
        # What follows reads this step's queries and rows: the previous kernel's.
        tl.extra.cuda.gdc_wait()

    in_group = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = in_group < group
    heads = kvh * group + in_group
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + tok * stride_qt + heads[:, None] * stride_qh + dk[None, :],
        mask=h_mask[:, None] & (dk[None, :] < DK),
        other=0.0,
    )
    if KV_FP8:
        if q_ptr.dtype.element_ty != tl.float32:
            # e4m3 widens to float16 in one instruction per pair (to bfloat16 it takes
            # a chain of conversions): 16-bit queries meet float16 tiles, exactly for
            # every bfloat16 query in float16's range
            q = q.to(tl.float16)
    else:
        q = q.to(k_ptr.dtype.element_ty)
    if HAS_PE:
        de = tl.arange(0, BLOCK_DPE)
        qpe = tl.load(
            qpe_ptr + tok * stride_pt + heads[:, None] * stride_ph + de[None, :],
            mask=h_mask[:, None] & (de[None, :] < DPE),
            other=0.0,
        )
        if KV_FP8:
            if qpe_ptr.dtype.element_ty != tl.float32:
                qpe = qpe.to(tl.float16)
        else:
            qpe = qpe.to(kpe_ptr.dtype.element_ty)
    else:
        qpe = q

    appended = False
    if APPEND:
        slot = tl.load(slot_ptr + tok)
        appended = (slot >= 0) & (seq_len - 1 >= lo) & (seq_len - 1 < hi)
        if appended:
            slot = slot.to(tl.int64)
            page = slot // PAGE_SIZE
            off = slot % PAGE_SIZE
            kr = tl.load(kn_ptr + tok * stride_knt + kvh * stride_knh + dk, mask=dk < DK)
            tl.store(
                k_ptr + page * stride_kp + off * stride_ko + kvh * stride_kh + dk,
                _to_cache(kr, k_scale, k_ptr.dtype.element_ty, KV_FP8),
                mask=dk < DK,
            )
            vr = tl.load(vn_ptr + tok * stride_vnt + kvh * stride_vnh + dv, mask=dv < DV)
            tl.store(
                v_ptr + page * stride_vp + off * stride_vo + kvh * stride_vh + dv,
                _to_cache(vr, v_scale, v_ptr.dtype.element_ty, KV_FP8),
                mask=dv < DV,
            )
            # The row is read back by other threads of this program below.
            tl.debug_barrier()

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    # Whole tiles need no bounds check; only the split's last, partial tile does.
    full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    rest = lo
    if EARLY:
        # The early tile read the new position's row before it was written: this
        # step's row goes in its place, as the cache now holds it.
        offs_first = lo + tl.arange(0, BLOCK_N)
        new_row = (offs_first == seq_len - 1) & appended
        kc = tl.load(kn_ptr + tok * stride_knt + kvh * stride_knh + dk, mask=dk < DK, other=0.0)
        kc = _to_cache(kc, k_scale, k_ptr.dtype.element_ty, KV_FP8).to(q.dtype)
        vc = tl.load(vn_ptr + tok * stride_vnt + kvh * stride_vnh + dv, mask=dv < DV, other=0.0)
        vc = _to_cache(vc, v_scale, v_ptr.dtype.element_ty, KV_FP8).to(q.dtype)
        k_first = tl.where(new_row[:, None], kc[None, :], k_first.to(q.dtype))
        v_first = tl.where(new_row[:, None], vc[None, :], v_first.to(q.dtype))
        acc, m_i, l_i = _fold_tile(
            acc, m_i, l_i, _dot_t(q, k_first, IEEE), (offs_first < hi)[None, :], v_first,
            qk_scale, True, IEEE,
        )  # fmt: skip
        rest = lo + BLOCK_N
    for start in range(rest, full_hi, BLOCK_N):
        acc, m_i, l_i = _paged_tile(
            acc, m_i, l_i, q, qpe, start, hi, lo, window, bt_row,
            k_ptr, kpe_ptr, v_ptr,
            stride_kp, stride_ko, stride_kh, stride_ep, stride_eo, stride_eh,
            stride_vp, stride_vo, stride_vh, kvh, qk_scale, DK, DPE, DV,
            PAGE_SIZE, BLOCK_N, BLOCK_DK, BLOCK_DPE, BLOCK_DV, HAS_PE, V_FROM_K, IEEE, 0, KV_FP8,
        )  # fmt: skip
    for start in range(tl.maximum(full_hi, rest), hi, BLOCK_N):
        acc, m_i, l_i = _paged_tile(
            acc, m_i, l_i, q, qpe, start, hi, lo, window, bt_row,
            k_ptr, kpe_ptr, v_ptr,
            stride_kp, stride_ko, stride_kh, stride_ep, stride_eo, stride_eh,
            stride_vp, stride_vo, stride_vh, kvh, qk_scale, DK, DPE, DV,
            PAGE_SIZE, BLOCK_N, BLOCK_DK, BLOCK_DPE, BLOCK_DV, HAS_PE, V_FROM_K, IEEE, 1, KV_FP8,
        )  # fmt: skip

    empty = l_i == 0.0
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    if KV_FP8:
        acc = acc * v_scale
    out_rows = o_ptr + tok * stride_ot + heads[:, None] * stride_oh + dv[None, :]
    out_mask = h_mask[:, None] & (dv[None, :] < DV)
    if NUM_SPLITS == 1:
        tl.store(out_rows, acc.to(o_ptr.dtype.element_ty), mask=out_mask)
    elif split < active:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        row0 = (j.to(tl.int64) * num_heads + heads) * NUM_SPLITS
        tl.store(po_ptr + (row0 + split)[:, None] * BLOCK_DV + dv[None, :], acc, mask=out_mask)
        tl.store(plse_ptr + row0 + split, lse, mask=h_mask)
        # Every thread's partial stores come before the (releasing) arrival.
        tl.debug_barrier()
        counter = arrivals_ptr + j * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(counter, 1, sem="acq_rel") == active - 1:
            ss = tl.arange(0, BLOCK_S)
            # Loads bypass L1 (".cg"): the other splits were written by other SMs.
            lses = tl.load(
                plse_ptr + row0[:, None] + ss[None, :],
                mask=h_mask[:, None] & (ss[None, :] < active),
                other=float("-inf"),
                cache_modifier=".cg",
            )
            m = tl.max(lses, 1)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            total = tl.sum(tl.exp2(lses - m_safe[:, None]), 1)
            merged = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
            if BLOCK_S * BLOCK_DV <= MERGE_UNROLLED:
                # Unrolled, the splits' loads are independent and issue together: one
                # trip to L2 instead of one per split, which at one sequence is most
                # of the merge (the weights come from the log-sum-exps in registers).
                for s in tl.static_range(NUM_SPLITS):
                    s_ok = (tl.zeros([BLOCK_H, BLOCK_DV], tl.int32) + s) < active
                    w = tl.exp2(tl.sum(tl.where(ss[None, :] == s, lses, 0.0), 1) - m_safe)
                    part = tl.load(
                        po_ptr + (row0 + s)[:, None] * BLOCK_DV + dv[None, :],
                        mask=out_mask & s_ok,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    merged += part * w[:, None]
            else:
                # One split at a time keeps registers at one [BLOCK_H, BLOCK_DV] tile
                # whatever the number of splits (MLA rows are 512 wide).
                for s in range(active):
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
