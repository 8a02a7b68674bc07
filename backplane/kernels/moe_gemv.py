"""Routed experts of a mixture-of-experts block for a few tokens, in two launches.

At decode a MoE block sees a handful of tokens, each routed to ``k`` of ``E``
experts. The grouped path of :func:`backplane.models.moe.moe_experts` sorts
the token-expert pairs and runs one matmul per expert, which needs each
expert's count on the host (a sync); while a CUDA graph is captured it runs
every expert densely over every token instead: ``E`` times the weight reads
and about a hundred small launches per layer.

:func:`moe_gemv` reads only the routed experts' weights (a gathered
matrix-vector product), with no host sync and a fixed launch count and grid
for fixed shapes, so it runs the same eagerly and inside CUDA graphs:

* kernel A, one program per token-expert pair ``p = t * k + j`` and block of
  :data:`BLOCK_I` intermediate rows: ``e = topk_ids[t, j]``; it streams the
  gate and up rows of ``w_in[e]`` (``[E, 2I, H]``: gate rows then up rows;
  ``[E, I, H]`` when not gated) against ``x[t]`` in :data:`BLOCK_H`-column
  chunks, accumulating in float32, and writes ``act(gate) * up`` (or
  ``act(up)``) to ``h[p]``, float32;
* kernel B, one program per token and block of :data:`BLOCK_N` output
  columns: ``out[t, n] = sum_j topk_weights[t, j] * (w_down[e_j][n] . h[t*k+j])``,
  the dot products over ``I`` in :data:`BLOCK_K`-column chunks in float32,
  the slots added in their order ``j = 0 .. k-1`` (deterministic), written in
  ``x``'s dtype.

Each pair's weights are read once per pair: bytes ``T * k * 3 * I * H`` of the
weight dtype for gated experts. Two pairs routed to one expert read it twice
(the second read usually hits L2); the grouped path reads each expert once,
which is why callers take this path only up to a few dozen pairs.

Block sizes: at decode (``T = 1``, ``k = 4``, ``I = 512``, ``H = 2048``)
kernel A has ``4 * 512 / 8 = 256`` programs and kernel B ``2048 / 8 = 256``,
about two per SM on an H100 or H200 (132 SMs), each streaming an
``[8, 512]`` tile per matrix per step (8 KiB of bfloat16; 16 KiB for the
gated pair of tiles) to keep enough loads in flight. Fewer rows per program
would leave the tiles too small to hide the load latency; more would leave
most SMs idle at one token.

The activations are those of :data:`backplane.models.mlp.ACTIVATIONS`, by
their HF config names (:data:`ACT_NAMES`); in float32 as
:mod:`.elementwise` computes them (the CUDA math library's ``exp``, ``erf``
and ``tanh`` on the device).

Programs of the interpreter run on CPU tensors (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backplane.core.launch import KernelLauncher, cdiv, next_pow2
from backplane.kernels.availability import interpreting
from backplane.kernels.elementwise import _EXACT_MATH, ACT_CODES, _act

__all__ = [
    "ACT_NAMES",
    "BLOCK_H",
    "BLOCK_I",
    "BLOCK_K",
    "BLOCK_N",
    "DTYPES",
    "ID_DTYPES",
    "moe_gemv",
    "supports",
]

#: dtypes of the activations and expert weights the kernels read (one dtype for all)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: dtypes of the expert ids
ID_DTYPES = (torch.int32, torch.int64)

#: the activations computed, by HF config name, to :data:`.elementwise.ACT_CODES` names
ACT_NAMES: dict[str, str] = {
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
    "relu2": "relu2",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
}

#: intermediate rows per program of kernel A (see the module docstring)
BLOCK_I = 8

#: columns of ``H`` per step of kernel A's reduction (at most; narrower rows use fewer)
BLOCK_H = 512

#: output columns per program of kernel B
BLOCK_N = 8

#: columns of ``I`` per step of kernel B's reduction (at most)
BLOCK_K = 512

_WARPS = 4

#: fused multiply-adds in the dot products (stated: Triton's default is to change); the
#: results need not equal torch's unfused ones bit for bit, only be deterministic
_LAUNCH = {"num_warps": _WARPS, "enable_fp_fusion": True}


@triton.jit
def _moe_in_kernel(
    x_ptr,
    ids_ptr,
    w_ptr,
    h_ptr,
    inter,
    hidden,
    stride_x,
    stride_we,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EXACT: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    token = pair // TOP_K
    e = tl.load(ids_ptr + pair).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    row_ok = rows < inter
    cols = tl.arange(0, BLOCK_H)
    w_expert = w_ptr + e * stride_we
    w_up = w_expert + rows.to(tl.int64)[:, None] * hidden
    if GATED:
        # the gate rows come first: the up rows are inter rows further on
        w_gate = w_up
        w_up = w_expert + (rows + inter).to(tl.int64)[:, None] * hidden
        acc_g = tl.zeros([BLOCK_I, BLOCK_H], tl.float32)
    acc_u = tl.zeros([BLOCK_I, BLOCK_H], tl.float32)
    x_row = x_ptr + token * stride_x
    for h0 in range(0, hidden, BLOCK_H):
        c = h0 + cols
        c_ok = c < hidden
        xv = tl.load(x_row + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        mask = row_ok[:, None] & c_ok[None, :]
        if GATED:
            wg = tl.load(w_gate + c[None, :], mask=mask, other=0.0).to(tl.float32)
            acc_g += wg * xv
        wu = tl.load(w_up + c[None, :], mask=mask, other=0.0).to(tl.float32)
        acc_u += wu * xv
    up = tl.sum(acc_u, axis=1)
    if GATED:
        y = _act(tl.sum(acc_g, axis=1), ACT, EXACT) * up
    else:
        y = _act(up, ACT, EXACT)
    tl.store(h_ptr + pair * inter + rows, y, mask=row_ok)


@triton.jit
def _moe_down_kernel(
    h_ptr,
    ids_ptr,
    tw_ptr,
    w_ptr,
    out_ptr,
    inter,
    hidden,
    stride_we,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < hidden
    rk = tl.arange(0, BLOCK_K)
    out = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        e = tl.load(ids_ptr + pair).to(tl.int64)
        weight = tl.load(tw_ptr + pair).to(tl.float32)
        w_rows = w_ptr + e * stride_we + rn.to(tl.int64)[:, None] * inter
        h_row = h_ptr + pair * inter
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < inter
            hv = tl.load(h_row + kk, mask=k_ok, other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * hv[None, :]
        out += weight * tl.sum(acc, axis=1)
    tl.store(out_ptr + token * stride_out + rn, out.to(out_ptr.dtype.element_ty), mask=n_ok)


_IN = KernelLauncher(_moe_in_kernel)
_DOWN = KernelLauncher(_moe_down_kernel)


def _on_kernel_device(x: torch.Tensor) -> bool:
    """CUDA tensors, or CPU ones in the Triton interpreter."""
    return x.is_cuda or (x.device.type == "cpu" and interpreting())


def supports(
    x: torch.Tensor,
    num_pairs: int,
    w_in: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
) -> bool:
    """Whether :func:`moe_gemv` runs these arguments (else the caller takes another path).

    :param x: ``[T, H]`` activations.
    :param num_pairs: ``T * k``, the token-expert pairs (at least one).
    :param w_in: ``[E, 2I, H]`` or ``[E, I, H]`` input projections.
    :param w_down: ``[E, H, I]`` down projections.
    :param act: the activation's HF config name.
    :return: ``True`` when the tensors are on a device the kernels run on, of
        one dtype of :data:`DTYPES`, the weights contiguous, and ``act`` one
        of :data:`ACT_NAMES`.
    """
    return (
        num_pairs > 0
        and act in ACT_NAMES
        and x.dtype in DTYPES
        and w_in.dtype == x.dtype
        and w_down.dtype == x.dtype
        and x.dim() == 2
        and w_in.dim() == 3
        and w_down.dim() == 3
        and w_in.is_contiguous()
        and w_down.is_contiguous()
        and _on_kernel_device(x)
        and w_in.device == x.device
        and w_down.device == x.device
    )


def _check(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_in: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    gated: bool,
) -> None:
    """Raise with what is wrong when the arguments do not fit the kernels."""
    if act not in ACT_NAMES:
        raise ValueError(
            f"the MoE expert kernels compute {', '.join(sorted(ACT_NAMES))}, not {act!r}; "
            "run the experts with torch ops"
        )
    if x.dim() != 2 or w_in.dim() != 3 or w_down.dim() != 3 or topk_ids.dim() != 2:
        raise ValueError(
            "moe_gemv takes x [T, H], topk_ids and topk_weights [T, k], w_in [E, rows, H] and "
            f"w_down [E, H, I], not {tuple(x.shape)}, {tuple(topk_ids.shape)}, "
            f"{tuple(topk_weights.shape)}, {tuple(w_in.shape)} and {tuple(w_down.shape)}"
        )
    num_tokens, hidden = x.shape
    num_experts, inter = w_down.shape[0], w_down.shape[2]
    rows = 2 * inter if gated else inter
    want = {
        "topk_ids": (tuple(topk_ids.shape), (num_tokens, topk_ids.shape[1])),
        "topk_weights": (tuple(topk_weights.shape), tuple(topk_ids.shape)),
        "w_in": (tuple(w_in.shape), (num_experts, rows, hidden)),
        "w_down": (tuple(w_down.shape), (num_experts, hidden, inter)),
    }
    for name, (got, expected) in want.items():
        if got != expected:
            raise ValueError(
                f"moe_gemv: {name} has shape {got}, expected {expected} for x "
                f"{tuple(x.shape)} and w_down {tuple(w_down.shape)} (gated={gated})"
            )
    if x.dtype not in DTYPES or w_in.dtype != x.dtype or w_down.dtype != x.dtype:
        raise TypeError(
            f"moe_gemv reads x and the expert weights in one of "
            f"{', '.join(map(str, DTYPES))}, not {x.dtype}, {w_in.dtype} and {w_down.dtype}; "
            "convert them to the model dtype"
        )
    if topk_ids.dtype not in ID_DTYPES:
        raise TypeError(f"moe_gemv: topk_ids must be int32 or int64, not {topk_ids.dtype}")
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"moe_gemv: topk_weights must be floating point, not {topk_weights.dtype}")
    if not (w_in.is_contiguous() and w_down.is_contiguous()):
        raise ValueError(
            "moe_gemv reads contiguous expert weights; w_in or w_down is a strided view "
            "(call .contiguous() once when loading)"
        )
    devices = {t.device for t in (x, topk_ids, topk_weights, w_in, w_down)}
    if len(devices) != 1 or not _on_kernel_device(x):
        raise ValueError(
            f"moe_gemv needs every tensor on one CUDA device (or the CPU with "
            f"TRITON_INTERPRET=1), not on {sorted(map(str, devices))}"
        )


def moe_gemv(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_in: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    gated: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the routed experts for a few tokens, reading only the routed experts' weights.

    Two launches, no host synchronisation: usable while a CUDA graph is
    captured. Results are deterministic (fixed summation order).

    :param x: ``[T, H]`` float32, bfloat16 or float16 (rows of unit column
        stride, else copied).
    :param topk_ids: ``[T, k]`` int32 or int64 expert ids, each in ``[0, E)``.
    :param topk_weights: ``[T, k]`` routing weights (read as float32).
    :param w_in: ``[E, 2I, H]``, each expert's gate rows then its up rows, when
        ``gated``; else ``[E, I, H]``; contiguous, ``x``'s dtype.
    :param w_down: ``[E, H, I]``, contiguous, ``x``'s dtype.
    :param act: the activation's HF config name (one of :data:`ACT_NAMES`).
    :param gated: ``act(gate) * up`` (else ``act(up)``).
    :param out: where to write the result, ``[T, H]`` of ``x``'s dtype with
        rows of unit column stride; ``None`` allocates it.
    :return: ``[T, H]`` in ``x.dtype`` (``out`` when given): ``sum_j topk_weights[t, j] *
        down[e_j](act(...))``, accumulated in float32.
    :raises ValueError: shapes that do not fit together, strided weights, an
        unknown activation, tensors on several devices or none the kernels run
        on, an ``out`` that does not fit.
    :raises TypeError: unsupported dtypes.
    """
    _check(x, topk_ids, topk_weights, w_in, w_down, act, gated)
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w_down.shape[2]
    if out is None:
        out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    elif (
        out.shape != x.shape
        or out.dtype != x.dtype
        or out.device != x.device
        or (hidden > 1 and out.stride(-1) != 1)
    ):
        raise ValueError(
            f"out must be a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device} with unit "
            f"column stride, not {out.dtype} {tuple(out.shape)} on {out.device} "
            f"(strides {out.stride()})"
        )
    if num_tokens == 0 or top_k == 0 or hidden == 0:
        return out.zero_()
    if x.stride(-1) != 1:
        x = x.contiguous()
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    num_pairs = num_tokens * top_k
    h = torch.empty((num_pairs, inter), dtype=torch.float32, device=x.device)
    device = x.device.index or 0
    if inter > 0:
        block_h = min(BLOCK_H, next_pow2(hidden))
        _IN.launch(
            (num_pairs, cdiv(inter, BLOCK_I)),
            (x, ids, w_in, h, inter, hidden, x.stride(0), w_in.stride(0)),
            device,
            TOP_K=top_k,
            GATED=bool(gated),
            ACT=ACT_CODES[ACT_NAMES[act]],
            BLOCK_I=BLOCK_I,
            BLOCK_H=block_h,
            EXACT=_EXACT_MATH,
            **_LAUNCH,
        )
    block_k = min(BLOCK_K, next_pow2(inter))
    _DOWN.launch(
        (num_tokens, cdiv(hidden, BLOCK_N)),
        (h, ids, weights, w_down, out, inter, hidden, w_down.stride(0), out.stride(0)),
        device,
        TOP_K=top_k,
        BLOCK_N=BLOCK_N,
        BLOCK_K=block_k,
        **_LAUNCH,
    )
    return out
