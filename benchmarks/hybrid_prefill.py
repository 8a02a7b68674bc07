"""The Triton hybrid ops' layouts, new against old (GPU).

* **SSM prefill** at a Nemotron-H Mamba2 layer (128 heads x 64, state 128,
  8 groups, bfloat16): the packed scan of ``backplane_triton::ssm_scan`` (one
  row of all prefill tokens with ``seq_idx``, initial states added by our
  epilogue) against the former layout, kept here as :func:`padded_prefill`
  (every sequence a row of a zero-padded ``[seqs, longest]`` batch with
  per-row initial states gathered from the slots, outputs gathered back and
  final states scattered to the slots). Batches with very uneven lengths are
  where padding costs; an even batch shows there is no loss there.
* **Delta decode** at a Qwen3-Next gated-delta layer (16 key heads, 32 value
  heads, 128 x 128, bfloat16): our in-place kernel against the former
  ``state[slots]`` gather, fla's ``fused_recurrent_gated_delta_rule`` and
  ``index_copy_`` back, eagerly and as one CUDA-graph replay.

Times are medians of CUDA-event measurements (``bench_ops``'s helpers). Each
case also reports the largest difference between the two paths' outputs and
states, as a sanity check. Run on a GPU machine::

    python benchmarks/hybrid_prefill.py [--quick] [--iters 20]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import DELTA, SSM, _batch, _rnd, _time, graph_time  # noqa: E402

from backplane.core.forward_context import forward_context  # noqa: E402

logger = logging.getLogger("hybrid_prefill")


def padded_prefill(batch, x, dt, A, B, C, D, dt_bias, z, ssm_state, chunk_size, out) -> None:
    """The former Triton SSM prefill: prefill sequences as rows of a padded batch.

    ``dt`` becomes ``softplus(dt + dt_bias)`` and is padded with zeros, so
    padding leaves each row's state unchanged; the rows' final states are the
    sequences' final states.
    """
    from backplane.backends.triton import _mamba_import

    mamba = _mamba_import.load()
    n, tp = batch.num_prefill_seqs, batch.num_prefill_tokens
    H, P = x.shape[1], x.shape[2]
    max_len = int(batch.host.query_lens[:n].max())
    seq_of = batch.token_seq_ids[:tp].long()
    local = torch.arange(tp, device=x.device) - batch.query_start_loc.long()[seq_of]
    pad_index = seq_of * max_len + local

    def pad(t: torch.Tensor) -> torch.Tensor:
        padded = t.new_zeros((n * max_len, *t.shape[1:]))
        padded.index_copy_(0, pad_index, t[:tp])
        return padded.view(n, max_len, *t.shape[1:])

    dt_eff = F.softplus(dt[:tp].float() + dt_bias.float())
    slots = batch.state_slots[:n].long()
    init = torch.where(batch.has_initial_state[:n, None, None, None], ssm_state[slots], 0.0)
    y, _, _, _, _, final = mamba.mamba_chunk_scan_combined_fwd(
        pad(x),
        pad(dt_eff),
        A.float(),
        pad(B),
        pad(C),
        chunk_size,
        D=D,
        z=pad(z) if z is not None else None,
        dt_bias=None,
        initial_states=init.float(),
        dt_softplus=False,
        dt_limit=(float("-inf"), float("inf")),
    )
    torch.index_select(y.reshape(-1, H, P), 0, pad_index, out=out[:tp])
    ssm_state.index_copy_(0, slots, final.to(ssm_state.dtype))


def gathered_delta_decode(q, k, v, g, beta, state, slots, scale, out) -> None:
    """The former Triton delta decode: gather the states, fla's fused recurrent step, scatter."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    slots = slots.long()
    o, ht = fused_recurrent_gated_delta_rule(
        q.unsqueeze(1).contiguous(),
        k.unsqueeze(1).contiguous(),
        v.unsqueeze(1).contiguous(),
        g=g.unsqueeze(1).contiguous(),
        beta=beta.unsqueeze(1).contiguous(),
        scale=scale,
        initial_state=state[slots],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    out.copy_(o[:, 0])
    state.index_copy_(0, slots, ht.to(state.dtype))


def ssm_cases(quick: bool) -> list[tuple[str, list[int], list[int]]]:
    """``(label, query_lens, cached_lens)`` of the prefill batches."""
    cases = [
        ("1x4096 + 31x16, fresh", [4096] + [16] * 31, [0] * 32),
        ("1x4096 + 31x16, all extend", [4096] + [16] * 31, [256] * 32),
        ("2048 + 64x(2..65), half extend", [2048] + list(range(2, 66)), [0, 64] * 32 + [0]),
        ("8x512 even, fresh", [512] * 8, [0] * 8),
    ]
    if not quick:
        cases.append(("1x16384 + 63x8, extend", [16384] + [8] * 63, [512] * 64))
    return cases


def bench_ssm(label: str, query: list[int], cached: list[int], warmup: int, iters: int) -> None:
    """Time the packed and the padded SSM prefill on one batch and compare their results."""
    from backplane.backends.triton.ssm import TritonSSMBackend

    L = SSM
    batch, _ = _batch(query, cached)
    t, n = batch.padded_num_tokens, len(query)
    x, z = _rnd(t, L.nheads, L.head_dim), _rnd(t, L.nheads, L.head_dim)
    dt = _rnd(t, L.nheads, scale=0.5)
    A = -torch.rand(L.nheads, device="cuda") - 0.5
    B, C = _rnd(t, L.n_groups, L.d_state, scale=0.3), _rnd(t, L.n_groups, L.d_state, scale=0.3)
    D, dt_bias = torch.randn(L.nheads, device="cuda"), torch.randn(L.nheads, device="cuda") * 0.5
    state0 = torch.randn(n + 1, L.nheads, L.head_dim, L.d_state, device="cuda") * 0.1
    backend = TritonSSMBackend()
    plans = {"ssm": backend.plan(batch)}
    states = {"packed": state0.clone(), "padded": state0.clone()}
    outs = {
        name: torch.empty(t, L.nheads, L.head_dim, dtype=x.dtype, device="cuda") for name in states
    }

    def packed() -> None:
        backend.scan(x, dt, A, B, C, D, dt_bias, z, states["packed"], L, outs["packed"])

    def padded() -> None:
        padded_prefill(
            batch, x, dt, A, B, C, D, dt_bias, z, states["padded"], L.chunk_size, outs["padded"]
        )

    with forward_context(batch, plans):
        # one step from the same state first: the two results must agree
        packed()
        padded()
        tp = batch.num_prefill_tokens
        out_diff = (outs["packed"][:tp].float() - outs["padded"][:tp].float()).abs().max().item()
        state_diff = (states["packed"] - states["padded"]).abs().max().item()
        ms_packed = _time(packed, warmup, iters)
        ms_padded = _time(padded, warmup, iters)
    longest = max(query)
    logger.info(
        "ssm prefill %-32s tokens %6d (padded to %6d)  packed %8.3f ms  padded %8.3f ms  "
        "x%.2f  max |diff| out %.2e state %.2e",
        label, sum(query), longest * n, ms_packed, ms_padded, ms_padded / ms_packed,
        out_diff, state_diff,
    )  # fmt: skip


def bench_delta(seqs: int, warmup: int, iters: int) -> None:
    """Time the in-place and the gathering delta decode on ``seqs`` sequences, eager and graphed."""
    from backplane.backends.triton.delta_decode import delta_decode

    L = DELTA
    q, k = _rnd(seqs, L.num_k_heads, L.k_head_dim), _rnd(seqs, L.num_k_heads, L.k_head_dim)
    v = _rnd(seqs, L.num_v_heads, L.v_head_dim)
    g = -torch.rand(seqs, L.num_v_heads, device="cuda") * 0.1
    beta = torch.rand(seqs, L.num_v_heads, device="cuda") * 0.5 + 0.25
    # slots spread over a larger cache, out of order, as in a running engine
    slots = (torch.randperm(4 * seqs, device="cuda")[:seqs] + 1).to(torch.int32)
    state0 = torch.randn(4 * seqs + 1, L.num_v_heads, L.k_head_dim, L.v_head_dim, device="cuda")
    state0 *= 0.1
    states = {"in_place": state0.clone(), "gathered": state0.clone()}
    outs = {name: torch.empty_like(v) for name in states}
    scale = L.q_scale

    def in_place() -> None:
        delta_decode(q, k, v, g, beta, states["in_place"], slots, scale, True, outs["in_place"])

    def gathered() -> None:
        gathered_delta_decode(q, k, v, g, beta, states["gathered"], slots, scale, outs["gathered"])

    in_place()
    gathered()
    out_diff = (outs["in_place"].float() - outs["gathered"].float()).abs().max().item()
    state_diff = (states["in_place"] - states["gathered"]).abs().max().item()
    eager = [_time(fn, warmup, iters) for fn in (in_place, gathered)]
    graphed = [graph_time(fn, iters) for fn in (in_place, gathered)]
    logger.info(
        "delta decode %4d seqs  eager: in place %7.3f ms  gathered %7.3f ms (x%.2f)  "
        "graph: in place %7.3f ms  gathered %7.3f ms (x%.2f)  max |diff| out %.2e state %.2e",
        seqs, eager[0], eager[1], eager[1] / eager[0], graphed[0], graphed[1],
        graphed[1] / graphed[0], out_diff, state_diff,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run both benchmarks and log one line per case."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer and smaller cases")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        logger.error("hybrid_prefill needs a CUDA GPU")
        return 2
    logger.info("# %s", torch.cuda.get_device_name())
    for label, query, cached in ssm_cases(args.quick):
        bench_ssm(label, query, cached, args.warmup, args.iters)
    for seqs in (1, 16, 64) if args.quick else (1, 16, 64, 256, 512):
        bench_delta(seqs, args.warmup, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
