"""The Triton attention kernels' e4m3 key and value tiles read as int32 words, on a GPU.

With 16-bit queries on a GPU the decode and prefill kernels read an FP8
cache's key and value tiles as int32 words and widen them to float16 in
registers (``KV_FP8 == 2``, ``_e4m3_rows_to_f16``); elsewhere Triton widens
the 8-bit tiles itself (``KV_FP8 == 1``). The two launches must agree to the
output's rounding, and both match a float64 reference over the dequantised
cache. Run with ``python -m pytest -m gpu tests/test_fp8_kv_words_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

PAGE = 16
KV_HEADS = 2
GROUP = 4
K_SCALE, V_SCALE = 0.05, 0.03


@pytest.fixture(autouse=True)
def _needs_e4m3() -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 conversions need compute capability 8.9 or newer")
    pytest.importorskip("triton")


def _case(query: list[int], cached: list[int], head_dim: int, dtype: torch.dtype):
    from backplane.core.packing import build_batch_metadata

    gen = torch.Generator(device="cuda").manual_seed(sum(query) * 31 + sum(cached) + head_dim)
    tables, nxt = [], 1
    for q, c in zip(query, cached, strict=True):
        need = -(-(q + c) // PAGE)
        # pages out of order, as a pool hands them out
        tables.append(list(reversed(range(nxt, nxt + need))))
        nxt += need
    batch = build_batch_metadata(
        query, cached, tables, PAGE, state_slots=list(range(1, len(query) + 1)), device="cuda"
    )
    t = batch.padded_num_tokens

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen)

    cache = torch.empty(nxt, 2, PAGE, KV_HEADS, head_dim, device="cuda")
    cache[:, 0] = rnd(nxt, PAGE, KV_HEADS, head_dim) / K_SCALE
    cache[:, 1] = rnd(nxt, PAGE, KV_HEADS, head_dim) / V_SCALE
    cache = cache.clamp(-448, 448).to(torch.float8_e4m3fn)
    q = rnd(t, KV_HEADS * GROUP, head_dim).to(dtype)
    return batch, tables, q, cache


def _reference(batch, tables, q, cache, query, cached, causal_from) -> torch.Tensor:
    """float64 attention of every query row over the dequantised pages."""
    head_dim = q.shape[-1]
    k = cache[:, 0].double() * K_SCALE
    v = cache[:, 1].double() * V_SCALE
    out = torch.zeros(q.shape, dtype=torch.float64, device="cuda")
    row = 0
    for n, (ql, c) in enumerate(zip(query, cached, strict=True)):
        pages = torch.tensor(tables[n], device="cuda")
        keys = k[pages].reshape(-1, KV_HEADS, head_dim)[: ql + c]
        vals = v[pages].reshape(-1, KV_HEADS, head_dim)[: ql + c]
        for i in range(ql):
            visible = c + i + 1 if causal_from else ql + c
            qi = q[row + i].double().view(KV_HEADS, GROUP, head_dim)
            s = torch.einsum("hgd,nhd->hgn", qi, keys[:visible]) * head_dim**-0.5
            p = torch.softmax(s, dim=-1)
            out[row + i] = torch.einsum("hgn,nhd->hgd", p, vals[:visible]).reshape(-1, head_dim)
        row += ql
    return out


def _run(monkeypatch, mode: int | None, launch) -> torch.Tensor:
    """``launch()``'s output with the value-tile mode forced to ``mode`` (``None``: as chosen)."""
    from backplane.backends.triton import attention_launch as al

    monkeypatch.setattr(al, "_DECODE_LAYOUTS", {})
    if hasattr(al, "_PREFILL_LAYOUTS"):
        monkeypatch.setattr(al, "_PREFILL_LAYOUTS", {})
    if mode is not None:
        real = al._kv_fp8_mode
        monkeypatch.setattr(al, "_kv_fp8_mode", lambda *args: min(real(*args), mode))
    out = launch()
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_value_words_match_triton_widening(monkeypatch, head_dim, dtype, splits) -> None:
    from backplane.backends.triton import attention_launch as al

    # every sequence has a cached key: one without any would be a prompt, not a decode
    cached = [1, 5, 16, 300]
    query = [1] * len(cached)
    batch, tables, q, cache = _case(query, cached, head_dim, dtype)
    assert al._kv_fp8_mode(q, cache[:, 0], cache[:, 1], head_dim, head_dim) == 2

    def launch() -> torch.Tensor:
        out = torch.full_like(q, float("nan"))
        al.paged_decode(
            batch, q, cache[:, 0], cache[:, 1], out, scale=head_dim**-0.5, group=GROUP,
            k_scale=K_SCALE, v_scale=V_SCALE, num_splits=splits,
        )  # fmt: skip
        return out

    words = _run(monkeypatch, None, launch)
    widened = _run(monkeypatch, 1, launch)
    assert not words.isnan().any()
    # the same float16 tiles meet the same products: equal up to the order of the
    # products' sums, a unit in the output's last place at most
    torch.testing.assert_close(words.double(), widened.double(), atol=1e-2, rtol=1e-2)
    ref = _reference(batch, tables, q, cache, query, cached, causal_from=True)
    torch.testing.assert_close(words.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_value_words_match_triton_widening(monkeypatch, head_dim) -> None:
    from backplane.backends.triton import attention_launch as al

    cached = [40, 0, 129]
    query = [7, 33, 70]
    batch, tables, q, cache = _case(query, cached, head_dim, torch.bfloat16)

    def launch() -> torch.Tensor:
        out = torch.full_like(q, float("nan"))
        al.paged_prefill(
            batch, q, cache[:, 0], cache[:, 1], out, scale=head_dim**-0.5, group=GROUP,
            k_scale=K_SCALE, v_scale=V_SCALE,
        )  # fmt: skip
        return out

    words = _run(monkeypatch, None, launch)
    widened = _run(monkeypatch, 1, launch)
    assert not words.isnan().any()
    ref = _reference(batch, tables, q, cache, query, cached, causal_from=True)
    # The prefill widens keys and values to the queries' dtype (bfloat16) with Triton
    # and to float16 as words: the probabilities meet a float16 tile instead, so the
    # two agree to the bfloat16 output's rounding (a unit in the last place), not bit
    # for bit.
    torch.testing.assert_close(words.double(), widened.double(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(words.double(), ref, atol=2e-2, rtol=2e-2)
