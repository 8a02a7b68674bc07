"""FP8 (e4m3) projections take every fused one-row variant of the full-precision ones.

A :class:`~backplane.models.linear.Linear` holding an FP8 weight runs its
one-row products (``fused_ops="triton"``) through the one-row kernel with
whatever rides along, as a 16-bit weight does: the RMS-norm prologue (with and
without the residual add, zero-centred or not), the rotary epilogue of an
attention layer's queries and keys, the activation epilogue and a gated MLP's
product as the down projection's prologue. Checked here:

* ``variants``: each entry point (``forward``, ``forward_activated``,
  ``forward_gated``, ``forward_normed`` with a residual, an activation or a
  rotation) for every scale layout a model holds (one scale per tensor, per
  row, per row and 128 columns, per 128x128 block read in block form), in
  bfloat16 and float32, unsplit and split over the reduction: every output
  element lies within its rounding bound of a float64 reference built from
  the dequantised weight and float64 norms, activations and rotations; the
  residual stream is bit for bit the rounded float64 sum. Every float tensor
  allocated during a call starts as NaN and the split-K partial sums are
  poisoned, so an element the kernel does not write shows.
* ``model-channel`` / ``model-blocks``: the ``tiny-llama`` preset with FP8
  weights (quantised on load, and re-quantised in blocks of 32x32) generates
  the same greedy tokens with ``fused_ops="triton"`` as with ``"torch"`` (its
  logits within float32 rounding of each other), each layer's projections
  having built the fused variants (norm and rotation into ``qkv_proj``, norm
  and the gated product as its epilogue into ``gate_up_proj`` at these 1B-class
  widths, a plain ``down_proj``) and the decode
  steps having run no separate norm, rotary or activation kernel inside the
  layers.

The checks run in the Triton interpreter in one child process (see
``tests/interpreter_checks.py``); run one by hand with::

    TRITON_INTERPRET=1 python tests/test_fp8_fused.py variants

``tests/test_fp8_fused_gpu.py`` runs them on a GPU with CUDA-graph replays.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from interpreter_checks import interpreter_tests, main
from test_fp8_gemv import equal, within

CHECKS = ("variants", "model-channel", "model-blocks")

#: scale layouts of an FP8 ``Linear``: (name, granularity, block) for ``quantize_weight``
LAYOUTS = (
    ("tensor", "tensor", None),
    ("row", "channel", None),
    ("row-blocks", "block", (1, 128)),
    ("square-blocks", "block", (128, 128)),
)

# -- the pytest side ----------------------------------------------------------------

if __name__ != "__main__":
    interpret_results, test_in_interpreter = interpreter_tests(__file__, CHECKS, timeout=900)


# -- helpers ---------------------------------------------------------------------------


def randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int, scale: float = 1.0):
    """Seeded normal values drawn on the CPU, so every device sees the same ones.

    :return: a tensor of ``shape`` in ``dtype`` on ``device``.
    """
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device, dtype)


def unit(dtype: torch.dtype, device: torch.device) -> float:
    """One rounding's relative error in ``dtype`` as the kernel rounds there.

    The interpreter's casts to 16-bit types truncate (twice the unit roundoff).

    :return: the bound of one rounding, relative to the value.
    """
    u = torch.finfo(dtype).eps / 2
    return 2 * u if device.type == "cpu" and dtype != torch.float32 else u


def fp8_linear(
    n: int, k: int, layout: str, *, dtype: torch.dtype, device: torch.device, seed: int, bias: bool
) -> tuple[Any, torch.Tensor]:
    """An FP8 ``Linear`` of ``[n, k]`` with the scales of ``layout``, and its weight in float64.

    The rows and columns get different magnitudes so that a scale read for the
    wrong row or block shows; the weight is rounded to e4m3 by torch.

    :return: ``(linear with fused_ops="triton", dequantised weight [n, k] float64)``.
    """
    from backplane.models.linear import Linear
    from backplane.models.quant.fp8 import quantize_weight, row_scales
    from backplane.models.quant.projection import convert_linear

    gran, block = {name: (g, b) for name, g, b in LAYOUTS}[layout]
    w = randn(n, k, dtype=torch.float32, device=torch.device("cpu"), seed=seed, scale=k**-0.5)
    w *= torch.linspace(0.25, 4.0, n)[:, None] * torch.linspace(2.0, 0.5, k)[None, :]
    q, scale = quantize_weight(w, gran, block or (128, 128))
    rows = row_scales(scale, n, k, gran, block or (128, 128))
    lin = Linear(k, n, bias=bias).to(device, dtype)
    with torch.no_grad():
        convert_linear(lin, None if block is None else block[1])
        lin.weight.copy_(q.to(device))
        lin.weight_scale.copy_(rows.to(device))
        if bias:
            lin.bias.copy_(randn(n, dtype=dtype, device=device, seed=seed + 1))
    lin.requires_grad_(False)
    lin.fused_ops = "triton"
    s = rows.double()
    if s.shape[1] > 1:
        s = s.repeat_interleave(block[1], dim=1)[:, :k]
    return lin, (q.double() * s).to(device)


def product_bound(h64: torch.Tensor, w64: torch.Tensor, b, ref: torch.Tensor, u: float):
    """The rounding bound of a float32-accumulated product of an exact input, rounded once.

    :param h64: the projected input in float64.
    :param w64: the dequantised weight in float64.
    :param b: the bias or ``None``.
    :param ref: the float64 product.
    :param u: one rounding in the output dtype (see :func:`unit`).
    :return: the bound of each output element.
    """
    k = h64.shape[-1]
    absdot = h64.abs() @ w64.abs().T + (0 if b is None else b.double().abs())
    return u * ref.abs() + (2 * k + 4) * (torch.finfo(torch.float32).eps / 2) * absdot


@contextlib.contextmanager
def poisoned(device: torch.device) -> Iterator[None]:
    """Every float tensor ``torch.empty`` allocates starts as NaN, and the split-K partial
    sums are NaN: an output element or partial the kernel does not write shows."""
    from backplane.kernels.split_k import SCRATCH

    key = device
    if device.type == "cuda" and device.index is None:
        key = torch.device("cuda", torch.cuda.current_device())
    bufs = SCRATCH.get(key)
    if bufs is not None:
        bufs[1].fill_(float("nan"))
    empty = torch.empty

    def nan_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = nan_empty
    try:
        yield
    finally:
        torch.empty = empty


def built(lin: Any, kind: str) -> list[Any]:
    """The one-row projections ``lin`` built for variants of ``kind``, each reading scales."""
    projs = [p for v, p in (lin._projections or {}).items() if v[0] == kind and p]
    assert all(p.scale is not None for p in projs), f"{kind}: a projection without scales"
    return projs


def rms64(x64: torch.Tensor, g: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """The RMS norm in float64."""
    inv = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return x64 * inv * ((1.0 + g.double()) if zero_centered else g.double())


def silu64(t: torch.Tensor) -> torch.Tensor:
    """SiLU in float64."""
    return t / (1.0 + torch.exp(-t))


def relu2_bound(
    p64: torch.Tensor, pre: torch.Tensor, u: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``relu(p)^2`` and its bound, given the bound ``pre`` of ``p`` (the activation
    doubles relative errors, then rounds once more).

    :return: ``(reference, bound)`` in float64.
    """
    ref = torch.relu(p64).square()
    return ref, 2 * p64.abs() * pre + pre.square() + 2 * u * ref


# -- the checks ------------------------------------------------------------------------


def _shapes(device: torch.device) -> dict[str, Any]:
    """Shapes of a Llama layer's projections: the interpreter's small, a GPU's larger.

    The down projection is tall enough to be split over its reduction.
    """
    if device.type == "cpu":
        return {"heads": (4, 2, 32), "hidden": 256, "inner": 192, "down": (40, 2304)}
    return {"heads": (16, 4, 128), "hidden": 2048, "inner": 5632, "down": (2048, 5632)}


def check_variants(device: torch.device) -> None:
    """Every fused one-row variant of an FP8 ``Linear``, every scale layout, within the
    bound of float64 over the dequantised weight (see the module docstring)."""
    shapes = _shapes(device)
    hq, hk, d = shapes["heads"]
    hidden, inner = shapes["hidden"], shapes["inner"]
    eps = 1e-5
    seed = 0
    for layout, dtype in itertools.product(
        [name for name, _, _ in LAYOUTS], (torch.bfloat16, torch.float32)
    ):
        u = unit(dtype, device)
        # the norm's and the prologues' roundings of each input element, and float32 math
        slack_in = 3 * u + 1e-6
        seed += 100
        tag = f"{layout} {dtype}"
        x = randn(1, hidden, dtype=dtype, device=device, seed=seed)
        r = randn(1, hidden, dtype=dtype, device=device, seed=seed + 1)
        g = randn(hidden, dtype=dtype, device=device, seed=seed + 2, scale=0.5) + 1
        res64 = (x.double() + r.double()).to(dtype)

        # q/k/v: plain product with a bias, then norm + residual + rotary
        n_qkv, rot_rows = (hq + 2 * hk) * d, (hq + hk) * d
        qkv, w64 = fp8_linear(
            n_qkv, hidden, layout, dtype=dtype, device=device, seed=seed + 3, bias=True
        )
        with torch.inference_mode(), poisoned(device):
            got = qkv(x)
        ref = x.double() @ w64.T + qkv.bias.double()
        within(f"plain {tag}", got, ref, product_bound(x.double(), w64, qkv.bias, ref, u))
        assert len(built(qkv, "plain")) == 1, f"plain {tag}: the kernel did not run"
        if layout == "square-blocks":
            (proj,) = built(qkv, "plain")
            assert proj.scale.shape[0] == -(-n_qkv // 128), f"{tag}: scales not in block form"

        from backplane.models.linear import RotaryEpilogue

        half = d // 2
        cos = randn(1, half, dtype=dtype, device=device, seed=seed + 4).cos()
        sin = randn(1, half, dtype=dtype, device=device, seed=seed + 4).sin()
        for with_res, rotary in (
            (False, None),
            (True, None),
            (True, RotaryEpilogue(cos, sin, rot_rows)),
        ):
            name = f"norm residual={with_res} rotary={rotary is not None} {tag}"
            with torch.inference_mode(), poisoned(device):
                out = qkv.forward_normed(x, r if with_res else None, g, eps, False, rotary=rotary)
            assert out is not None, f"{name}: the fused kernel was not taken"
            y, res = out
            stream = res64 if with_res else x
            if with_res:
                equal(f"{name} residual", res, stream)
            else:
                assert res is x, f"{name}: without a residual the stream is x itself"
            h64 = rms64(stream.double(), g, eps, False)
            ref = h64 @ w64.T + qkv.bias.double()
            bnd = product_bound(h64, w64, qkv.bias, ref, u)
            bnd = bnd + slack_in * (h64.abs() @ w64.abs().T)
            if rotary is not None:
                c, s = cos.double().reshape(-1), sin.double().reshape(-1)
                heads = ref[:, :rot_rows].reshape(hq + hk, 2, half)
                b_heads = bnd[:, :rot_rows].reshape(hq + hk, 2, half)
                y1, y2 = heads[:, 0], heads[:, 1]
                b1, b2 = b_heads[:, 0], b_heads[:, 1]
                o1, o2 = y1 * c - y2 * s, y2 * c + y1 * s
                rnd1 = 2 * u * ((y1 * c).abs() + (y2 * s).abs() + o1.abs())
                rnd2 = 2 * u * ((y2 * c).abs() + (y1 * s).abs() + o2.abs())
                ob1 = b1 * c.abs() + b2 * s.abs() + rnd1
                ob2 = b2 * c.abs() + b1 * s.abs() + rnd2
                ref = torch.cat([torch.stack([o1, o2], 1).reshape(1, -1), ref[:, rot_rows:]], 1)
                bnd = torch.cat([torch.stack([ob1, ob2], 1).reshape(1, -1), bnd[:, rot_rows:]], 1)
            within(name, y, ref, bnd)
        assert len(built(qkv, "norm")) == 2, f"{tag}: the normed variants were not built"

        # gate/up: norm + residual, zero-centred; the up projection of a non-gated MLP with
        # ReLU² as the epilogue, with and without the norm
        gate_up, w64 = fp8_linear(
            2 * inner, hidden, layout, dtype=dtype, device=device, seed=seed + 5, bias=False
        )
        with torch.inference_mode(), poisoned(device):
            out = gate_up.forward_normed(x, r, g - 1, eps, True)
        assert out is not None, f"gate/up norm {tag}: the fused kernel was not taken"
        h64 = rms64(res64.double(), g - 1, eps, True)
        ref = h64 @ w64.T
        bnd = product_bound(h64, w64, None, ref, u) + slack_in * (h64.abs() @ w64.abs().T)
        within(f"gate/up zero-centred norm {tag}", out[0], ref, bnd)
        equal(f"gate/up residual {tag}", out[1], res64)

        up, w64 = fp8_linear(
            inner, hidden, layout, dtype=dtype, device=device, seed=seed + 6, bias=True
        )
        with torch.inference_mode(), poisoned(device):
            got = up.forward_activated(x, "relu2")
            normed = up.forward_normed(x, r, g, eps, False, act="relu2")
        assert got is not None and normed is not None, (
            f"relu2 {tag}: the fused kernel was not taken"
        )
        p64 = x.double() @ w64.T + up.bias.double()
        ref, bnd = relu2_bound(p64, product_bound(x.double(), w64, up.bias, p64, u), u)
        within(f"relu2 epilogue {tag}", got, ref, bnd)
        h64 = rms64(res64.double(), g, eps, False)
        p64 = h64 @ w64.T + up.bias.double()
        pre = product_bound(h64, w64, up.bias, p64, u) + slack_in * (h64.abs() @ w64.abs().T)
        ref, bnd = relu2_bound(p64, pre, u)
        within(f"norm + relu2 epilogue {tag}", normed[0], ref, bnd)

        # down: the gated product as the prologue, split over the reduction
        n_down, k_down = shapes["down"]
        down, w64 = fp8_linear(
            n_down, k_down, layout, dtype=dtype, device=device, seed=seed + 7, bias=False
        )
        gu = randn(1, 2 * k_down, dtype=dtype, device=device, seed=seed + 8)
        with torch.inference_mode(), poisoned(device):
            got = down.forward_gated(gu, "silu")
        assert got is not None, f"gated {tag}: the fused kernel was not taken"
        (proj,) = built(down, "gated")
        assert proj.split_k > 1, f"gated {tag}: the down projection was not split ({proj.launch})"
        gate64, up64 = gu.double()[:, :k_down], gu.double()[:, k_down:]
        h64 = silu64(gate64) * up64
        ref = h64 @ w64.T
        bnd = product_bound(h64, w64, None, ref, u) + slack_in * (h64.abs() @ w64.abs().T)
        within(f"gated prologue {tag}", got, ref, bnd)
        # the plain product of the same weight, split too, equals the unfused path's
        with torch.inference_mode(), poisoned(device):
            plain = down(gu[:, :k_down].contiguous())
        ref = gate64 @ w64.T
        within(f"split plain {tag}", plain, ref, product_bound(gate64, w64, None, ref, u))


def _greedy(lm: Any, backends: dict[str, Any], device: torch.device, steps: int):
    """Greedy generation: a prompt's prefill, then ``steps`` one-token decode steps.

    :return: ``(generated tokens, logits [steps + 1, vocab])``.
    """
    from backplane.core.forward_context import forward_context, plan_step
    from backplane.core.packing import build_batch_metadata

    page_size = 4
    lm.allocate_caches(
        num_pages=8, page_size=page_size, num_slots=2, dtype=torch.float32, device=device
    )
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (7,), generator=g).tolist()
    prompt_len, cached, logits = len(tokens), 0, []
    for _ in range(steps + 1):
        new = tokens[cached:]
        batch = build_batch_metadata(
            [len(new)], [cached], [[1, 2, 3, 4, 5]], page_size, state_slots=[1], device=device
        )
        ids = torch.tensor(new, dtype=torch.int64, device=device)
        with torch.inference_mode(), forward_context(batch, plan_step(backends, batch)):
            hidden = lm(ids, batch.positions)
            row = lm.compute_logits(hidden[batch.num_tokens - 1 : batch.num_tokens])[0]
        logits.append(row)
        cached = len(tokens)
        tokens.append(int(row.argmax()))
    return tokens[prompt_len:], torch.stack(logits)


def _requantize_blocks(lm: Any, block: int) -> None:
    """Give every FP8 projection of ``lm`` block scales of ``block x block``."""
    from backplane.models.linear import Linear
    from backplane.models.quant.fp8 import dequantize_rows, quantize_weight, row_scales
    from backplane.models.quant.projection import convert_linear

    for lin in lm.modules():
        if not isinstance(lin, Linear) or lin.quant is None:
            continue
        with torch.no_grad():
            w = dequantize_rows(lin.weight, lin.weight_scale, lin.quant.block_k, torch.float32)
            q, scale = quantize_weight(w, "block", (block, block))
            convert_linear(lin, block)
            lin.weight.copy_(q)
            lin.weight_scale.copy_(row_scales(scale, *w.shape, "block", (block, block)))


def check_model(layout: str, device: torch.device) -> None:
    """``tiny-llama`` with FP8 weights: the same greedy tokens (and logits within float32
    rounding) with the fused one-row kernels as with torch; the fused variants built for
    every layer and no separate norm, rotary or activation kernel run inside the layers
    at one row.

    :param layout: ``"channel"`` (quantised on load) or ``"blocks"`` (32x32 blocks).
    """
    from backplane.core.registry import get_registry
    from backplane.kernels import load_gemv
    from backplane.models.fused import load_kernels
    from backplane.models.presets import build_preset
    from backplane.models.quant.loading import quantize_model
    from backplane.testing.plugin import load_backend

    backends = {"attention": load_backend(get_registry().get("attention", "torch"))}
    lm = build_preset("tiny-llama", device=device, backends=backends).model
    assert quantize_model(lm) > 0
    if layout == "blocks":
        _requantize_blocks(lm, 32)
    steps = 5
    assert lm.set_fused_ops("torch") == "torch"
    want_tokens, want = _greedy(lm, backends, device, steps)

    gemv, ew = load_gemv(), load_kernels()
    builds: list[dict[str, Any]] = []
    original = gemv.OneRowProjection

    class Recording(original):
        def __init__(self, weight: torch.Tensor, bias: Any = None, **kwargs: Any) -> None:
            super().__init__(weight, bias, **kwargs)
            builds.append({"weight": weight, **kwargs})

    calls: dict[str, int] = {}
    names = ("rms_norm", "add_rms_norm", "act_and_mul", "activation", "rotary_")
    funcs = {name: getattr(ew, name) for name in names}

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if args and args[0].shape[0] == 1:
                calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    try:
        gemv.OneRowProjection = Recording
        for name, fn in funcs.items():
            setattr(ew, name, counting(name, fn))
        assert lm.set_fused_ops("triton") == "triton"
        got_tokens, got = _greedy(lm, backends, device, steps)
    finally:
        gemv.OneRowProjection = original
        for name, fn in funcs.items():
            setattr(ew, name, fn)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got_tokens == want_tokens, f"{layout}: greedy tokens {got_tokens} != {want_tokens}"

    layers = list(lm.model.layers)
    # The LM head stays in full precision; every FP8 projection reads its scales.
    fp8 = [b for b in builds if b["weight"].dtype == torch.float8_e4m3fn]
    assert all(b.get("scale") is not None for b in fp8), "an FP8 projection read no scales"
    # q/k/v, o, gate/up and down of every layer, each built once
    assert len(fp8) == 4 * len(layers), f"{layout}: {len(fp8)} FP8 one-row projections built"
    normed = [b for b in fp8 if b.get("norm") is not None]
    rotated = [b for b in normed if b.get("rotary") is not None]
    # 1B-class rows: gate/up stores act(gate) * up, down reads it plain (gemv.glu_pays)
    glu = [b for b in normed if b.get("glu") is not None]
    plain = [b for b in fp8 if b.get("norm") is None and b.get("gate_act") is None]
    assert len(normed) == 2 * len(layers), f"{layout}: {len(normed)} normed projections built"
    assert len(rotated) == len(layers), f"{layout}: {len(rotated)} rotated projections built"
    assert len(glu) == len(layers), f"{layout}: {len(glu)} gated epilogues built"
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert any(b["weight"] is attn.qkv_proj.weight for b in rotated), f"layer {i} qkv"
        assert any(b["weight"] is mlp.gate_up_proj.weight for b in glu), f"layer {i} gate/up"
        assert any(b["weight"] is mlp.down_proj.weight for b in plain), f"layer {i} down"
    if layout == "blocks":
        assert all(b["scale_k"] == 32 for b in fp8), "block scales not read per block"
    # At one row only the final norm runs as a kernel of its own (one per decode step).
    inner = {name: calls.get(name, 0) for name in ("act_and_mul", "activation", "rotary_")}
    assert not any(inner.values()), f"{layout}: separate kernels ran at one row: {inner}"
    norms = calls.get("rms_norm", 0) + calls.get("add_rms_norm", 0)
    assert norms <= steps, f"{layout}: {norms} separate norms in {steps} one-row steps"


def run_check(check: str, device: torch.device) -> None:
    """Run one check on ``device``; raise ``AssertionError`` on a mismatch.

    :param check: a name of :data:`CHECKS`.
    :param device: ``cpu`` (in the interpreter) or ``cuda``.
    """
    if check.startswith("model-"):
        check_model(check.split("-", 1)[1], device)
        return
    globals()[f"check_{check}"](device)


# -- the child side -------------------------------------------------------------------------

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CHECKS, lambda name: run_check(name, torch.device("cpu"))))
