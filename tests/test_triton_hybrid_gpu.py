"""The Triton hybrid ops at realistic shapes on a CUDA GPU, against the torch reference backends.

* SSM: Nemotron-H's Mamba2 shapes (64-dim heads, d_state 128, 8 groups, chunks
  of 128 tokens) over a packed prefill with very uneven lengths (1 to 1000
  tokens, several inside one chunk, most not on chunk boundaries), initial
  states on some sequences and NaN in the slots of the others, plus decodes.
* Delta decode: Qwen3-Next's gated-delta shapes (16 key heads, 32 value heads,
  128-dim heads), slots out of order, NaN-poisoned outputs, and a CUDA-graph
  capture of the in-place kernel replayed on new inputs.

Both compare every output row and every state slot (untouched slots must be
bit-identical) with the torch backends computing in float32.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from backplane.core.families import DeltaLayerSpec, SSMLayerSpec
from backplane.core.forward_context import forward_context
from backplane.core.packing import build_batch_metadata
from backplane.testing.checks import assert_close_to_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="triton is not installed"
    ),
]

DEV = torch.device("cuda")


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


def _batch(query_lens: list[int], cached_lens: list[int], seed: int, num_slots: int):
    """A batch with shuffled slots (never the scratch slot 0), pages of 16 tokens."""
    rng = np.random.default_rng(seed)
    tables, at = [], 1
    for q, c in zip(query_lens, cached_lens, strict=True):
        n = -(-(q + c) // 16)
        tables.append(list(range(at, at + n)))
        at += n
    slots = rng.permutation(np.arange(1, num_slots))[: len(query_lens)]
    return build_batch_metadata(
        query_lens,
        cached_lens,
        tables,
        16,
        state_slots=slots,
        padded_num_tokens=sum(query_lens) + 5,
        device=DEV,
    )


def _check_states(state: torch.Tensor, expect: torch.Tensor, batch, dtype: torch.dtype) -> None:
    owned = {int(s) for s in batch.host.state_slots}
    for slot in range(state.shape[0]):
        if slot in owned:
            assert_close_to_reference(state[slot], expect[slot], dtype, msg=f"slot {slot}")
        elif not torch.equal(state[slot], expect[slot]):
            raise AssertionError(f"slot {slot} belongs to no sequence but was written")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("use_z", [True, False], ids=["z", "no_z"])
def test_ssm_packed_prefill_nemotron_h(dtype: torch.dtype, use_z: bool) -> None:
    """Packed prefill + decode at Nemotron-H's Mamba2 shapes against the torch backend."""
    _needs("mamba_ssm")
    _needs("einops")
    from backplane.backends.torch.ssm import TorchSSMBackend
    from backplane.backends.triton.ssm import TritonSSMBackend

    H, P, N, G, chunk = 32, 64, 128, 8, 128
    layer = SSMLayerSpec(0, H, P, N, G, chunk_size=chunk)
    query_lens = [1, 37, 1000, 5, 129, 300, 2, 64, 1, 1, 1]
    cached_lens = [0, 0, 60, 0, 17, 0, 9, 3, 20, 7, 300]
    batch = _batch(query_lens, cached_lens, seed=0, num_slots=16)
    T = batch.padded_num_tokens
    gen = torch.Generator(DEV).manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    x, B, C = rnd(T, H, P), rnd(T, G, N, scale=0.3), rnd(T, G, N, scale=0.3)
    z = rnd(T, H, P) if use_z else None
    dt = rnd(T, H, scale=0.5) - 1
    A = -torch.exp(torch.randn(H, generator=gen, device=DEV) * 0.5)
    D, dt_bias = torch.randn(H, generator=gen, device=DEV), torch.randn(H, device=DEV) * 0.1
    state = torch.randn(16, H, P, N, generator=gen, device=DEV) * 0.5
    for i, cached in enumerate(cached_lens):
        if cached == 0:  # no initial state: the slot may hold anything
            state[int(batch.host.state_slots[i])] = float("nan")
    expect_state = state.clone()
    expect = torch.full((T, H, P), float("nan"), device=DEV, dtype=dtype)
    with forward_context(batch):
        TorchSSMBackend().scan(x, dt, A, B, C, D, dt_bias, z, expect_state, layer, expect)
    backend = TritonSSMBackend()
    got = torch.full((T, H, P), float("nan"), device=DEV, dtype=dtype)
    with forward_context(batch, {"ssm": backend.plan(batch)}):
        backend.scan(x, dt, A, B, C, D, dt_bias, z, state, layer, got)
    n = batch.num_tokens
    assert_close_to_reference(got[:n], expect[:n].float(), dtype, msg="outputs")
    assert torch.equal(got[n:], torch.zeros_like(got[n:])), "padding rows are not zero"
    _check_states(state, expect_state, batch, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "no_l2norm"])
def test_delta_decode_qwen3_next(dtype: torch.dtype, l2norm: bool) -> None:
    """The in-place decode kernel through the op at Qwen3-Next's shapes against torch."""
    _needs("fla")
    from backplane.backends.torch.delta import TorchDeltaBackend
    from backplane.backends.triton.delta import TritonDeltaBackend

    hk, hv, dk, dv, seqs = 16, 32, 128, 128, 48
    layer = DeltaLayerSpec(0, hk, hv, dk, dv, use_qk_l2norm=l2norm)
    batch = _batch([1] * seqs, list(range(3, 3 + seqs)), seed=1, num_slots=64)
    T = batch.padded_num_tokens
    gen = torch.Generator(DEV).manual_seed(1)
    q = torch.randn(T, hk, dk, generator=gen, device=DEV)
    k = torch.randn(T, hk, dk, generator=gen, device=DEV)
    if not l2norm:  # unit-scale keys keep the update contractive
        q, k = q * dk**-0.5, k * dk**-0.5
    q, k = q.to(dtype), k.to(dtype)
    v = torch.randn(T, hv, dv, generator=gen, device=DEV).to(dtype)
    g = -torch.rand(T, hv, generator=gen, device=DEV).to(dtype)
    beta = torch.rand(T, hv, generator=gen, device=DEV).to(dtype)
    state = torch.randn(64, hv, dk, dv, generator=gen, device=DEV) * 0.3
    expect_state = state.clone()
    expect = torch.full((T, hv, dv), float("nan"), device=DEV, dtype=dtype)
    with forward_context(batch):
        TorchDeltaBackend().forward(q, k, v, g, beta, expect_state, layer, expect)
    got = torch.full((T, hv, dv), float("nan"), device=DEV, dtype=dtype)
    with forward_context(batch):
        TritonDeltaBackend().forward(q, k, v, g, beta, state, layer, got)
    assert_close_to_reference(got, expect.float(), dtype, msg="outputs")
    _check_states(state, expect_state, batch, torch.float32)


def test_delta_decode_cuda_graph() -> None:
    """The decode kernel captured in a CUDA graph replays correctly on new inputs and states."""
    from backplane.backends.torch.delta import TorchDeltaBackend
    from backplane.backends.triton.delta_decode import delta_decode

    hk, hv, dk, dv, seqs = 16, 32, 128, 128, 8
    layer = DeltaLayerSpec(0, hk, hv, dk, dv)
    batch = _batch([1] * seqs, [5] * seqs, seed=2, num_slots=12)
    slots = batch.state_slots[:seqs]
    q = torch.randn(seqs, hk, dk, device=DEV)
    k, v = torch.randn_like(q), torch.randn(seqs, hv, dv, device=DEV)
    g, beta = -torch.rand(seqs, hv, device=DEV), torch.rand(seqs, hv, device=DEV)
    state = torch.randn(12, hv, dk, dv, device=DEV) * 0.3
    out = torch.empty(seqs, hv, dv, device=DEV)

    def step() -> None:
        delta_decode(q, k, v, g, beta, state, slots, layer.q_scale, True, out)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator(DEV).manual_seed(3)
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, generator=gen, device=DEV))
    g.copy_(-torch.rand(g.shape, generator=gen, device=DEV))
    state.copy_(torch.randn(state.shape, generator=gen, device=DEV) * 0.3)
    expect_state = state.clone()
    expect = torch.empty(batch.padded_num_tokens, hv, dv, device=DEV)
    pad = batch.padded_num_tokens - seqs

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])

    with forward_context(batch):
        TorchDeltaBackend().forward(
            padded(q), padded(k), padded(v), padded(g), padded(beta), expect_state, layer, expect
        )
    out.fill_(float("nan"))
    graph.replay()
    assert_close_to_reference(out, expect[:seqs], torch.float32, msg="replayed outputs")
    _check_states(state, expect_state, batch, torch.float32)
