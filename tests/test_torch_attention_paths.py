"""The torch attention backend's SDPA prefill and vectorised decode, beyond the conformance kit.

Longer sequences than the kit's (so SDPA's block-wise CPU kernel runs over
several key blocks), SmolLM2's grouped-query shape (9 query heads on 3 KV
heads), fresh prompts next to extends with cached context, ragged decode
lengths on both sides of page boundaries, sliding windows, the decode-graph
mode (whole block table, masked slot writes), the query-chunked path other
devices take, and the slot-write helpers. Every output element is compared with
the kit's float64 reference and the cache with its expected contents; out
buffers are poisoned first.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from backplane.backends.torch import _common
from backplane.backends.torch import attention as torch_attention
from backplane.backends.torch.attention import TorchAttentionBackend
from backplane.core.families import AttentionLayerSpec
from backplane.core.forward_context import forward_context
from backplane.core.metadata import BatchMetadata, StepMode
from backplane.testing.attention import make_attention_inputs, reference_outputs
from backplane.testing.batches import BatchCase, make_case
from backplane.testing.checks import assert_close_to_reference

DTYPES = [torch.float64, torch.float32, torch.bfloat16]

CASES = {
    # one fresh prompt over many pages: the causal SDPA call on the step's own keys
    "long_prompt": make_case("long_prompt", [300], [0], page_size=16, shuffle_pages=True),
    # extends continuing mid-page and at a page boundary: gathered prefix + position mask
    "long_extend": make_case(
        "long_extend", [70, 33], [45, 128], page_size=16, shuffle_pages=True, padding=3
    ),
    # fresh prompt, extend and ragged decodes in one step
    "ragged_mixed": make_case(
        "ragged_mixed",
        [40, 17, 1, 1, 1],
        [0, 23, 60, 5, 31],
        page_size=16,
        shuffle_pages=True,
        padding=5,
    ),
    # decode lengths just below, at and just above page boundaries, plus one long
    "ragged_decode": make_case(
        "ragged_decode",
        [1] * 6,
        [1, 14, 15, 16, 47, 200],
        page_size=16,
        shuffle_pages=True,
        padding=2,
    ),
    # tiny pages: every sequence crosses many boundaries
    "small_pages": make_case(
        "small_pages", [9, 5, 1, 1], [0, 11, 6, 13], page_size=2, shuffle_pages=True
    ),
}


def _layer(num_heads: int, num_kv_heads: int, sliding_window: int = 0) -> AttentionLayerSpec:
    return AttentionLayerSpec(
        layer_id=0,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        sliding_window=sliding_window,
    )


def _run(
    case: BatchCase,
    layer: AttentionLayerSpec,
    dtype: torch.dtype,
    *,
    batch: BatchMetadata | None = None,
    plan: object = "planned",
) -> None:
    """Run one step into a poisoned out buffer; check every output row, the tail and the cache.

    ``plan`` is what the forward context holds: the backend's own plan of the
    batch by default, else the given object.
    """
    batch = batch if batch is not None else case.metadata("cpu")
    inputs = make_attention_inputs(case, layer, dtype, torch.device("cpu"), seed=3)
    out = torch.full(
        (case.padded_num_tokens, layer.num_heads, layer.head_dim), float("nan"), dtype=dtype
    )
    backend = TorchAttentionBackend()
    plans = {"attention": backend.plan(batch) if plan == "planned" else plan}
    with forward_context(batch, plans):
        ret = backend.forward(inputs.q, inputs.k, inputs.v, inputs.kv_cache, layer, out=out)
    assert ret.numel() == 0
    assert_close_to_reference(
        out[: case.num_tokens], reference_outputs(case, inputs, layer), dtype, msg=case.name
    )
    assert torch.equal(out[case.num_tokens :], torch.zeros_like(out[case.num_tokens :]))
    assert torch.equal(inputs.kv_cache, inputs.expected_cache), f"{case.name}: cache differs"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4)], ids=["gqa9x3", "mqa", "mha"])
@pytest.mark.parametrize("case_name", list(CASES))
def test_matches_reference(case_name: str, heads: tuple[int, int], dtype: torch.dtype) -> None:
    """Prefill, extend and decode match the float64 reference for every head grouping."""
    _run(CASES[case_name], _layer(*heads), dtype)


@pytest.mark.parametrize("window", [1, 7, 40])
@pytest.mark.parametrize("case_name", ["long_prompt", "long_extend", "ragged_mixed"])
def test_sliding_window(case_name: str, window: int) -> None:
    """Windowed attention through the masked SDPA paths (prefill and decode)."""
    _run(CASES[case_name], _layer(9, 3, sliding_window=window), torch.float64)


@pytest.mark.parametrize("case_name", ["ragged_decode", "ragged_mixed"])
def test_decode_graph_mode(case_name: str) -> None:
    """A decode-graph step reads the whole (wide) block table and writes slots with the mask."""
    case = CASES[case_name]
    wide = case.metadata("cpu", table_width=max(len(t) for t in case.page_tables) + 5)
    nd = case.num_decode_seqs
    batch = dataclasses.replace(wide, mode=StepMode.decode_graph(case.padded_num_tokens))
    assert _common.decode_table(batch).shape == (nd, wide.block_table.shape[1])
    assert not _common.slots_known_valid(batch)
    _run(case, _layer(9, 3), torch.float64, batch=batch)


@pytest.mark.parametrize("case_name", ["ragged_mixed", "ragged_decode"])
def test_without_or_with_a_foreign_plan(case_name: str) -> None:
    """No plan, or the plan of another batch, makes the op derive its own from the batch."""
    case = CASES[case_name]
    layer = _layer(9, 3, sliding_window=7)
    _run(case, layer, torch.float64, plan=None)
    other = CASES["small_pages"].metadata("cpu")
    _run(case, layer, torch.float64, plan=TorchAttentionBackend().plan(other))


def test_plan_shares_masks_and_skips_decode_graphs() -> None:
    """One mask per (window, dtype) for all layers of a step; a decode graph gets no plan."""
    batch = CASES["ragged_decode"].metadata("cpu")
    plan = TorchAttentionBackend().plan(batch)
    assert isinstance(plan, torch_attention.StepPlan)
    mask = plan.decode_mask(0, torch.float32)
    assert plan.decode_mask(0, torch.float32) is mask
    assert mask.shape == (6, 1, 1, plan.num_keys) and mask.dtype == torch.float32
    lens = torch.tensor([2, 15, 16, 17, 48, 201])
    allowed = torch.arange(plan.num_keys)[None, :] < lens[:, None]
    assert torch.equal(mask[:, 0, 0] == 0, allowed)
    assert torch.all(mask[:, 0, 0][~allowed] == -torch.inf)
    graph = dataclasses.replace(batch, mode=StepMode.decode_graph(batch.padded_num_tokens))
    assert TorchAttentionBackend().plan(graph) is None


def test_eager_decode_table_is_trimmed() -> None:
    """Eagerly, the decode table is cut to the pages of the longest decode sequence."""
    case = CASES["ragged_mixed"]
    batch = case.metadata("cpu", table_width=40)
    table = _common.decode_table(batch)
    assert table.shape == (3, -(-61 // 16))
    assert torch.equal(table, batch.block_table[2:5, : table.shape[1]])


@pytest.mark.parametrize("case_name", ["long_prompt", "long_extend", "ragged_mixed"])
def test_query_chunks(case_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The query-chunked prefill (taken where SDPA may build whole score matrices) is exact."""
    monkeypatch.setattr(torch_attention, "_STREAMING_DEVICES", frozenset())
    monkeypatch.setattr(_common, "MAX_SCORE_ELEMENTS", 9 * 64)
    _run(CASES[case_name], _layer(9, 3), torch.float64)
    _run(CASES[case_name], _layer(9, 3, sliding_window=5), torch.float64)


@pytest.mark.parametrize("layout", ["separate", "kv_halves", "sliced_rows"])
def test_write_slots_skips_invalid_rows(layout: str) -> None:
    """``-1`` slots leave the cache untouched; ``all_valid`` writes the same rows directly.

    ``kv_halves`` are the strided K/V views of one paged cache (written through a
    flat row view); ``sliced_rows`` have non-contiguous rows (the MLA latent
    slice), written with (page, offset) indexing.
    """
    gen = torch.Generator().manual_seed(0)

    def caches() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        if layout == "separate":
            return torch.randn(5, 4, 2, 3, generator=g), torch.randn(5, 4, 2, 3, generator=g)
        if layout == "kv_halves":
            kv = torch.randn(5, 2, 4, 2, 3, generator=g)
            return kv[:, 0], kv[:, 1]
        full = torch.randn(5, 4, 2, 5, generator=g)
        return full[..., :3], full[..., 3:]

    k_cache, v_cache = caches()
    width = v_cache.shape[-1]
    rows_k = torch.randn(4, 2, 3, generator=gen)
    rows_v = torch.randn(4, 2, width, generator=gen)
    slots = torch.tensor([5, -1, 17, 0])
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            expect_k[s // 4, s % 4], expect_v[s // 4, s % 4] = rows_k[i], rows_v[i]
    masked_k, masked_v = caches()
    _common.write_slots((masked_k, masked_v), (rows_k, rows_v), slots, 4)
    assert torch.equal(masked_k, expect_k) and torch.equal(masked_v, expect_v)
    valid = torch.tensor([0, 2, 3])
    direct_k, direct_v = caches()
    _common.write_slots(
        (direct_k, direct_v), (rows_k[valid], rows_v[valid]), slots[valid], 4, all_valid=True
    )
    assert torch.equal(direct_k, expect_k) and torch.equal(direct_v, expect_v)
    # the flat row view is taken exactly where a token's row is contiguous
    assert (_common._token_rows(direct_k) is None) == (layout == "sliced_rows")


def test_slots_known_valid() -> None:
    """True only when the step runs eagerly and no real token's slot is ``-1``."""
    batch = CASES["ragged_mixed"].metadata("cpu")
    assert _common.slots_known_valid(batch)
    host = dataclasses.replace(batch.host, slot_mapping=batch.host.slot_mapping.copy())
    host.slot_mapping[1] = -1
    assert not _common.slots_known_valid(dataclasses.replace(batch, host=host))
    graph = dataclasses.replace(batch, mode=StepMode.decode_graph(batch.padded_num_tokens))
    assert not _common.slots_known_valid(graph)
    assert np.all(batch.host.slot_mapping[batch.num_tokens :] == -1)
