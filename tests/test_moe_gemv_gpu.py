"""The few-token MoE expert kernels on a GPU, and ``moe_experts`` running them.

The twin of ``tests/test_moe_gemv_interpret.py`` (the Triton interpreter's
checks): :func:`backplane.kernels.moe_gemv.moe_gemv` in bfloat16, float16 and
float32 against a float64 reference of the same (rounded) inputs, at a
Qwen3-Next decode shape (16 experts of 512, 4 routed, hidden 2048), at the
most pairs the op sends it, and at odd sizes; the
``backplane_models::moe_experts`` op taking it up to
:data:`~backplane.models.moe.FUSED_MAX_PAIRS` pairs and not beyond; and the op
captured in a CUDA graph at two tokens, whose replays equal eager calls bit
for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from interpreter_checks import kernel_gpu
from moe_cases import moe_case

from backplane.models.moe import FUSED_MAX_PAIRS, moe_experts

pytestmark = pytest.mark.gpu

#: float64 activations by HF config name, from torch's float64 functions
ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "relu2": lambda v: F.relu(v) ** 2,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda v: F.gelu(v, approximate="tanh"),
}

#: absolute and relative tolerances by dtype (outputs are of order one)
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}

#: ``(T, k, E, I, H)``: Qwen3-Next decode, the most pairs the op sends, odd sizes
SHAPES = ((1, 4, 16, 512, 2048), (16, 4, 16, 512, 2048), (3, 2, 5, 13, 37), (2, 3, 4, 520, 1030))


@pytest.fixture
def device() -> torch.device:
    """The GPU the Triton kernels run on."""
    return kernel_gpu()


def _case(
    shape: tuple[int, int, int, int, int],
    gated: bool,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    """Seeded inputs (see :func:`moe_cases.moe_case`) on ``device``, floats in ``dtype``."""
    x, ids, weights, w_in, w_down = moe_case(shape, gated, seed)
    return (
        x.to(device, dtype),
        ids.to(device),
        weights.to(device),
        w_in.to(device, dtype),
        w_down.to(device, dtype),
    )


def reference(x, ids, weights, w_in, w_down, act: str, gated: bool) -> torch.Tensor:
    """One token and one routed slot at a time, in float64 on the CPU.

    :return: ``[T, H]`` float64.
    """
    x, ids, weights = x.cpu().double(), ids.cpu(), weights.cpu().double()
    w_in, w_down = w_in.cpu().double(), w_down.cpu().double()
    inter = w_down.shape[2]
    fn = ACTS[act]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            pre = w_in[e] @ x[t]
            h = fn(pre[:inter]) * pre[inter:] if gated else fn(pre)
            out[t] += weights[t, j] * (w_down[e] @ h)
    return out


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    tol = TOL[got.dtype]
    torch.testing.assert_close(
        got.cpu().double(), want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}"
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return t.view(as_int[t.dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(("act", "gated"), [("silu", True), ("relu2", False)])
def test_matches_reference(device, dtype, shape, act, gated) -> None:
    """The kernels against the float64 loop, into a buffer of NaN."""
    from backplane.kernels import load_moe_gemv

    x, ids, weights, w_in, w_down = _case(shape, gated, dtype, device, seed=SHAPES.index(shape))
    out = torch.full(x.shape, float("nan"), dtype=dtype, device=device)
    got = load_moe_gemv().moe_gemv(x, ids, weights, w_in, w_down, act, gated, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    _close(got, reference(x, ids, weights, w_in, w_down, act, gated), f"{dtype} {shape}")


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh"])
def test_gelu_variants(device, act) -> None:
    """Exact and tanh GELU (with the CUDA math library's erf and tanh) against float64."""
    from backplane.kernels import load_moe_gemv

    x, ids, weights, w_in, w_down = _case((2, 2, 4, 40, 96), True, torch.float32, device, 3)
    got = load_moe_gemv().moe_gemv(x, ids, weights, w_in, w_down, act, True)
    _close(got, reference(x, ids, weights, w_in, w_down, act, True), act)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls of the kernels' entry point (the op looks it up on every call)."""
    from backplane.kernels import load_moe_gemv

    mod = load_moe_gemv()
    real = mod.moe_gemv
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "moe_gemv", counted)
    return calls


def test_op_dispatches_few_pairs(device, monkeypatch) -> None:
    """``moe_experts`` runs the kernels up to the pair threshold (equal to a direct call, bit
    for bit) and the grouped path beyond it; both match the float64 loop."""
    from backplane.kernels import load_moe_gemv

    calls = _counting(monkeypatch)
    k = 4
    few = FUSED_MAX_PAIRS // k
    x, ids, weights, w_in, w_down = _case(
        (few + 1, k, 16, 512, 2048), True, torch.bfloat16, device, 5
    )
    got = moe_experts(x[:few], ids[:few], weights[:few], w_in, w_down, "silu", True)
    assert calls == [few]
    direct = load_moe_gemv().moe_gemv(x[:few], ids[:few], weights[:few], w_in, w_down, "silu", True)
    assert torch.equal(_bits(got), _bits(direct))
    _close(got, reference(x[:few], ids[:few], weights[:few], w_in, w_down, "silu", True), "fused")
    many = moe_experts(x, ids, weights, w_in, w_down, "silu", True)
    assert calls == [few, few], "more pairs than FUSED_MAX_PAIRS must take the grouped path"
    _close(many, reference(x, ids, weights, w_in, w_down, "silu", True), "grouped")


def test_op_graph_replay_equals_eager(device, monkeypatch) -> None:
    """``moe_experts`` at two tokens captured in a CUDA graph: replays with the captured and
    with new inputs equal eager calls bit for bit, and the capture ran the kernels."""
    calls = _counting(monkeypatch)
    dtype = torch.bfloat16
    x, ids, weights, w_in, w_down = _case((2, 4, 16, 512, 2048), True, dtype, device, 6)
    static = [x.clone(), ids.clone(), weights.clone()]
    eager = moe_experts(*static, w_in, w_down, "silu", True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe_experts(*static, w_in, w_down, "silu", True)
    assert len(calls) == 2, "the capture did not run the few-token kernels"
    graph.replay()
    assert torch.equal(_bits(static_out), _bits(eager))
    for i in range(3):
        nx, nids, nweights, _, _ = _case((2, 4, 16, 512, 2048), True, dtype, device, 60 + i)
        for dst, src in zip(static, (nx, nids, nweights), strict=True):
            dst.copy_(src)
        graph.replay()
        want = moe_experts(nx, nids, nweights, w_in, w_down, "silu", True)
        assert torch.equal(_bits(static_out), _bits(want)), f"replay {i}"
    # only the routed experts' weights are read: poisoning an unrouted one changes nothing
    unrouted = sorted(set(range(16)) - set(static[1].flatten().tolist()))
    if unrouted:
        before = static_out.clone()
        w_in[unrouted[0]].fill_(float("nan"))
        graph.replay()
        assert torch.equal(_bits(static_out), _bits(before))
