"""The Triton attention kernels reading an FP8 (e4m3) KV cache, on CPU in the Triton interpreter.

The interpreter reads e4m3 correctly but rounds float32 to e4m3 wrongly near
the binades' edges (e.g. 127.03 becomes 64), so on CPU the cache is written by
torch (``x / scale`` rounded to e4m3, as the kernels write it on a GPU) and
the kernels only read it: the prefill kernel from the pages alone, the
split-KV decode kernel over several splits, each with ``k_scale`` folded
into the scores and ``v_scale`` into the output. Their rows are compared
with a float64 reference over the dequantised cache. The kernels' own appends
(bit for bit) run on a GPU in ``tests/test_fp8_kv_gpu.py``.

Run one check by hand with::

    TRITON_INTERPRET=1 python tests/test_fp8_kv_triton.py fp8_prefill_from_pages
"""

from __future__ import annotations

import sys

from interpreter_checks import interpreter_tests, main

CHECKS = (
    "fp8_prefill_from_pages",
    "fp8_decode_split_kv",
    "fp8_decode_active_splits",
    "fp8_decode_bf16_queries",
    "fp8_scales_are_not_ignored",
)

#: the layer's scales of the checks (not powers of two: the division is rounded)
K_SCALE, V_SCALE = 0.37, 2.9

if __name__ != "__main__":
    interpret_results, test_fp8_kernel_in_interpreter = interpreter_tests(__file__, CHECKS)


def _setup(query_lens, cached_lens, *, hq, hkv, d, page_size, seed):
    """A batch, queries, and an FP8 cache holding every position's keys and values."""
    import numpy as np
    import torch

    from backplane.core.packing import build_batch_metadata
    from backplane.testing.fp8 import to_fp8

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    num_pages = (
        sum(-(-(q + c) // page_size) for q, c in zip(query_lens, cached_lens, strict=True)) + 2
    )
    pages = rng.permutation(np.arange(1, num_pages))
    tables, at = [], 0
    for q, c in zip(query_lens, cached_lens, strict=True):
        n = -(-(q + c) // page_size)
        tables.append(pages[at : at + n])
        at += n
    batch = build_batch_metadata(query_lens, cached_lens, tables, page_size)
    T = batch.padded_num_tokens
    q = torch.randn(T, hq, d)
    # keys of varied magnitude, some past the e4m3 range after the division
    full = torch.randn(num_pages, 2, page_size, hkv, d) * torch.tensor([60.0, 3.0]).view(
        1, 2, 1, 1, 1
    )
    cache = torch.stack([to_fp8(full[:, 0], K_SCALE), to_fp8(full[:, 1], V_SCALE)], dim=1)
    return batch, q, cache


def _reference(batch, q, cache, scale, k_scale, v_scale):
    """Float64 causal attention of every real token over the dequantised cache."""
    import torch

    h = batch.host
    page_size = cache.shape[2]
    out = torch.zeros(batch.num_tokens, q.shape[1], q.shape[2], dtype=torch.float64)
    for i in range(batch.num_seqs):
        a, b = int(h.query_start_loc[i]), int(h.query_start_loc[i + 1])
        n, cached = int(h.seq_lens[i]), int(h.cached_lens[i])
        pos = torch.arange(n)
        pages = torch.as_tensor(h.block_table[i], dtype=torch.long)[pos // page_size]
        ks = cache[pages, 0, pos % page_size].double() * k_scale
        vs = cache[pages, 1, pos % page_size].double() * v_scale
        g = q.shape[1] // ks.shape[1]
        ks, vs = ks.repeat_interleave(g, dim=1), vs.repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), ks) * scale
        keep = pos[None, :] <= (torch.arange(b - a) + cached)[:, None]
        s = s.masked_fill(~keep[None], float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vs)
    return out


def _close(name, got, ref, atol=2e-4, rtol=2e-4):
    """Fail with the largest error unless ``got`` is within the tolerance of ``ref``."""
    import torch

    got = got.double()
    if not torch.isfinite(got).all():
        raise AssertionError(f"{name}: non-finite values")
    err = (got - ref).abs()
    if not (err <= atol + rtol * ref.abs()).all():
        raise AssertionError(f"{name}: max abs error {err.max().item():.3g}")


def _prefill(batch, q, cache, k_scale, v_scale):
    import torch

    from backplane.backends.triton import attention_launch as tri

    out = torch.full(q.shape, float("nan"))
    group = q.shape[1] // cache.shape[3]
    tri.paged_prefill(
        batch, q, cache[:, 0], cache[:, 1], out,
        scale=0.2, group=group, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    return out


def check_fp8_prefill_from_pages():
    """Prefill/extend sequences, every key read from e4m3 pages (GQA, prefixes crossing pages)."""
    batch, q, cache = _setup([9, 17, 5], [0, 11, 30], hq=4, hkv=2, d=16, page_size=4, seed=1)
    out = _prefill(batch, q, cache, K_SCALE, V_SCALE)
    ref = _reference(batch, q, cache, 0.2, K_SCALE, V_SCALE)
    _close("prefill", out[: batch.num_tokens], ref)


def check_fp8_decode_split_kv():
    """Decode sequences over several splits (some empty), GQA group of 4, e4m3 pages."""
    import torch

    from backplane.backends.triton import attention_launch as tri

    batch, q, cache = _setup([1, 1, 1], [70, 5, 33], hq=8, hkv=2, d=32, page_size=8, seed=2)
    ref = _reference(batch, q, cache, 0.2, K_SCALE, V_SCALE)
    for splits in (1, 4):
        out = torch.full(q.shape, float("nan"))
        tri.paged_decode(
            batch, q, cache[:, 0], cache[:, 1], out,
            scale=0.2, group=4, k_scale=K_SCALE, v_scale=V_SCALE, num_splits=splits,
        )  # fmt: skip
        _close(f"decode over {splits} splits", out[: batch.num_tokens], ref)


def check_fp8_decode_active_splits():
    """Each sequence takes as many of the launch's splits as its keys fill at the least keys a
    split, the rest idle: contexts of 2 to 251 keys over 8 splits, at 32 and at the default 128
    keys a split, and every key divided among all splits (0); each launch twice with new
    queries, so an arrival counter left wrong by the idle splits would break the second."""
    import torch

    from backplane.backends.triton import attention_launch as tri

    batch, q, cache = _setup(
        [1, 1, 1, 1, 1, 1], [1, 4, 40, 69, 100, 250], hq=8, hkv=2, d=32, page_size=8, seed=5
    )
    for min_keys in (32, None, 0):
        for round_ in range(2):
            q = torch.randn_like(q)
            ref = _reference(batch, q, cache, 0.2, K_SCALE, V_SCALE)
            out = torch.full(q.shape, float("nan"))
            tri.paged_decode(
                batch, q, cache[:, 0], cache[:, 1], out, scale=0.2, group=4,
                k_scale=K_SCALE, v_scale=V_SCALE, num_splits=8, min_split_keys=min_keys,
            )  # fmt: skip
            _close(
                f"8 splits, {min_keys} keys a split, round {round_}", out[: batch.num_tokens], ref
            )


def check_fp8_decode_bf16_queries():
    """bfloat16 queries over e4m3 pages (the engine's case): the tiles and queries meet in
    float16, and the bfloat16 output is within its own rounding of the float64 reference."""
    import torch

    from backplane.backends.triton import attention_launch as tri

    batch, q, cache = _setup([1, 1, 1], [70, 5, 33], hq=8, hkv=2, d=32, page_size=8, seed=4)
    q = q.to(torch.bfloat16)
    ref = _reference(batch, q.float(), cache, 0.2, K_SCALE, V_SCALE)
    for splits in (1, 4):
        out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
        tri.paged_decode(
            batch, q, cache[:, 0], cache[:, 1], out,
            scale=0.2, group=4, k_scale=K_SCALE, v_scale=V_SCALE, num_splits=splits,
        )  # fmt: skip
        # bfloat16 output (8 bits) plus float16 probabilities (11 bits)
        _close(f"bf16 decode over {splits} splits", out[: batch.num_tokens], ref, 2e-2, 1e-2)


def check_fp8_scales_are_not_ignored():
    """Other scales give other outputs: the kernels apply the scales they are given."""
    batch, q, cache = _setup([6], [10], hq=2, hkv=1, d=16, page_size=4, seed=3)
    out = _prefill(batch, q, cache, 1.0, 1.0)
    ref = _reference(batch, q, cache, 0.2, 1.0, 1.0)
    _close("unit scales", out[: batch.num_tokens], ref)
    scaled = _reference(batch, q, cache, 0.2, K_SCALE, V_SCALE)
    if (out[: batch.num_tokens].double() - scaled).abs().max() < 1e-2:
        raise AssertionError("the reference does not depend on the scales: the check is void")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CHECKS, lambda name: globals()[f"check_{name}"]()))
