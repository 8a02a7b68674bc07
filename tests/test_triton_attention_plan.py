"""The Triton attention op with and without its step plan, and its cached launch path.

Two kinds of check:

* in this process, with the kernel launches recorded instead of run: the op
  hands every kernel the same grid and arguments (constants included, in
  signature order) whether it goes through Triton's binding (the first call of
  a layout), through the cached compiled-kernel handles (later calls) or reads
  the step's facts from the backend's plan; with a plan it reads no host array
  of the batch per call;
* in a child process under ``TRITON_INTERPRET=1`` (which must be set before
  ``triton`` is imported): a mixed batch's outputs and cache are identical
  with and without the plan, and match the torch reference backend.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from interpreter_checks import interpreter_tests, main

ROOT = Path(__file__).resolve().parents[1]

CHECKS = ("mixed_float32", "mixed_float16", "mixed_window")


def _batch(query_lens: list[int], cached_lens: list[int], page_size: int, padded: int | None):
    """A batch whose page tables are shuffled and avoid the scratch page 0; returns it and its page count."""
    import numpy as np

    from backplane.core.packing import build_batch_metadata

    rng = np.random.default_rng(3)
    counts = [-(-(q + c) // page_size) for q, c in zip(query_lens, cached_lens, strict=True)]
    num_pages = sum(counts) + 2
    pages = rng.permutation(np.arange(1, num_pages))
    tables, at = [], 0
    for n in counts:
        tables.append(pages[at : at + n])
        at += n
    batch = build_batch_metadata(
        query_lens, cached_lens, tables, page_size, padded_num_tokens=padded
    )
    return batch, num_pages


def _inputs(batch: Any, num_pages: int, page_size: int, hq: int, hkv: int, d: int, dtype: Any):
    """q/k/v as head views of one projection (as the model makes them), a random cache."""
    import torch

    gen = torch.Generator().manual_seed(7)
    T = batch.padded_num_tokens
    qkv = torch.randn(T, hq + 2 * hkv, d, generator=gen).to(dtype)
    q, k, v = qkv.split((hq, hkv, hkv), dim=1)
    cache = torch.randn(num_pages, 2, page_size, hkv, d, generator=gen).to(dtype)
    return q, k, v, cache


# -- the pytest side ----------------------------------------------------------------

if __name__ != "__main__":
    import pytest

    triton = pytest.importorskip("triton", reason="triton is not installed")

    @pytest.fixture()
    def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
        """Record every attention kernel launch (kernel, grid, all arguments) instead of running it."""
        import torch

        from backplane.backends.triton import attention_launch as tri
        from backplane.core.launch import KernelLauncher

        launches: list[tuple] = []

        def describe(a: Any) -> Any:
            if isinstance(a, torch.Tensor):
                return ("tensor", a.data_ptr(), tuple(a.shape), a.stride(), a.dtype)
            return a

        class Handle:
            """Stands in for a compiled kernel: records what its launch would run."""

            run = object()  # a direct launch exists: the cached path is taken

            def __init__(self, name: str, tail: tuple) -> None:
                self.name, self.tail = name, tail

            def launch(self, g0: int, g1: int, g2: int, device: Any, *args: Any) -> None:
                launches.append(
                    (self.name, (g0, g1, g2), tuple(map(describe, (*args, *self.tail))), "cached")
                )

        def slow(self: KernelLauncher, key: Any, grid: Any, args: Any, meta: dict) -> Handle:
            tail = self._tail(len(args), meta)
            grid = (*tuple(grid), 1, 1)[:3]
            launches.append(
                (self.kernel.__name__, grid, tuple(map(describe, (*args, *tail))), "bound")
            )
            hit = Handle(self.kernel.__name__, tail)
            self._cache[key] = hit
            return None  # launched already: the caller looks the handle up next time

        monkeypatch.setattr(KernelLauncher, "_slow", slow)
        for launcher in (tri._PREFILL, tri._DECODE, tri._KV_APPEND):
            monkeypatch.setattr(launcher, "_always_slow", False)
            monkeypatch.setattr(launcher, "_cache", {})
        return launches

    def _mixed() -> tuple:
        """An extend with cached keys, a fresh prompt and three decodes, padded."""
        return _batch([9, 5, 1, 1, 1], [6, 0, 13, 30, 2], 4, padded=20)

    def _run(batch: Any, inputs: tuple, plans: dict, out: Any) -> None:
        import torch

        from backplane.backends.triton.attention import TritonAttentionBackend
        from backplane.core.families import AttentionLayerSpec
        from backplane.core.forward_context import forward_context

        q, k, v, cache = inputs
        layer = AttentionLayerSpec(0, q.shape[1], k.shape[1], q.shape[2])
        with torch.inference_mode(), forward_context(batch, plans):
            TritonAttentionBackend().forward(q, k, v, cache, layer, out)

    @pytest.mark.parametrize(
        ("head_dim", "dtype", "keys"),
        [(128, "bfloat16", 64), (64, "bfloat16", 128), (128, "float32", 32), (256, "float16", 32)],
    )
    def test_the_tile_read_before_the_wait_keeps_to_its_register_budget(head_dim, dtype, keys):
        """A decode layout that appends this step's rows reads a first tile of at most 32 KiB of
        keys and values before its wait, and splits contexts into that many keys, at a
        few sequences only (here the interpreter's device holds 8 programs: one sequence
        of 2 KV heads in 4 splits); MLA's two-part keys and layouts without the step's
        rows read none."""
        import torch

        from backplane.backends.triton import attention_launch as tri
        from backplane.backends.triton.attention_configs import EARLY_TILE_BYTES, KEYS_PER_SPLIT

        dt = getattr(torch, dtype)
        q, out = torch.zeros(4, 8, head_dim, dtype=dt), torch.zeros(4, 8, head_dim, dtype=dt)
        planes = torch.zeros(2, 6, 16, 2, head_dim, dtype=dt)
        rows = torch.zeros(4, 2, head_dim, dtype=dt)
        table = torch.zeros(4, 6, dtype=torch.int32)
        kw = dict(scale=0.1, group=4)
        layout = tri.decode_layout(
            q, planes[0], planes[1], out, table, 16, k_new=rows, v_new=rows, **kw
        )
        assert layout.early == keys and keys * 2 * head_dim * dt.itemsize <= EARLY_TILE_BYTES
        assert layout.early_launch(1) and layout.split_keys(1) == keys
        assert not layout.early_launch(2) and layout.split_keys(2) == KEYS_PER_SPLIT
        no_rows = tri.decode_layout(q, planes[0], planes[1], out, table, 16, **kw)
        assert no_rows.early == 0 and not no_rows.early_launch(1)
        assert no_rows.split_keys(1) == KEYS_PER_SPLIT
        q_pe = torch.zeros(4, 8, 16, dtype=dt)
        mla = tri.decode_layout(
            q, planes[0], planes[1], out, table, 16, q_pe=q_pe, kpe_plane=planes[0, ..., :16],
            k_new=rows, v_new=rows, **kw,
        )  # fmt: skip
        assert mla.early == 0

    def test_cached_launches_match_bound_ones_with_and_without_plan(recorded):
        """First call (Triton binds), later calls (cached handles) and planned calls launch alike."""
        import torch

        from backplane.backends.triton.attention import TritonAttentionBackend

        batch, pages = _mixed()
        inputs = _inputs(batch, pages, 4, 8, 2, 16, torch.float32)
        out = torch.empty(batch.padded_num_tokens, 8, 16)
        plan = TritonAttentionBackend().plan(batch)
        calls = []
        for plans in ({}, {}, {"attention": plan}, {"attention": plan}):
            recorded.clear()
            _run(batch, inputs, plans, out)
            calls.append(list(recorded))
        assert [c[3] for c in calls[0]] == ["bound", "bound"]
        assert [c[3] for c in calls[1]] == ["cached", "cached"]
        assert [c[3] for c in calls[3]] == ["cached", "cached"]
        first = [c[:3] for c in calls[0]]
        assert [c[0] for c in calls[0]] == ["_prefill_kernel", "_decode_kernel"]
        for later in calls[1:]:
            assert [c[:3] for c in later] == first

    def test_grid_and_facts_come_from_the_batch(recorded):
        """The launches' grids: heads x query blocks x prefill sequences; decodes x programs x splits."""
        import numpy as np
        import torch

        from backplane.backends.triton.attention import TritonAttentionBackend
        from backplane.backends.triton.attention_configs import choose_num_splits

        batch, pages = _mixed()
        inputs = _inputs(batch, pages, 4, 8, 2, 16, torch.float32)
        out = torch.empty(batch.padded_num_tokens, 8, 16)
        plan = TritonAttentionBackend().plan(batch)
        _run(batch, inputs, {"attention": plan}, out)
        (_, pgrid, pargs, _), (_, dgrid, dargs, _) = recorded
        h = batch.host
        n = int(batch.num_prefill_seqs)
        assert plan.prefill.max_q == int(np.max(h.query_lens[:n])) == 9
        assert plan.prefill.any_cached is True
        # tiny class: BLOCK_M = 32 -> one query block per (head, sequence)
        assert pgrid == (8, 1, 2)
        # 2 kv heads x 1 head block per split; the split count as chosen from scratch
        splits = choose_num_splits(batch, 2, batch.device)
        assert dgrid == (3, 2, splits)
        assert plan.num_splits(2) == splits

    def test_plan_means_no_host_array_reads(recorded):
        """With the step's plan the op reads none of the batch's host arrays (after the first call)."""
        import torch

        from backplane.backends.triton.attention import TritonAttentionBackend

        batch, pages = _mixed()
        inputs = _inputs(batch, pages, 4, 8, 2, 16, torch.float32)
        out = torch.empty(batch.padded_num_tokens, 8, 16)
        plan = TritonAttentionBackend().plan(batch)
        _run(batch, inputs, {"attention": plan}, out)
        expected = list(recorded)
        recorded.clear()

        class NoHost:
            def __getattr__(self, name: str) -> Any:
                raise AssertionError(f"the op read batch.host.{name} although it had a plan")

        host, batch.host = batch.host, NoHost()
        try:
            _run(batch, inputs, {"attention": plan}, out)
        finally:
            batch.host = host
        assert [c[:3] for c in recorded] == [c[:3] for c in expected]

    def test_plan_of_another_batch_is_ignored(recorded):
        """A plan made for another batch does not leak its facts into this step's launches."""
        import torch

        from backplane.backends.triton.attention import TritonAttentionBackend

        batch, pages = _mixed()
        other, _ = _batch([40, 1], [0, 3], 4, padded=None)
        inputs = _inputs(batch, pages, 4, 8, 2, 16, torch.float32)
        out = torch.empty(batch.padded_num_tokens, 8, 16)
        _run(batch, inputs, {}, out)
        expected = [c[:3] for c in recorded]
        recorded.clear()
        _run(batch, inputs, {"attention": TritonAttentionBackend().plan(other)}, out)
        assert [c[:3] for c in recorded] == expected

    interpret_results, test_mixed_batch_in_interpreter = interpreter_tests(__file__, CHECKS)


# -- the child side -------------------------------------------------------------------


def _mixed_case(dtype_name: str, window: int, atol: float) -> None:
    """One mixed step three ways: no plan, the Triton plan, the torch backend."""
    import torch

    from backplane.backends.torch.attention import TorchAttentionBackend
    from backplane.backends.triton.attention import TritonAttentionBackend
    from backplane.core.families import AttentionLayerSpec
    from backplane.core.forward_context import forward_context

    dtype = getattr(torch, dtype_name)
    hq, hkv, d, page_size = 4, 2, 32, 4
    batch, pages = _batch([7, 12, 1, 1, 1, 1], [5, 0, 9, 22, 3, 17], page_size, padded=28)
    q, k, v, cache0 = _inputs(batch, pages, page_size, hq, hkv, d, dtype)
    layer = AttentionLayerSpec(0, hq, hkv, d, sliding_window=window)
    T = batch.padded_num_tokens
    triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    results = {}
    for name, backend, planned in (
        ("no plan", triton_backend, False),
        ("plan", triton_backend, True),
        ("torch", torch_backend, True),
    ):
        cache = cache0.clone()
        out = torch.full((T, hq, d), float("nan"), dtype=dtype)
        plans = {"attention": backend.plan(batch)} if planned else {}
        with forward_context(batch, plans):
            sentinel = backend.forward(q, k, v, cache, layer, out)
        assert sentinel.numel() == 0
        results[name] = (out, cache)
    n = batch.num_tokens
    for a, b in (("no plan", "plan"),):
        if not torch.equal(results[a][0], results[b][0]):
            raise AssertionError(f"outputs differ between the {a} and {b} steps")
        if not torch.equal(results[a][1], results[b][1]):
            raise AssertionError(f"caches differ between the {a} and {b} steps")
    got, ref = results["plan"][0][:n].double(), results["torch"][0][:n].double()
    err = (got - ref).abs().max().item()
    if not err <= atol:
        raise AssertionError(f"outputs differ from the torch backend by {err:.3g} (> {atol})")
    if not torch.equal(results["plan"][1], results["torch"][1]):
        raise AssertionError("the KV cache differs from the torch backend's append")
    if not (results["plan"][0][n:] == 0).all():
        raise AssertionError("padding rows of out are not zero")


def check_mixed_float32() -> None:
    """float32, full causal attention."""
    _mixed_case("float32", 0, 1e-4)


def check_mixed_float16() -> None:
    """float16, full causal attention."""
    _mixed_case("float16", 0, 4e-3)


def check_mixed_window() -> None:
    """float32 with a sliding window shorter than most contexts."""
    _mixed_case("float32", 6, 1e-4)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CHECKS, lambda name: globals()[f"check_{name}"]()))
