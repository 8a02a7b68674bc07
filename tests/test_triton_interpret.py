"""The Triton backends' kernels on CPU, in the Triton interpreter, against float64 references.

``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported, and it
would make the Triton backends "available" to every other test in the same
process. So the checks below run in ONE child process (this file executed as a
script with the variable set); each pytest test reports one check's result.
Run a single check by hand with::

    TRITON_INTERPRET=1 python tests/test_triton_interpret.py attention_prefill_extend

The SSM and delta checks use mamba-ssm's and fla's kernels: they run when those
packages (and einops) can be imported, or when their wheel / source archive
under ``.wheels`` (see README.md) or ``.gpu/wheels`` can be unpacked next to an
importable einops; otherwise they are skipped with
the reason. Shapes are small and float32 so the interpreter finishes quickly.
"""

from __future__ import annotations

import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from interpreter_checks import interpreter_tests, main

ROOT = Path(__file__).resolve().parents[1]

CHECKS = (
    "kv_append",
    "attention_prefill_extend",
    "attention_sliding_window",
    "attention_decode_split_kv",
    "attention_decode_early_tile",
    "attention_long_chunks",
    "attention_pages_only_prefill",
    "attention_out_contract",
    "attention_position_rows",
    "mla_mixed",
    "mla_wide_latent",
    "conv_mixed",
    "conv_decode",
    "ssm_decode",
    "ssm_mixed",
    "ssm_packed",
    "delta_decode",
    "delta_decode_in_place",
)


# -- the pytest side ----------------------------------------------------------------

if __name__ != "__main__":
    interpret_results, test_kernel_in_interpreter = interpreter_tests(__file__, CHECKS)


# -- the child side: references and checks ----------------------------------------------


def _extra_paths() -> str | None:
    """Make mamba_ssm/fla importable from the carried wheels if needed; return a skip reason."""
    import importlib.util

    if importlib.util.find_spec("einops") is None:
        return "einops is not installed (mamba-ssm and fla import it)"
    # .wheels: where README.md's test set-up downloads mamba-ssm's sources
    # (it does not install on a machine without CUDA); .gpu/wheels: GPU runs
    dirs = [ROOT / ".wheels", ROOT / ".gpu" / "wheels"]
    target = Path(tempfile.gettempdir()) / "backplane-triton-test-site"
    if importlib.util.find_spec("fla") is None:
        whl = sorted(p for d in dirs for p in d.glob("fla_core-*.whl"))
        if whl:
            dest = target / "fla"
            if not (dest / "fla").exists():
                with zipfile.ZipFile(whl[0]) as zf:
                    zf.extractall(dest)
            sys.path.insert(0, str(dest))
    if importlib.util.find_spec("mamba_ssm") is None:
        sdist = sorted(p for d in dirs for p in d.glob("mamba_ssm-*.tar.gz"))
        if sdist:
            dest = target / "mamba"
            if not dest.exists():
                with tarfile.open(sdist[0]) as tf:
                    tf.extractall(dest, filter="data")
            sys.path.insert(0, str(next(dest.glob("mamba_ssm-*"))))
    return None


def _batch(query_lens, cached_lens, page_size, num_pages, seed=0, padded=None):
    """A batch with shuffled (non-contiguous) page tables that avoid the scratch page 0."""
    import numpy as np

    from backplane.core.packing import build_batch_metadata

    rng = np.random.default_rng(seed)
    pages = rng.permutation(np.arange(1, num_pages))
    tables, at = [], 0
    for q, c in zip(query_lens, cached_lens, strict=False):
        n = -(-(q + c) // page_size)
        tables.append(pages[at : at + n])
        at += n
    assert at <= len(pages), "not enough pages for the test batch"
    slots = rng.permutation(np.arange(1, len(query_lens) + 1))
    return build_batch_metadata(
        query_lens, cached_lens, tables, page_size, state_slots=slots, padded_num_tokens=padded
    )


def _ref_attention(q, k_all, v_all, cached, scale, window):
    """Naive float64 causal attention of one sequence's queries over all its keys."""
    import torch

    qn, hq, _ = q.shape
    hkv = k_all.shape[1]
    g = hq // hkv
    k = k_all.double().repeat_interleave(g, dim=1)
    v = v_all.double().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(qn)[:, None] + cached
    kpos = torch.arange(k.shape[0])[None, :]
    keep = kpos <= qpos
    if window:
        keep &= kpos > qpos - window
    s = s.masked_fill(~keep[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def _gather_seq(cache_plane, table, n, page_size):
    """Read ``n`` tokens of one sequence from a ``[P, page, ...]`` cache plane."""
    import torch

    pos = torch.arange(n)
    pages = torch.as_tensor(table, dtype=torch.long)[pos // page_size]
    return cache_plane[pages, pos % page_size]


def _close(name, got, ref, atol=2e-4, rtol=2e-4):
    import torch

    got = got.double()
    if not torch.isfinite(got).all():
        raise AssertionError(f"{name}: non-finite values")
    err = (got - ref.double()).abs()
    tol = atol + rtol * ref.double().abs()
    if not (err <= tol).all():
        raise AssertionError(
            f"{name}: max abs error {err.max().item():.3g} (tolerance {atol}, {rtol})"
        )


def _attention_case(
    query_lens,
    cached_lens,
    *,
    hq=4,
    hkv=2,
    d=32,
    page_size=4,
    window=0,
    splits=0,
    padded=None,
    seed=0,
    batch=None,
):
    """Run the attention op on a random batch and compare every row and the cache.

    ``batch`` replaces the batch built from the lengths (whose sequences must
    then fit in ``sum of pages + 3`` pages).
    """
    import torch

    import backplane.backends.triton.attention  # noqa: F401  (registers the op)
    from backplane.backends.triton import attention_launch as tri
    from backplane.core.forward_context import forward_context

    torch.manual_seed(seed)
    if batch is None:
        total_pages = (
            sum(-(-(q + c) // page_size) for q, c in zip(query_lens, cached_lens, strict=False)) + 3
        )
        batch = _batch(query_lens, cached_lens, page_size, total_pages, seed=seed, padded=padded)
    else:
        total_pages = int(batch.host.block_table.max()) + 1
    T = batch.padded_num_tokens
    q = torch.randn(T, hq, d)
    k = torch.randn(T, hkv, d)
    v = torch.randn(T, hkv, d)
    cache = torch.randn(total_pages, 2, page_size, hkv, d)  # cached prefix = random history
    before = cache.clone()
    scale = d**-0.5
    out = torch.full((T, hq, d), float("nan"))
    tri._FORCED_SPLITS["value"] = splits
    try:
        with forward_context(batch):
            sentinel = torch.ops.backplane_triton.attention(
                q, k, v, cache, window, scale, 1.0, 1.0, out
            )
    finally:
        tri._FORCED_SPLITS["value"] = 0
    assert sentinel.numel() == 0, "the op must return an empty sentinel when out is given"
    h = batch.host
    expect_cache = before.clone()
    for t in range(batch.num_tokens):
        s = int(h.slot_mapping[t])
        expect_cache[s // page_size, 0, s % page_size] = k[t]
        expect_cache[s // page_size, 1, s % page_size] = v[t]
    if not torch.equal(cache, expect_cache):
        raise AssertionError(
            "KV cache differs from the expected append (or a padding row was written)"
        )
    for i in range(batch.num_seqs):
        a, b = int(h.query_start_loc[i]), int(h.query_start_loc[i + 1])
        n = int(h.seq_lens[i])
        table = h.block_table[i]
        ks = _gather_seq(cache[:, 0], table, n, page_size)
        vs = _gather_seq(cache[:, 1], table, n, page_size)
        ref = _ref_attention(q[a:b], ks, vs, int(h.cached_lens[i]), scale, window)
        _close(f"sequence {i}", out[a:b], ref)
    if T > batch.num_tokens and not (out[batch.num_tokens :] == 0).all():
        raise AssertionError("padding rows of out are not zero")
    for buffers in tri._ARRIVALS.values():
        if any(counters.any() for counters in buffers):
            raise AssertionError("split-KV arrival counters were not reset to zero")
    return batch


def check_kv_append():
    """Append only: every real token lands at its slot, padding (-1) writes nothing."""
    import torch

    from backplane.backends.triton.attention_launch import kv_append

    batch = _batch([3, 5, 1], [0, 2, 6], 4, 12, padded=11)
    k = torch.randn(batch.padded_num_tokens, 2, 8)
    cache = torch.randn(12, 2, 4, 2, 8)
    expect = cache.clone()
    for t in range(batch.num_tokens):
        s = int(batch.host.slot_mapping[t])
        expect[s // 4, 0, s % 4] = k[t]
    # Launch over the padded count: the padding slots are -1 and must be skipped.
    kv_append(k, cache[:, 0], batch.slot_mapping, batch.padded_num_tokens)
    if not torch.equal(cache, expect):
        raise AssertionError("append wrote the wrong slots")


def check_attention_prefill_extend():
    """Pure prefill, chunked-prefill extend from cache across pages, and decodes, GQA, padded."""
    _attention_case([7, 5, 19, 1, 1], [0, 9, 3, 13, 4], padded=40, splits=2)
    _attention_case([33], [0], hq=4, hkv=1, d=16, page_size=8)
    # Long enough for whole key tiles below the causal diagonal (the unmasked path)
    # next to masked ones, with several query blocks per sequence.
    _attention_case([70, 40], [0, 75], hq=2, hkv=1, d=16, page_size=8, seed=1)


def check_attention_position_rows():
    """Chunks of one sequence as one decode row per position (a verify graph's step).

    Rows of a sequence share its pages and attend to each other's keys: with
    ``rows_share_pages`` every key is appended before any row attends (the
    decode kernel's own append would let a row read a key not yet written).
    """
    import numpy as np

    from backplane.core.metadata import StepMode
    from backplane.core.packing import build_batch_metadata

    page_size, chunks, cached = 4, [4, 1, 3], [5, 9, 2]
    rng = np.random.default_rng(3)
    free = rng.permutation(np.arange(1, 16))
    q_lens, c_lens, tables, at = [], [], [], 0
    for q, c in zip(chunks, cached, strict=True):
        n = -(-(q + c) // page_size)
        table, at = free[at : at + n], at + n
        for i in range(q):
            q_lens.append(1)
            c_lens.append(c + i)
            tables.append(table)
    bucket = 16  # the rows padded to a captured bucket's size
    mode = StepMode.decode_graph(bucket, rows_share_pages=True)
    batch = build_batch_metadata(
        q_lens, c_lens, tables, page_size, padded_num_tokens=bucket, mode=mode
    )
    _attention_case(None, None, splits=2, batch=batch, page_size=page_size)
    _attention_case(None, None, splits=1, batch=batch, page_size=page_size, seed=1)


def check_attention_sliding_window():
    """Sliding window in prefill, extend and decode."""
    _attention_case([6, 9, 1, 1], [0, 11, 20, 3], window=5, splits=3)
    # A window wider than a key tile: masked tiles at both ends of an unmasked middle.
    _attention_case([80, 1], [300, 120], hq=2, hkv=1, d=16, page_size=8, window=200, splits=2)


def check_attention_decode_split_kv():
    """Decode only, long-ish contexts over many splits (some empty), GQA group of 4."""
    _attention_case([1, 1, 1], [150, 37, 2], hq=8, hkv=2, d=32, page_size=16, splits=5, padded=4)
    _attention_case([1, 1], [90, 7], hq=2, hkv=2, d=64, page_size=8, splits=1)


def check_attention_decode_early_tile():
    """The tile read before the wait, at one sequence (the interpreter's device holds 8
    programs, four splits of its 2 KV heads): heads of 128 in float32 keep that tile to
    32 keys, and two splits of 299, 170 and 89 cached keys go on in whole and partial
    tiles after it, this step's row landing in a later tile (read back from the pages)
    and, for 89, in the early one (put in from the step's rows); heads of 32 read a whole
    split of 70 keys early."""
    for seed, cached in enumerate((299, 170, 89)):
        _attention_case([1], [cached], hq=4, hkv=2, d=128, page_size=8, splits=2, seed=6 + seed)
    _attention_case([1], [70], hq=8, hkv=2, d=32, page_size=8, seed=9)


def check_attention_long_chunks():
    """Chunks longer than a query block: whole chunk tiles read from this step's rows unmasked.

    The default tiles here are 128 queries x 64 keys, so the second and third
    query blocks attend whole tiles of their own chunk below the diagonal (and,
    with a window, masked tiles at its far edge) after the paged prefix.
    """
    _attention_case([300, 150, 1], [0, 45, 70], hq=2, hkv=1, d=16, page_size=8, splits=2, seed=2)
    _attention_case([290, 1], [37, 300], hq=2, hkv=1, d=16, page_size=8, window=100, seed=3)
    # No cached prefix anywhere: the kernel variant without the paged loops.
    _attention_case([260, 70], [0, 0], hq=2, hkv=1, d=16, page_size=8, window=90, seed=4)
    _attention_case([200], [0], hq=4, hkv=2, d=16, page_size=8, seed=5)


def check_attention_pages_only_prefill():
    """Without this step's rows the prefill kernel reads every key from the pages: same result."""
    import torch

    from backplane.backends.triton import attention_launch as tri

    batch = _batch([150, 9], [20, 33], 8, 40, seed=4)
    T = batch.padded_num_tokens
    q, k, v = torch.randn(T, 4, 16), torch.randn(T, 2, 16), torch.randn(T, 2, 16)
    cache = torch.randn(40, 2, 8, 2, 16)
    tri.kv_append(k, cache[:, 0], batch.slot_mapping, T, v, cache[:, 1])
    outs = []
    for rows in (True, False):
        out = torch.full((T, 4, 16), float("nan"))
        extra = dict(k_new=k, v_new=v) if rows else {}
        tri.paged_prefill(batch, q, cache[:, 0], cache[:, 1], out, scale=0.25, group=2, **extra)
        outs.append(out)
    h = batch.host
    for i in range(batch.num_seqs):
        a, b = int(h.query_start_loc[i]), int(h.query_start_loc[i + 1])
        n = int(h.seq_lens[i])
        ks = _gather_seq(cache[:, 0], h.block_table[i], n, 8)
        vs = _gather_seq(cache[:, 1], h.block_table[i], n, 8)
        ref = _ref_attention(q[a:b], ks, vs, int(h.cached_lens[i]), 0.25, 0)
        _close(f"rows-and-pages sequence {i}", outs[0][a:b], ref)
        _close(f"pages-only sequence {i}", outs[1][a:b], ref)


def check_attention_out_contract():
    """With and without ``out``: same rows, cache written once each, zeroed padding."""
    import torch

    import backplane.backends.triton.attention  # noqa: F401  (registers the op)
    from backplane.core.forward_context import forward_context

    batch = _batch([4, 1], [3, 6], 4, 8, padded=8)
    T = batch.padded_num_tokens
    q, k, v = torch.randn(T, 2, 16), torch.randn(T, 1, 16), torch.randn(T, 1, 16)
    cache0 = torch.randn(8, 2, 4, 1, 16)
    c1, c2 = cache0.clone(), cache0.clone()
    with forward_context(batch):
        fresh = torch.ops.backplane_triton.attention(q, k, v, c1, 0, 0.25, 1.0, 1.0, None)
        out = torch.full((T, 2, 16), float("nan"))
        sentinel = torch.ops.backplane_triton.attention(q, k, v, c2, 0, 0.25, 1.0, 1.0, out)
    assert fresh.shape == (T, 2, 16) and sentinel.numel() == 0
    if not torch.equal(fresh, out) or not torch.equal(c1, c2):
        raise AssertionError("results differ between the out and no-out paths")
    if not (out[batch.num_tokens :] == 0).all():
        raise AssertionError("padding rows are not zero")
    with forward_context(batch):
        torch.library.opcheck(
            torch.ops.backplane_triton.attention.default,
            (q, k, v, cache0.clone(), 0, 0.25, 1.0, 1.0, torch.zeros(T, 2, 16)),
            test_utils=("test_schema", "test_faketensor"),
        )


def check_mla_mixed():
    """MLA (weight-absorbed, both prefill/extend and decode) against the expanded float64 form."""
    _mla_case(4, 32, 16, [5, 3, 1, 1], [0, 6, 9, 30], splits=0)


def check_mla_wide_latent():
    """MLA with a wide latent (the large-tile path) and 20 heads (two head blocks, one partial)."""
    _mla_case(20, 256, 16, [3, 1, 1], [4, 40, 7], splits=3)


def _mla_case(H, L, R, query_lens, cached_lens, *, splits, dn=16, dv=16, ps=4):
    import torch

    from backplane.backends.triton import attention_launch as tri
    from backplane.backends.triton.mla import TritonMLABackend
    from backplane.core.families import MLALayerSpec
    from backplane.core.forward_context import forward_context

    torch.manual_seed(1)
    layer = MLALayerSpec(0, H, L, dn, R, dv, scale=(dn + R) ** -0.5)
    pages = sum(-(-(q + c) // ps) for q, c in zip(query_lens, cached_lens, strict=False)) + 2
    batch = _batch(query_lens, cached_lens, ps, pages, padded=sum(query_lens) + 3)
    T = batch.padded_num_tokens
    q_nope, q_pe = torch.randn(T, H, dn), torch.randn(T, H, R)
    kv_c, k_pe = torch.randn(T, L), torch.randn(T, R)
    w_uk, w_uv = torch.randn(H, dn, L) * 0.2, torch.randn(H, dv, L) * 0.2
    cache = torch.randn(pages, ps, L + R)
    out = torch.full((T, H, dv), float("nan"))
    backend = TritonMLABackend()
    tri._FORCED_SPLITS["value"] = splits
    try:
        with forward_context(batch, {"mla": backend.plan(batch)}):
            sentinel = backend.forward(q_nope, q_pe, kv_c, k_pe, cache, w_uk, w_uv, layer, out)
    finally:
        tri._FORCED_SPLITS["value"] = 0
    assert sentinel.numel() == 0
    h = batch.host
    for t in range(batch.num_tokens):
        s = int(h.slot_mapping[t])
        if not torch.equal(cache[s // ps, s % ps], torch.cat([kv_c[t], k_pe[t]])):
            raise AssertionError(f"latent cache not written for token {t}")
    for i in range(batch.num_seqs):
        a, b = int(h.query_start_loc[i]), int(h.query_start_loc[i + 1])
        lat = _gather_seq(cache, h.block_table[i], int(h.seq_lens[i]), ps).double()
        c, kr = lat[:, :L], lat[:, L:]
        k_nope = torch.einsum("nl,hdl->nhd", c, w_uk.double())
        keys = torch.cat([k_nope, kr[:, None].expand(-1, H, -1)], -1)
        vals = torch.einsum("nl,hdl->nhd", c, w_uv.double())
        qq = torch.cat([q_nope[a:b], q_pe[a:b]], -1)
        ref = _ref_attention(qq, keys, vals, int(h.cached_lens[i]), layer.scale, 0)
        _close(f"mla sequence {i}", out[a:b], ref, atol=5e-4, rtol=5e-4)
    if not (out[batch.num_tokens :] == 0).all():
        raise AssertionError("padding rows are not zero")


def _conv_ref(x, w, b, state, has_init):
    """Naive float64 causal depthwise conv of one sequence; returns (y, new_state)."""
    import torch

    K = w.shape[1]
    prev = state.double() if has_init else torch.zeros(w.shape[0], K - 1, dtype=torch.float64)
    xs = torch.cat([prev, x.double().T], 1)  # [C, K-1+n]
    y = torch.stack([(xs[:, t : t + K] * w.double()).sum(1) for t in range(x.shape[0])])
    if b is not None:
        y = y + b.double()
    return torch.nn.functional.silu(y), xs[:, -(K - 1) :]


def _conv_case(query_lens, cached_lens, *, C=24, K=4, padded=12, wide=0, seed=2):
    """Run our causal conv on one batch and check every output row and state slot."""
    import torch

    from backplane.backends.triton.ssm import causal_conv
    from backplane.core.forward_context import forward_context

    torch.manual_seed(seed)
    batch = _batch(query_lens, cached_lens, 4, 12, padded=padded)
    T = batch.padded_num_tokens
    x = torch.randn(T, C + wide)[:, wide:]  # rows strided when wide > 0
    w, b = torch.randn(C, K), torch.randn(C)
    state = torch.randn(6, C, K - 1)
    before = state.clone()
    out = torch.full((T, C), float("nan"))
    with forward_context(batch):
        assert causal_conv(x, w, b, state, True, out).numel() == 0
    h = batch.host
    for i in range(batch.num_seqs):
        a, e = int(h.query_start_loc[i]), int(h.query_start_loc[i + 1])
        slot = int(h.state_slots[i])
        y, st = _conv_ref(x[a:e], w, b, before[slot], bool(h.has_initial_state[i]))
        _close(f"conv sequence {i}", out[a:e], y)
        _close(f"conv state {i}", state[slot], st, atol=0, rtol=0)
    untouched = sorted(set(range(6)) - {int(s) for s in h.state_slots})
    if not torch.equal(state[untouched], before[untouched]):
        raise AssertionError("conv touched a slot that no sequence owns")
    if not (out[batch.num_tokens :] == 0).all():
        raise AssertionError("padding rows are not zero")


def check_conv_mixed():
    """Our causal-conv kernel: prefill, extend with state, decode, short sequences, padding."""
    _conv_case([6, 2, 1, 1], [0, 5, 3, 8])


def check_conv_decode():
    """Decode-only steps take the one-launch kernel: output and shifted state, with and
    without a prior state (a one-token prompt), strided rows, padding, kernel widths 4 and 2."""
    _conv_case([1, 1, 1], [0, 5, 9], wide=5, padded=8)
    _conv_case([1, 1], [3, 7], K=2, C=70, padded=4, seed=3)


def check_ssm_decode():
    """mamba-ssm's selective_state_update through our op, slots out of order, against float64."""
    import importlib.util

    reason = _extra_paths()
    if reason or importlib.util.find_spec("mamba_ssm") is None:
        return "skip", reason or "mamba-ssm is not importable"
    import torch

    from backplane.backends.triton.ssm import TritonSSMBackend
    from backplane.core.families import SSMLayerSpec
    from backplane.core.forward_context import forward_context

    torch.manual_seed(3)
    H, P, N, G = 4, 8, 16, 2
    layer = SSMLayerSpec(0, H, P, N, G)
    batch = _batch([1, 1, 1], [5, 2, 9], 4, 12, padded=4)
    T = batch.padded_num_tokens
    x, z = torch.randn(T, H, P), torch.randn(T, H, P)
    dt = torch.randn(T, H)
    A, D, dt_bias = -torch.rand(H) - 0.5, torch.randn(H), torch.randn(H) * 0.5
    B, C = torch.randn(T, G, N), torch.randn(T, G, N)
    state = torch.randn(5, H, P, N)
    before = state.clone()
    out = torch.full((T, H, P), float("nan"))
    backend = TritonSSMBackend()
    with forward_context(batch):
        backend.scan(x, dt, A, B, C, D, dt_bias, z, state, layer, out)
    h = batch.host
    rep = H // G
    for i in range(batch.num_seqs):
        t = int(h.query_start_loc[i])
        slot = int(h.state_slots[i])
        d = torch.nn.functional.softplus(dt[t].double() + dt_bias.double())  # [H]
        s = before[slot].double()
        Bh = B[t].double().repeat_interleave(rep, 0)  # [H, N]
        Ch = C[t].double().repeat_interleave(rep, 0)
        s = (
            torch.exp(d * A.double())[:, None, None] * s
            + (d[:, None] * x[t].double())[..., None] * Bh[:, None, :]
        )
        y = (s * Ch[:, None, :]).sum(-1) + D.double()[:, None] * x[t].double()
        y = y * torch.nn.functional.silu(z[t].double())
        _close(f"ssm decode {i}", out[t], y, atol=1e-4, rtol=1e-4)
        _close(f"ssm state {i}", state[slot], s, atol=1e-4, rtol=1e-4)
    if not (out[batch.num_tokens :] == 0).all():
        raise AssertionError("padding rows are not zero")
    return "ok", ""


def _ssm_ref(x, dt, A, B, C, D, dt_bias, z, state):
    """Naive float64 Mamba2 recurrence of one sequence; returns (y, final_state)."""
    import torch

    H = x.shape[1]
    rep = H // B.shape[1]
    s = state.double().clone()
    ys = []
    for t in range(x.shape[0]):
        d = torch.nn.functional.softplus(dt[t].double() + dt_bias.double())
        Bh = B[t].double().repeat_interleave(rep, 0)
        Ch = C[t].double().repeat_interleave(rep, 0)
        xt = x[t].double()
        s = (
            torch.exp(d * A.double())[:, None, None] * s
            + (d[:, None] * xt)[..., None] * Bh[:, None, :]
        )
        y = (s * Ch[:, None, :]).sum(-1) + D.double()[:, None] * xt
        ys.append(y * torch.nn.functional.silu(z[t].double()))
    return torch.stack(ys), s


def check_ssm_mixed():
    """Chunked prefill with per-sequence initial states, plus decodes, against float64."""
    import importlib.util

    reason = _extra_paths()
    if reason or importlib.util.find_spec("mamba_ssm") is None:
        return "skip", reason or "mamba-ssm is not importable"
    import torch

    from backplane.backends.triton.ssm import TritonSSMBackend
    from backplane.core.families import SSMLayerSpec
    from backplane.core.forward_context import forward_context

    torch.manual_seed(5)
    H, P, N, G = 4, 8, 16, 2
    layer = SSMLayerSpec(0, H, P, N, G, chunk_size=8)
    batch = _batch([11, 5, 1, 1], [0, 7, 4, 2], 4, 16, padded=20)
    T = batch.padded_num_tokens
    x, z = torch.randn(T, H, P), torch.randn(T, H, P)
    dt = torch.randn(T, H)
    A, D, dt_bias = -torch.rand(H) - 0.5, torch.randn(H), torch.randn(H) * 0.5
    B, C = torch.randn(T, G, N), torch.randn(T, G, N)
    state = torch.randn(6, H, P, N)
    before = state.clone()
    out = torch.full((T, H, P), float("nan"))
    backend = TritonSSMBackend()
    with forward_context(batch, {"ssm": backend.plan(batch)}):
        backend.scan(x, dt, A, B, C, D, dt_bias, z, state, layer, out)
    h = batch.host
    for i in range(batch.num_seqs):
        a, e = int(h.query_start_loc[i]), int(h.query_start_loc[i + 1])
        slot = int(h.state_slots[i])
        init = before[slot] if h.has_initial_state[i] else torch.zeros(H, P, N)
        y, s = _ssm_ref(x[a:e], dt[a:e], A, B[a:e], C[a:e], D, dt_bias, z[a:e], init)
        _close(f"ssm sequence {i}", out[a:e], y, atol=1e-3, rtol=1e-3)
        _close(f"ssm state {i}", state[slot], s, atol=1e-3, rtol=1e-3)
    if not (out[batch.num_tokens :] == 0).all():
        raise AssertionError("padding rows are not zero")
    return "ok", ""


def _ssm_against_torch(query_lens, cached_lens, *, chunk_size, use_z, seed, H=4, P=16, N=16, G=2):
    """The Triton scan and the torch reference backend on one batch: outputs and every slot."""
    import torch

    from backplane.backends.torch.ssm import TorchSSMBackend
    from backplane.backends.triton.ssm import TritonSSMBackend
    from backplane.core.families import SSMLayerSpec
    from backplane.core.forward_context import forward_context

    torch.manual_seed(seed)
    layer = SSMLayerSpec(0, H, P, N, G, chunk_size=chunk_size)
    ps = 4
    pages = sum(-(-(q + c) // ps) for q, c in zip(query_lens, cached_lens, strict=False)) + 2
    batch = _batch(query_lens, cached_lens, ps, pages, seed=seed, padded=sum(query_lens) + 3)
    T = batch.padded_num_tokens
    x = torch.randn(T, H, P)
    z = torch.randn(T, H, P) if use_z else None
    dt = torch.randn(T, H)
    A, D, dt_bias = -torch.rand(H) - 0.5, torch.randn(H), torch.randn(H) * 0.5
    B, C = torch.randn(T, G, N), torch.randn(T, G, N)
    slots = len(query_lens) + 3
    state = torch.randn(slots, H, P, N)
    # A slot without an initial state may hold anything: NaN must not leak into the result.
    for i, cached in enumerate(cached_lens):
        if cached == 0:
            state[int(batch.host.state_slots[i])] = float("nan")
    expect_state = state.clone()
    expect = torch.full((T, H, P), float("nan"))
    with forward_context(batch):
        TorchSSMBackend().scan(x, dt, A, B, C, D, dt_bias, z, expect_state, layer, expect)
    backend = TritonSSMBackend()
    got = torch.full((T, H, P), float("nan"))
    with forward_context(batch, {"ssm": backend.plan(batch)}):
        sentinel = backend.scan(x, dt, A, B, C, D, dt_bias, z, state, layer, got)
    assert sentinel.numel() == 0
    h = batch.host
    for i in range(batch.num_seqs):
        a, e = int(h.query_start_loc[i]), int(h.query_start_loc[i + 1])
        slot = int(h.state_slots[i])
        _close(f"ssm output of sequence {i}", got[a:e], expect[a:e], atol=1e-4, rtol=1e-4)
        _close(f"ssm state of sequence {i}", state[slot], expect_state[slot], atol=1e-4, rtol=1e-4)
    untouched = sorted(set(range(slots)) - {int(s) for s in h.state_slots})
    if not torch.equal(state[untouched], expect_state[untouched]):
        raise AssertionError("the scan touched a slot that no sequence owns")
    if not (got[batch.num_tokens :] == 0).all():
        raise AssertionError("padding rows are not zero")


def check_ssm_packed():
    """Packed prefill (uneven lengths, initial states on some) plus decodes, vs the torch backend.

    Chunks of 16 tokens: sequences shorter than a chunk, several sequences inside one
    chunk, sequences starting and ending mid-chunk and spanning several chunks, a
    one-token prefill, a sequence over two token blocks of the epilogue; initial
    states (``cached > 0``) on some, NaN in the slots of the others.
    """
    import importlib.util

    reason = _extra_paths()
    if reason or importlib.util.find_spec("mamba_ssm") is None:
        return "skip", reason or "mamba-ssm is not importable"
    _ssm_against_torch(
        [1, 5, 17, 3, 40, 2, 1, 1], [0, 4, 0, 7, 9, 0, 3, 6], chunk_size=16, use_z=True, seed=6
    )
    # more than one 64-token block of the epilogue and of its d_state loop
    _ssm_against_torch([7, 70, 1], [3, 5, 0], chunk_size=16, use_z=False, seed=7, G=1, P=8, N=80)
    # every prefill sequence fresh (no initial-state correction compiled in), one decode
    _ssm_against_torch([9, 16, 4, 1], [0, 0, 0, 5], chunk_size=16, use_z=True, seed=8)
    return "ok", ""


def check_delta_decode():
    """Decode through the op (our in-place kernel, slots out of order) against float64."""
    import importlib.util

    reason = _extra_paths()
    if reason or importlib.util.find_spec("fla") is None:
        return "skip", reason or "fla is not importable"
    import torch

    from backplane.backends.triton.delta import TritonDeltaBackend
    from backplane.core.families import DeltaLayerSpec
    from backplane.core.forward_context import forward_context

    torch.manual_seed(4)
    Hk, Hv, Dk, Dv = 2, 4, 16, 16
    layer = DeltaLayerSpec(0, Hk, Hv, Dk, Dv)
    batch = _batch([1, 1, 1], [3, 7, 1], 4, 12, padded=5)
    T = batch.padded_num_tokens
    q, k = torch.randn(T, Hk, Dk), torch.randn(T, Hk, Dk)
    v = torch.randn(T, Hv, Dv)
    g = -torch.rand(T, Hv)
    beta = torch.rand(T, Hv)
    state = torch.randn(5, Hv, Dk, Dv)
    before = state.clone()
    out = torch.full((T, Hv, Dv), float("nan"))
    backend = TritonDeltaBackend()
    with forward_context(batch):
        backend.forward(q, k, v, g, beta, state, layer, out)
    h = batch.host
    rep = Hv // Hk
    for i in range(batch.num_seqs):
        t = int(h.query_start_loc[i])
        slot = int(h.state_slots[i])
        qq = torch.nn.functional.normalize(q[t].double(), dim=-1).repeat_interleave(rep, 0)
        kk = torch.nn.functional.normalize(k[t].double(), dim=-1).repeat_interleave(rep, 0)
        S = before[slot].double() * torch.exp(g[t].double())[:, None, None]
        pred = torch.einsum("hk,hkv->hv", kk, S)
        S = (
            S
            + beta[t].double()[:, None, None] * kk[:, :, None] * (v[t].double() - pred)[:, None, :]
        )
        o = torch.einsum("hk,hkv->hv", qq * layer.q_scale, S)
        _close(f"delta decode {i}", out[t], o, atol=1e-4, rtol=1e-4)
        _close(f"delta state {i}", state[slot], S, atol=1e-4, rtol=1e-4)
    if not (out[batch.num_tokens :] == 0).all():
        raise AssertionError("padding rows are not zero")
    return "ok", ""


def check_delta_decode_in_place():
    """Our decode kernel against the torch backend: slots out of order, GQA, NaN-poisoned out.

    Decode-only batches through the op (the interpreter cannot run fla's chunked
    prefill), with and without the in-kernel L2 norm, one and two value heads per
    key head, a value dimension split over two blocks; then the kernel alone on
    float16 rows that are not contiguous.
    """
    import torch

    from backplane.backends.torch.delta import TorchDeltaBackend
    from backplane.backends.triton.delta import TritonDeltaBackend
    from backplane.backends.triton.delta_decode import delta_decode
    from backplane.core.families import DeltaLayerSpec
    from backplane.core.forward_context import forward_context

    cases = [(2, 4, 16, 16, True, 9), (2, 2, 8, 48, False, 10), (1, 4, 16, 64, True, 11)]
    for hk, hv, dk, dv, l2, seed in cases:
        torch.manual_seed(seed)
        layer = DeltaLayerSpec(0, hk, hv, dk, dv, use_qk_l2norm=l2)
        batch = _batch([1, 1, 1, 1], [3, 7, 1, 12], 4, 12, seed=seed, padded=6)
        T = batch.padded_num_tokens
        q, k = torch.randn(T, hk, dk), torch.randn(T, hk, dk)
        if not l2:  # unnormalised keys: keep the update contractive
            q, k = q * dk**-0.5, k * dk**-0.5
        v = torch.randn(T, hv, dv)
        g = -torch.rand(T, hv)
        beta = torch.rand(T, hv)
        state = torch.randn(8, hv, dk, dv)
        expect_state = state.clone()
        expect = torch.full((T, hv, dv), float("nan"))
        with forward_context(batch):
            TorchDeltaBackend().forward(q, k, v, g, beta, expect_state, layer, expect)
        got = torch.full((T, hv, dv), float("nan"))
        with forward_context(batch):
            sentinel = TritonDeltaBackend().forward(q, k, v, g, beta, state, layer, got)
        assert sentinel.numel() == 0
        _close(f"delta decode outputs {seed}", got, expect, atol=1e-5, rtol=1e-5)
        _close(f"delta decode states {seed}", state, expect_state, atol=1e-5, rtol=1e-5)
        if not torch.equal(state[0], expect_state[0]) or not torch.equal(
            state[5:], expect_state[5:]
        ):
            raise AssertionError("the decode kernel touched a slot that no sequence owns")

    # float16 activations in strided rows (views of wider projections), float32 state.
    torch.manual_seed(12)
    n, hk, hv, dk, dv = 3, 2, 4, 16, 16
    qkv = torch.randn(n, hk, 3 * dk).half()
    q, k = qkv[..., :dk], qkv[..., dk : 2 * dk]
    v = torch.randn(n, hv, 2 * dv).half()[..., :dv]
    g, beta = -torch.rand(n, hv), torch.rand(n, hv)
    slots = torch.tensor([4, 1, 3], dtype=torch.int32)
    state = torch.randn(6, hv, dk, dv)
    before = state.clone()
    out = torch.full((n, hv, dv), float("nan"), dtype=torch.float16)
    delta_decode(q, k, v, g, beta, state, slots, 0.3, True, out)
    rep = hv // hk

    def l2(x):  # the reference's in-kernel norm, eps 1e-6 under the root
        x = x.double()
        return (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(rep, 0)

    for i, slot in enumerate(slots.tolist()):
        qq, kk = l2(q[i]), l2(k[i])
        s = before[slot].double() * torch.exp(g[i].double())[:, None, None]
        pred = torch.einsum("hk,hkv->hv", kk, s)
        s = s + kk[:, :, None] * (beta[i].double()[:, None] * (v[i].double() - pred))[:, None, :]
        o = torch.einsum("hk,hkv->hv", qq * 0.3, s)
        _close(f"float16 delta decode output {i}", out[i], o, atol=2e-3, rtol=2e-3)
        _close(f"float16 delta decode state {i}", state[slot], s, atol=1e-4, rtol=1e-4)
    if not torch.equal(state[[0, 2, 5]], before[[0, 2, 5]]):
        raise AssertionError("the decode kernel touched a slot it was not given")
    return "ok", ""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CHECKS, lambda name: globals()[f"check_{name}"]()))
