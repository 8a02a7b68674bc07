"""The gated input of the packed one-row kernels (``packed_gemv(x, packed, gate_act=act)``).

Shared by the Q4_K and Q6_K kernel tests, in the interpreter and on a GPU. The
kernel reads a gated MLP's ``[gate | up]`` row and multiplies ``act(gate) *
up``, rounded as the gated activation kernel
(:func:`backplane.kernels.elementwise.act_and_mul`) rounds it; so its output
must be bit for bit that kernel's followed by the plain product, for every
activation it takes (in bfloat16; SiLU in float32 too), with the output poisoned
first. Inputs of the wrong width and activations it does not form are
refused.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch


def check_gated(
    qp: ModuleType, packed: Any, k: int, device: torch.device, launches: tuple = (None,)
) -> None:
    """Every activation of ``qp.GATE_ACTS`` in bfloat16, and SiLU in float32, over ``packed``
    (``[N, k]``).

    :param qp: the kernel module (``qgemv_packed`` or ``qgemv_packed_q6k``).
    :param packed: a repacked weight on ``device``.
    :param k: its width.
    :param device: where the inputs go.
    :param launches: launches to run (``None``: the planned one).
    """
    from backplane.kernels.elementwise import act_and_mul

    gen = torch.Generator().manual_seed(k)
    # every activation once, the roundings of bfloat16 for most
    cases = [(torch.bfloat16, act) for act in qp.GATE_ACTS] + [(torch.float32, "silu")]
    x = None
    for launch in launches:
        for dtype, act in cases:
            # gates on both sides of zero and far into the activations' tails
            x = (3 * torch.randn(1, 2 * k, generator=gen)).to(device, dtype)
            want = qp.packed_gemv(act_and_mul(x, act), packed, launch=launch)
            out = torch.full_like(want, float("nan"))
            got = qp.packed_gemv(x, packed, out=out, launch=launch, gate_act=act)
            assert got.data_ptr() == out.data_ptr(), "the output buffer was not used"
            same = got == want
            assert same.all(), (
                f"{act} {dtype} {launch}: {int((~same).sum())} of {want.numel()} outputs "
                f"differ from act_and_mul then the product, first at "
                f"{(~same).nonzero()[0].tolist()}: {got[~same][0]} against {want[~same][0]}"
            )
    assert x is not None
    for bad, act, message in (
        (x[:, :k], "silu", f"one input row of {2 * k}"),
        (x, "gelu_tanh", "no gated input"),
        (x, "swish", "no gated input"),
    ):
        try:
            qp.packed_gemv(bad, packed, gate_act=act)
        except ValueError as e:
            assert message in str(e), (message, str(e))
        else:
            raise AssertionError(f"no ValueError for {tuple(bad.shape)} with {act!r}")
