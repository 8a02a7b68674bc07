"""Recurrent states of speculative verification: the state after every chunk position, one kept.

A verifying sequence runs a chunk of ``d + 1`` tokens; after acceptance its
conv and SSM / delta states must be those after chunk position ``j`` only. The
checks run a verification step (with ``batch.verify_states``), keep position
``j`` per sequence, then decode on, against the naive float64 one-token-at-a-
time references of the conformance kit (ops) and against the same model fed
the first ``j + 1`` chunk tokens one decode step at a time (whole models).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from backplane.core.families import ConvLayerSpec, DeltaLayerSpec, SSMLayerSpec
from backplane.core.forward_context import forward_context, plan_step
from backplane.core.metadata import NULL_SLOT, BatchMetadata, VerifyStates
from backplane.core.packing import build_batch_metadata
from backplane.core.registry import get_registry
from backplane.models.base import CausalLM, ModelConfig, build_model
from backplane.models.presets import PRESETS
from backplane.models.registry import model_class
from backplane.testing.delta import reference_gated_delta_rule
from backplane.testing.plugin import load_backend
from backplane.testing.recurrent import single_sequence_batch
from backplane.testing.ssm import reference_causal_conv1d, reference_ssm_scan

PAGE_SIZE = 16
#: chunk lengths (proposals + 1) of the verifying sequences of the op checks
CHUNKS = (4, 4, 3)
#: accepted proposals per verifying sequence: none, all, and mixed
KEEPS = [(0, 0, 0), (3, 3, 2), (1, 3, 0), (2, 0, 1)]
CACHED = 6
PREFILL = 5


def _torch_backend(family: str) -> Any:
    return load_backend(get_registry().get(family, "torch"))


def _verify_batch(chunks: tuple[int, ...], device: str = "cpu") -> tuple[BatchMetadata, int]:
    """A plain prefill, the verifying extends of ``chunks`` and a plain decode, one batch.

    Own slots are ``1 .. S``; the scratch slots follow them.

    :return: ``(batch with verify_states, number of state slots)``.
    """
    query = [PREFILL, *chunks, 1]
    cached = [0, *[CACHED] * len(chunks), CACHED]
    n = len(query)
    batch = build_batch_metadata(
        query,
        cached,
        [[i + 1] for i in range(n)],
        PAGE_SIZE,
        state_slots=list(range(1, n + 1)),
        device=device,
    )
    width = max(chunks)
    scratch = np.arange(n + 1, n + 1 + len(chunks) * width).reshape(len(chunks), width)
    batch.verify_states = VerifyStates.build(
        batch.host, np.arange(1, 1 + len(chunks)), scratch, device
    )
    return batch, n + 1 + scratch.size


def _state(num_slots: int, *shape: int, gen: torch.Generator) -> torch.Tensor:
    """Random states; the slots no sequence starts from hold NaN, so reading one shows."""
    s = torch.randn(num_slots, *shape, generator=gen) * 0.5
    s[0] = float("nan")
    return s


def _seq_rows(batch: BatchMetadata, i: int, count: int | None = None) -> slice:
    start = int(batch.host.query_start_loc[i])
    end = int(batch.host.query_start_loc[i + 1]) if count is None else start + count
    return slice(start, end)


def _f64(t: torch.Tensor) -> torch.Tensor:
    """A float64 CPU copy, to compare with the references."""
    return t.double().cpu()


def _keep(batch: BatchMetadata, keep: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    assert batch.verify_states is not None
    return batch.verify_states.keep_slots(torch.tensor(keep))


# -- Mamba2: conv and scan ------------------------------------------------------------------


@pytest.mark.parametrize("keep", KEEPS, ids=lambda k: "-".join(map(str, k)))
def test_mamba2_verify_keep_then_decode_matches_the_accepted_tokens_alone(keep):
    """Conv and SSM states after keeping position ``j`` equal the states after ``j + 1`` tokens,
    the next decode step's outputs those of the reference, and the plain sequences of the
    verification step are untouched by it."""
    check_mamba2(_torch_backend("ssm"), keep)


def check_mamba2(backend: Any, keep: tuple[int, ...], device: str = "cpu") -> None:
    """Run the Mamba2 verification check on one SSM backend (the Triton one runs it too).

    :param backend: the SSM backend under test.
    :param keep: the position to keep per verifying sequence of :data:`CHUNKS`.
    :param device: where the batch, the inputs and the states live.
    """
    gen = torch.Generator().manual_seed(sum(keep))
    H, P, N, G, K = 4, 8, 8, 2, 4
    C = H * P  # the conv output feeds the scan as x
    batch, num_slots = _verify_batch(CHUNKS, device)
    T = batch.num_tokens
    conv0, ssm0 = _state(num_slots, C, K - 1, gen=gen), _state(num_slots, H, P, N, gen=gen)
    conv_state, ssm_state = conv0.to(device, copy=True), ssm0.to(device, copy=True)
    weight, bias = torch.randn(C, K, generator=gen) * 0.5, torch.randn(C, generator=gen) * 0.1
    A = -torch.rand(H, generator=gen) - 0.5
    D, dt_bias = torch.randn(H, generator=gen), torch.randn(H, generator=gen) * 0.1
    weight, bias, A, D, dt_bias = (t.to(device) for t in (weight, bias, A, D, dt_bias))
    conv_spec = ConvLayerSpec(layer_id=0, conv_dim=C, kernel_size=K)
    scan_spec = SSMLayerSpec(layer_id=0, nheads=H, head_dim=P, d_state=N, n_groups=G, chunk_size=16)

    def run(b: BatchMetadata, x: torch.Tensor, dt: torch.Tensor, B, Cm) -> tuple[torch.Tensor, ...]:
        with forward_context(b, {"ssm": backend.plan(b)}):
            y_conv = backend.conv(x, weight, bias, conv_state, conv_spec)
            y = backend.scan(y_conv.view(-1, H, P), dt, A, B, Cm, D, dt_bias, None, ssm_state,
                             scan_spec)  # fmt: skip
        return y_conv, y

    x = torch.randn(T, C, generator=gen).to(device)
    dt = torch.randn(T, H, generator=gen).to(device)
    B, Cm = (torch.randn(T, G, N, generator=gen).to(device) for _ in range(2))
    # the conv output feeds the scan as x (a Mamba2 layer splits it; one tensor will do)
    conv_out, y = run(batch, x, dt, B, Cm)

    # the verification step itself is an ordinary step: every output and the plain sequences'
    # final states are those of the float64 reference
    ref_conv_out, ref_conv = reference_causal_conv1d(batch, x, weight, bias, conv0, "silu")
    ref_y, ref_ssm = reference_ssm_scan(
        batch, conv_out.view(-1, H, P), dt, A, B, Cm, D, dt_bias, None, ssm0, True
    )
    torch.testing.assert_close(_f64(conv_out), ref_conv_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_f64(y), ref_y, atol=1e-4, rtol=1e-4)
    for slot in (1, len(CHUNKS) + 2):  # the plain prefill and the plain decode
        torch.testing.assert_close(_f64(conv_state[slot]), ref_conv[slot])
        torch.testing.assert_close(_f64(ssm_state[slot]), ref_ssm[slot], atol=1e-4, rtol=1e-4)

    src, dst = _keep(batch, keep)
    backend.copy_state_slots(conv_state, src, dst)
    backend.copy_state_slots(ssm_state, src, dst)

    # reference: only the first j + 1 chunk tokens, one at a time, then one decode token
    nxt = torch.randn(4, C, generator=gen).to(device), torch.randn(4, H, generator=gen).to(device)
    nxt_b, nxt_c = (torch.randn(4, G, N, generator=gen).to(device) for _ in range(2))
    for v, j in enumerate(keep):
        i, slot = v + 1, v + 2
        rows = _seq_rows(batch, i, j + 1)
        only = single_sequence_batch(j + 1, CACHED, slot, torch.device(device), padding=0)
        c_out, c_ref = reference_causal_conv1d(only, x[rows], weight, bias, conv0, "silu")
        _, s_ref = reference_ssm_scan(
            only, c_out.float().to(device).view(-1, H, P), dt[rows], A, B[rows], Cm[rows], D, dt_bias,
            None, ssm0, True,
        )  # fmt: skip
        torch.testing.assert_close(_f64(conv_state[slot]), c_ref[slot], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(_f64(ssm_state[slot]), s_ref[slot], atol=1e-4, rtol=1e-4)

        dec = single_sequence_batch(1, CACHED + j + 1, slot, torch.device(device), padding=0)
        got_conv, got_y = run(dec, nxt[0][v : v + 1], nxt[1][v : v + 1], nxt_b[v : v + 1],
                              nxt_c[v : v + 1])  # fmt: skip
        want_conv, _ = reference_causal_conv1d(dec, nxt[0][v : v + 1], weight, bias, c_ref, "silu")
        want_y, _ = reference_ssm_scan(
            dec, got_conv.view(-1, H, P), nxt[1][v : v + 1], A, nxt_b[v : v + 1],
            nxt_c[v : v + 1], D, dt_bias, None, s_ref, True,
        )  # fmt: skip
        torch.testing.assert_close(_f64(got_conv), want_conv, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(_f64(got_y), want_y, atol=1e-4, rtol=1e-4)


# -- gated delta rule ------------------------------------------------------------------------


def _delta_inputs(T: int, gen: torch.Generator, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6):
    q, k = torch.randn(T, hk, dk, generator=gen), torch.randn(T, hk, dk, generator=gen)
    v = torch.randn(T, hv, dv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(T, hv, generator=gen))
    beta = torch.sigmoid(torch.randn(T, hv, generator=gen))
    return q, k, v, g, beta


@pytest.mark.parametrize("keep", KEEPS, ids=lambda k: "-".join(map(str, k)))
def test_delta_verify_keep_then_decode_matches_the_accepted_tokens_alone(keep):
    """The delta-rule state after keeping position ``j`` equals the state after ``j + 1``
    tokens, and the next decode token's output that of the float64 reference."""
    check_delta(_torch_backend("delta"), keep)


def check_delta(backend: Any, keep: tuple[int, ...], device: str = "cpu") -> None:
    """Run the delta-rule verification check on one delta backend (the Triton one runs it too).

    :param backend: the delta backend under test.
    :param keep: the position to keep per verifying sequence of :data:`CHUNKS`.
    :param device: where the batch, the inputs and the state live.
    """
    gen = torch.Generator().manual_seed(10 + sum(keep))
    hk, hv, dk, dv = 2, 4, 8, 6
    spec = DeltaLayerSpec(layer_id=0, num_k_heads=hk, num_v_heads=hv, k_head_dim=dk, v_head_dim=dv)
    batch, num_slots = _verify_batch(CHUNKS, device)
    state0 = _state(num_slots, hv, dk, dv, gen=gen)
    state = state0.to(device, copy=True)
    q, k, v, g, beta = (t.to(device) for t in _delta_inputs(batch.num_tokens, gen))

    def run(b: BatchMetadata, *inputs: torch.Tensor) -> torch.Tensor:
        with forward_context(b, {"delta": backend.plan(b)}):
            return backend.forward(*inputs, state, spec)

    o = run(batch, q, k, v, g, beta)
    ref_o, ref_state = reference_gated_delta_rule(
        batch, q, k, v, g, beta, state0, spec.q_scale, True
    )
    torch.testing.assert_close(_f64(o), ref_o, atol=1e-4, rtol=1e-4)
    for slot in (1, len(CHUNKS) + 2):
        torch.testing.assert_close(_f64(state[slot]), ref_state[slot], atol=1e-4, rtol=1e-4)

    backend.copy_state_slots(state, *_keep(batch, keep))
    nxt = [t.to(device) for t in _delta_inputs(len(keep), gen)]
    for i, j in enumerate(keep, start=1):
        slot = i + 1
        rows = _seq_rows(batch, i, j + 1)
        only = single_sequence_batch(j + 1, CACHED, slot, torch.device(device), padding=0)
        chunk = (t[rows] for t in (q, k, v, g, beta))
        _, want_state = reference_gated_delta_rule(only, *chunk, state0, spec.q_scale, True)
        torch.testing.assert_close(_f64(state[slot]), want_state[slot], atol=1e-4, rtol=1e-4)

        dec = single_sequence_batch(1, CACHED + j + 1, slot, torch.device(device), padding=0)
        one = [t[i - 1 : i] for t in nxt]
        got = run(dec, *one)
        want, _ = reference_gated_delta_rule(dec, *one, want_state, spec.q_scale, True)
        torch.testing.assert_close(_f64(got), want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("family", "name"), [("ssm", "triton"), ("ssm", "flashinfer"), ("delta", "triton")]
)
def test_verify_keep_then_decode_on_cuda(family, name):
    """The op checks on the CUDA backends: the Triton conv, scan and delta rule, and the
    FlashInfer SSM backend (decode scan on FlashInfer, the rest on its fallback)."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    from backplane.engine.selection import select_backends_for

    backend = select_backends_for({family: name}, [family], device="cuda")[family]
    check = check_mamba2 if family == "ssm" else check_delta
    for keep in KEEPS:
        check(backend, keep, "cuda")


# -- the verification description ------------------------------------------------------------


def test_keep_slots_name_the_scratch_slot_of_each_position_and_the_own_slot_last():
    """Position ``j`` comes from its scratch slot, the last position from the sequence's own
    slot (the op leaves the whole chunk there), and unkept or missing columns from nowhere."""
    batch, _ = _verify_batch((3, 2))
    vs = VerifyStates.build(batch.host, [1, 2], [[10, -1, 12], [13, 14, 15]], "cpu")
    src, dst = vs.keep_slots(torch.tensor([0, 0]))
    assert src.tolist() == [10, 13] and dst.tolist() == [2, 3]
    src, _ = vs.keep_slots(torch.tensor([2, 1]))
    assert src.tolist() == [2, 3]  # the last position of each chunk: the own slots
    # column 2 of the 2-token chunk is no position: its slot is never written
    assert vs.slots.tolist() == [[10, NULL_SLOT, 12], [13, 14, NULL_SLOT]]


def test_a_scratch_region_gives_every_position_but_the_last_its_own_slot():
    """Positions ``0 .. len - 2`` of each chunk get consecutive slots from the region's start;
    keeping the last position reads the sequence's own slot."""
    batch, _ = _verify_batch((3, 2))
    vs = VerifyStates.in_scratch_region(batch.host, [1, 2], 20, "cpu")
    assert vs.slots.tolist() == [[20, 21, NULL_SLOT], [22, NULL_SLOT, NULL_SLOT]]
    assert vs.keep_slots(torch.tensor([1, 0]))[0].tolist() == [21, 22]
    assert vs.keep_slots(torch.tensor([2, 1]))[0].tolist() == [2, 3]


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        ([[7, 7, -1], [8, 9, -1]], "distinct"),
        ([[0, 7, -1], [8, 9, -1]], "reserved slot 0"),
        ([[2, 7, -1], [8, 9, -1]], "own state slot"),
        ([[7, 8], [9, 10]], "scratch slot table only 2 columns"),
    ],
)
def test_scratch_slots_that_would_clobber_a_state_are_refused(slots, match):
    """Scratch slots shared, the reserved slot, a sequence's own slot, or too few columns."""
    batch, _ = _verify_batch((3, 2))
    with pytest.raises(ValueError, match=match):
        VerifyStates.build(batch.host, [1, 2], slots, "cpu")


# -- whole hybrid models ---------------------------------------------------------------------


def _qwen3_5_config() -> dict[str, Any]:
    """Qwen3.5 (separate DeltaNet projections, dense MLP) on the tiny Qwen3-Next shapes."""
    cfg = {
        k: v
        for k, v in PRESETS["tiny-qwen3-next"].items()
        if not k.startswith(("num_experts", "moe_", "shared_expert", "decoder_sparse", "mlp_only"))
    }
    cfg.update(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5")
    return cfg


MODELS = {
    "nemotron_h": lambda: dict(PRESETS["tiny-nemotron-h"]),
    "qwen3_next": lambda: dict(PRESETS["tiny-qwen3-next"]),
    "qwen3_5": _qwen3_5_config,
}


class _Stepper:
    """Page and slot bookkeeping for a few sequences, one model forward per step."""

    def __init__(self, lm: CausalLM, backends: dict[str, Any], num_seqs: int, scratch: int):
        self.lm, self.backends = lm, backends
        self.num_slots = num_seqs + 1 + scratch
        self.caches = lm.allocate_caches(
            num_pages=num_seqs * 4 + 1,
            page_size=PAGE_SIZE,
            num_slots=self.num_slots,
            dtype=torch.float32,
            device="cpu",
        )
        self.pages = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(num_seqs)]
        self.lens = [0] * num_seqs

    def batch(self, new: dict[int, list[int]]) -> BatchMetadata:
        seqs = list(new)
        return build_batch_metadata(
            [len(new[s]) for s in seqs],
            [self.lens[s] for s in seqs],
            [self.pages[s] for s in seqs],
            PAGE_SIZE,
            state_slots=[s + 1 for s in seqs],
        )

    def step(self, new: dict[int, list[int]], batch: BatchMetadata | None = None) -> list:
        """Run one step (sequences in batch order); return each sequence's logits rows."""
        batch = batch or self.batch(new)
        ids = torch.tensor([t for s in new for t in new[s]])
        with torch.no_grad(), forward_context(batch, plan_step(self.backends, batch)):
            logits = self.lm.compute_logits(self.lm(ids, batch.positions)[: batch.num_tokens])
        out, start = [], 0
        for s, toks in new.items():
            out.append(logits[start : start + len(toks)])
            start += len(toks)
            self.lens[s] += len(toks)
        return out


@pytest.mark.parametrize("keep", [(0, 3, 1), (3, 0, 2)], ids=lambda k: "-".join(map(str, k)))
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_model_verify_keep_then_decode_equals_decoding_the_accepted_tokens(arch, keep):
    """A verification step of 4 tokens per sequence, position ``j`` kept, then one decode:
    the verification logits of positions ``0..j`` and the decode logits equal those of the
    same model decoding the first ``j + 1`` chunk tokens one step at a time."""
    cfg = ModelConfig(MODELS[arch]())
    families = ("attention", "ssm", "delta")
    backends = {f: _torch_backend(f) for f in families}
    lm = build_model(model_class(cfg.architecture), cfg, backends, dtype=torch.float32,
                     device="cpu")  # fmt: skip
    lm.init_random_weights_(seed=3, std=0.1)
    lm.finalize_weights()
    rng = np.random.default_rng(5)
    vocab = lm.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in (7, 5, 9)]
    chunks = [rng.integers(0, vocab, 4).tolist() for _ in prompts]
    after = [int(t) for t in rng.integers(0, vocab, len(prompts))]
    width = 4
    num = len(prompts)

    spec = _Stepper(lm, backends, num, scratch=num * (width - 1))
    spec.step(dict(enumerate(prompts)))
    verify = spec.batch(dict(enumerate(chunks)))
    # the scratch region follows the sequences' own slots 1..num
    verify.verify_states = VerifyStates.in_scratch_region(
        verify.host, np.arange(num), num + 1, "cpu"
    )
    verified = spec.step(dict(enumerate(chunks)), verify)
    lm.keep_verified_states(*verify.verify_states.keep_slots(torch.tensor(keep)))
    spec.lens = [len(p) + j + 1 for p, j in zip(prompts, keep, strict=True)]
    got = spec.step({s: [after[s]] for s in range(num)})

    ref = _Stepper(lm, backends, num, scratch=0)
    ref.step(dict(enumerate(prompts)))
    ref_chunk: list[list[torch.Tensor]] = [[] for _ in prompts]
    for t in range(max(keep) + 1):  # the accepted tokens, one decode step each
        seqs = [s for s in range(num) if t <= keep[s]]
        for s, row in zip(seqs, ref.step({s: [chunks[s][t]] for s in seqs}), strict=True):
            ref_chunk[s].append(row)
    want = ref.step({s: [after[s]] for s in range(num)})

    for s in range(num):
        torch.testing.assert_close(
            verified[s][: keep[s] + 1], torch.cat(ref_chunk[s]), atol=1e-4, rtol=1e-4
        )
        torch.testing.assert_close(got[s], want[s], atol=1e-4, rtol=1e-4)
