"""The few-token MoE expert kernels in the Triton interpreter, against a float64 per-token loop.

:func:`backplane.kernels.moe_gemv.moe_gemv` runs the routed experts of ``T``
tokens with ``k`` slots each in two launches. The checks compare it with an
independent reference (one token and one slot at a time, in float64) over
float32 inputs (the interpreter has no bfloat16): gated and non-gated experts,
every activation name it takes, ``T`` of 1 and 3, ``k`` of 1, 2 and 4, hidden
and intermediate sizes that are not multiples of the blocks (and wider than
one block, so the reduction loops run several steps), experts repeated across
tokens and within a token, routing weights of zero, and an output buffer of
NaN before the call (the kernels must write every element). Bad arguments are
refused with a message.

Without CUDA the checks run in one child process (see
``tests/interpreter_checks.py``); run one by hand with::

    TRITON_INTERPRET=1 python tests/test_moe_gemv_interpret.py gated

``tests/test_moe_gemv_gpu.py`` runs the kernels on a GPU.
"""

from __future__ import annotations

import math
import sys

import torch
from interpreter_checks import interpreter_tests, main
from moe_cases import moe_case

CHECKS = ("gated", "ungated", "activations", "edges", "refusals")

#: ``(T, k, E, I, H)``: one token, several; hidden and intermediate sizes odd,
#: one of each above the reduction blocks (512 columns)
SHAPES = (
    (1, 1, 3, 5, 7),
    (1, 4, 6, 13, 37),
    (3, 2, 4, 9, 531),
    (3, 4, 5, 517, 19),
)

# -- the pytest side ----------------------------------------------------------------

if __name__ != "__main__":
    import pytest

    interpret_results, test_in_interpreter = interpreter_tests(__file__, CHECKS, timeout=600)

    @pytest.mark.parametrize("gated", [True, False])
    def test_compiles_for_sm90(gated: bool) -> None:
        """Both kernels compile for Hopper at the Qwen3-Next decode blocks (bfloat16)."""
        triton = pytest.importorskip("triton", reason="triton is not installed")
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from backplane.kernels import moe_gemv

        def compile_(fn, signature: dict[str, str], consts: dict[str, object]) -> None:
            signature = {**signature, **dict.fromkeys(consts, "constexpr")}
            src = ASTSource(fn=fn, signature=signature, constexprs=consts)
            compiled = triton.compile(
                src, target=GPUTarget("cuda", 90, 32), options=dict(moe_gemv._LAUNCH)
            )
            assert compiled.asm["cubin"]

        ints = dict.fromkeys(("inter", "hidden"), "i32")
        compile_(
            moe_gemv._moe_in_kernel,
            {"x_ptr": "*bf16", "ids_ptr": "*i64", "w_ptr": "*bf16", "h_ptr": "*fp32", **ints}
            | dict.fromkeys(("stride_x", "stride_we"), "i32"),
            {
                "TOP_K": 4,
                "GATED": gated,
                "ACT": 0 if gated else 2,
                "BLOCK_I": moe_gemv.BLOCK_I,
                "BLOCK_H": moe_gemv.BLOCK_H,
                "EXACT": True,
            },
        )
        compile_(
            moe_gemv._moe_down_kernel,
            {"h_ptr": "*fp32", "ids_ptr": "*i64", "tw_ptr": "*fp32", "w_ptr": "*bf16"}
            | {"out_ptr": "*bf16", **ints}
            | dict.fromkeys(("stride_we", "stride_out"), "i32"),
            {"TOP_K": 4, "BLOCK_N": moe_gemv.BLOCK_N, "BLOCK_K": moe_gemv.BLOCK_K},
        )


# -- the reference -------------------------------------------------------------------


def _act64(name: str, v: float) -> float:
    """The activation of one float64 value, written out from its definition."""
    if name in ("silu", "swish"):
        return v / (1.0 + math.exp(-v))
    if name == "relu":
        return max(v, 0.0)
    if name == "relu2":
        return max(v, 0.0) ** 2
    if name == "gelu":
        return 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))
    if name == "gelu_pytorch_tanh":
        return 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))
    raise ValueError(name)


def reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w_in: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    gated: bool,
) -> torch.Tensor:
    """One token and one routed slot at a time, in float64.

    :return: ``[T, H]`` float64.
    """
    inter = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            w = w_in[e].double()
            up = w[inter:] @ xt if gated else w @ xt
            if gated:
                gate = w[:inter] @ xt
                h = torch.tensor([_act64(act, float(g)) for g in gate], dtype=torch.float64) * up
            else:
                h = torch.tensor([_act64(act, float(u)) for u in up], dtype=torch.float64)
            out[t] += float(weights[t, j]) * (w_down[e].double() @ h)
    return out


def _case(
    shape: tuple[int, int, int, int, int], gated: bool, seed: int
) -> tuple[torch.Tensor, ...]:
    """Seeded float32 inputs (see :func:`moe_cases.moe_case`)."""
    return moe_case(shape, gated, seed)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert not got.isnan().any(), f"{what}: NaN in the output (an element left unwritten?)"
    torch.testing.assert_close(
        got.double(), want, rtol=2e-5, atol=2e-5, msg=lambda m: f"{what}: {m}"
    )


# -- the checks ------------------------------------------------------------------------


def _run_shapes(gated: bool, act: str) -> None:
    from backplane.kernels.moe_gemv import moe_gemv

    for seed, shape in enumerate(SHAPES):
        x, ids, weights, w_in, w_down = _case(shape, gated, seed)
        got = moe_gemv(x, ids, weights, w_in, w_down, act, gated)
        assert got.dtype == x.dtype and got.shape == x.shape
        _close(got, reference(x, ids, weights, w_in, w_down, act, gated), f"{act} {shape}")


def check_gated() -> None:
    """Gated SiLU experts (Qwen3-Next, DeepSeek) over every shape."""
    _run_shapes(True, "silu")


def check_ungated() -> None:
    """Non-gated ReLU² experts (Nemotron-H) over every shape."""
    _run_shapes(False, "relu2")


def check_activations() -> None:
    """Every activation name, gated and not, at one shape wider than a block."""
    from backplane.kernels.moe_gemv import ACT_NAMES, moe_gemv

    for seed, (act, gated) in enumerate((a, gt) for a in ACT_NAMES for gt in (True, False)):
        x, ids, weights, w_in, w_down = _case((2, 2, 3, 11, 523), gated, 100 + seed)
        got = moe_gemv(x, ids, weights, w_in, w_down, act, gated)
        _close(got, reference(x, ids, weights, w_in, w_down, act, gated), f"{act} gated={gated}")


def check_edges() -> None:
    """Zero routing weights, one expert for every pair, int32 ids, rows of ``x`` in a
    wider tensor, and outputs written into buffers of NaN."""
    from backplane.kernels import moe_gemv as mod

    x, ids, weights, w_in, w_down = _case((3, 4, 5, 13, 37), True, 7)
    weights[1] = 0.0
    weights[2, 1] = 0.0
    _close(
        mod.moe_gemv(x, ids, weights, w_in, w_down, "silu", True),
        reference(x, ids, weights, w_in, w_down, "silu", True),
        "zero weights",
    )
    # every pair on one expert (each token's slots repeat it)
    same = torch.full_like(ids, 2)
    _close(
        mod.moe_gemv(x, same.int(), weights, w_in, w_down, "silu", True),
        reference(x, same, weights, w_in, w_down, "silu", True),
        "one expert, int32 ids",
    )
    # a column slice of a wider tensor: rows of stride 2 * H
    wide = torch.randn(3, 2 * 37, generator=torch.Generator().manual_seed(8))
    xs = wide[:, :37]
    _close(
        mod.moe_gemv(xs, ids, weights, w_in, w_down, "silu", True),
        reference(xs, ids, weights, w_in, w_down, "silu", True),
        "strided x",
    )
    # every output element is written: a buffer of NaN must come back without one
    out = torch.full(x.shape, float("nan"))
    got = mod.moe_gemv(x, ids, weights, w_in, w_down, "silu", True, out=out)
    assert got.data_ptr() == out.data_ptr()
    _close(got, reference(x, ids, weights, w_in, w_down, "silu", True), "poisoned output")
    for act, gated in (("relu2", False), ("gelu", True)):
        xu, idu, wu, w_inu, w_downu = _case((3, 2, 4, 9, 531), gated, 11)
        out = torch.full(xu.shape, float("nan"))
        mod.moe_gemv(xu, idu, wu, w_inu, w_downu, act, gated, out=out)
        _close(out, reference(xu, idu, wu, w_inu, w_downu, act, gated), f"poisoned {act}")
    # no tokens
    empty = mod.moe_gemv(x[:0], ids[:0], weights[:0], w_in, w_down, "silu", True)
    assert empty.shape == (0, 37)


def check_refusals() -> None:
    """Bad arguments raise with what was wrong; :func:`supports` says no to what the kernels skip."""
    from backplane.kernels import moe_gemv as mod

    x, ids, weights, w_in, w_down = _case((2, 2, 3, 5, 7), True, 9)

    def refused(exc: type[Exception], text: str, *args) -> None:
        try:
            mod.moe_gemv(*args)
        except exc as e:
            assert text in str(e), f"{text!r} not in {e}"
        else:
            raise AssertionError(f"{exc.__name__} not raised for {text}")

    refused(ValueError, "not 'tanh'", x, ids, weights, w_in, w_down, "tanh", True)
    refused(ValueError, "w_in has shape", x, ids, weights, w_in, w_down, "silu", False)
    refused(ValueError, "topk_weights", x, ids, weights[:, :1], w_in, w_down, "silu", True)
    refused(TypeError, "convert", x.double(), ids, weights, w_in, w_down, "silu", True)
    refused(TypeError, "int32 or int64", x, ids.short(), weights, w_in, w_down, "silu", True)
    refused(ValueError, "out must be", x, ids, weights, w_in, w_down, "silu", True, x[:1])
    strided = torch.randn(3, 7, 10)[:, :, :5]
    refused(ValueError, "contiguous", x, ids, weights, w_in, strided, "silu", True)
    assert mod.supports(x, 4, w_in, w_down, "silu")
    assert not mod.supports(x, 4, w_in, w_down, "tanh")
    assert not mod.supports(x, 0, w_in, w_down, "silu")
    assert not mod.supports(x.double(), 4, w_in.double(), w_down.double(), "silu")
    assert not mod.supports(x, 4, w_in, strided, "silu")


def run_check(name: str) -> tuple[str, str] | None:
    """Run one check by name (see :func:`interpreter_checks.main`)."""
    globals()[f"check_{name}"]()
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CHECKS, run_check))
