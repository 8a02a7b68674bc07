"""Dense feed-forward: the :class:`MLP` block and its activations.

Activations are looked up by their HF config names (:data:`ACTIVATIONS`,
:func:`activation`); the MoE experts use the same table. Gated blocks compute
``gate`` and ``up`` as one matmul and apply the activation with
:func:`gated_activation`. The :class:`MLP` runs its activation through
:mod:`backplane.models.fused` with its ``fused_ops`` choice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from backplane.core.errors import ConfigError
from backplane.kernels import load_gemv
from backplane.models.fused import (
    act_and_mul,
    apply_activation,
    gelu_tanh,
    relu_squared,
    silu_and_mul,
)
from backplane.models.linear import InputProjection
from backplane.models.parallel import (
    column_parallel_linear,
    merged_column_parallel_linear,
    row_parallel_linear,
)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "relu2": relu_squared,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": gelu_tanh,
}


#: activations the one-row projection kernel applies as its epilogue, by
#: function (those whose float32 arithmetic the kernel reproduces exactly)
_EPILOGUE_ACTS: dict[Callable[[torch.Tensor], torch.Tensor], str] = {
    F.relu: "relu",
    relu_squared: "relu2",
    F.silu: "silu",
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return the activation function called ``name`` in HF configs.

    :raises ConfigError: for an unknown name, listing the supported ones.
    """
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ConfigError(
            f"unsupported activation {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}"
        ) from None


def gated_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return ``f(gate_up) = act(gate) * up`` for a fused ``[..., 2I]`` gate/up output.

    :param name: the activation's HF config name (SiLU gets :func:`silu_and_mul`).
    :raises ConfigError: for an unknown name.
    """
    fn = activation(name)
    if fn is F.silu:
        return silu_and_mul
    return lambda gate_up: act_and_mul(gate_up, fn)


class MLP(nn.Module):
    """Feed-forward block: ``down(act(gate(x)) * up(x))``, or ``down(act(up(x)))`` when not gated.

    The gated form holds ``gate_proj`` and ``up_proj`` as one
    :class:`~backplane.models.linear.MergedLinear`, ``gate_up_proj``.
    On a tensor-parallel rank the inner channels are split: ``gate_up_proj``
    (or ``up_proj``) is column-parallel, ``down_proj`` row-parallel.

    :param hidden_size: model width.
    :param intermediate_size: inner width.
    :param act: activation name (``silu``, ``relu2``, ...).
    :param gated: has a ``gate_proj`` (Llama style); ``False`` for Nemotron-H.
    :param bias: the projections have biases.
    :param reduce: all-reduce the output over the tensor-parallel ranks;
        ``False`` returns this rank's partial sum, for a caller that adds it to
        other partial results and reduces once (the MoE's shared experts).
    """

    #: ``"torch"`` or ``"triton"``: who runs the activation (:mod:`backplane.models.fused`)
    fused_ops: str = "torch"

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str = "silu",
        gated: bool = True,
        bias: bool = False,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        self.gated = gated
        self.act_fn = activation(act)
        if gated:
            self.gate_up_proj = merged_column_parallel_linear(
                hidden_size,
                [("gate_proj", intermediate_size), ("up_proj", intermediate_size)],
                bias=bias,
            )
        else:
            self.up_proj = column_parallel_linear(
                hidden_size, intermediate_size, bias=bias, what="MLP channels"
            )
        self.down_proj = row_parallel_linear(
            intermediate_size, hidden_size, bias=bias, reduce=reduce, what="MLP channels"
        )

    def input_projection(self, rope: object = None) -> InputProjection | None:
        """The first projection of the input and the activation it may apply as its epilogue.

        A pre-norm layer may run its norm and this projection in one kernel and
        pass the result to :meth:`forward` as ``projected``: ``gate_up_proj``
        forming the gated product as its epilogue where the kernel applies the
        activation (else with none: the gated product follows), or
        ``up_proj`` with the block's activation; ``None`` for a non-gated block
        whose activation the projection kernel does not apply.

        :param rope: not used.
        """
        if self.gated:
            # forward() reads ``projected`` as the gated product exactly when this asks for it.
            return InputProjection(self.gate_up_proj, glu=self._glu_act(self._epilogue_act()))
        act = _EPILOGUE_ACTS.get(self.act_fn)
        return None if act is None else InputProjection(self.up_proj, act)

    def _epilogue_act(self) -> str | None:
        """The activation the one-row kernel applies for this block, or ``None`` where it does not."""
        return _EPILOGUE_ACTS.get(self.act_fn) if self.fused_ops == "triton" else None

    def _glu_act(self, act: str | None) -> str | None:
        """The activation of the gate/up projection's gated epilogue, or ``None`` where the
        down projection forms the product (see :func:`~backplane.kernels.gemv.glu_pays`).

        :param act: :meth:`_epilogue_act`'s answer.
        """
        if act is None or not load_gemv().glu_pays(self.gate_up_proj.in_features):
            return None
        return act

    def forward(
        self, x: torch.Tensor | None, *, projected: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Apply the block to ``x`` ``[T, hidden]``.

        :param x: the normalised input (``None`` when ``projected`` is given).
        :param projected: what :meth:`input_projection` describes, already
            computed for ``x``: the gated product (the gate/up output where the
            kernel does not apply the activation), or the activated up output.
        """
        if self.gated:
            act = self._epilogue_act()
            glu = self._glu_act(act)
            if projected is not None and glu is not None:
                return self.down_proj(projected)
            if projected is None and glu is not None:
                # One-row decode: the gated product as the gate/up projection's epilogue.
                h = self.gate_up_proj.forward_glu(x, glu)
                if h is not None:
                    return self.down_proj(h)
            gate_up = self.gate_up_proj(x) if projected is None else projected
            if act is not None:
                # One-row decode where gate/up runs in cuBLAS: the gated product as
                # the down projection's prologue.
                y = self.down_proj.forward_gated(gate_up, act)
                if y is not None:
                    return y
            h = act_and_mul(gate_up, self.act_fn, fused_ops=self.fused_ops)
        elif projected is not None:
            h = projected
        else:
            h = None
            if self.fused_ops == "triton" and self.act_fn in _EPILOGUE_ACTS:
                # One-row decode: the activation as the up projection's epilogue.
                h = self.up_proj.forward_activated(x, _EPILOGUE_ACTS[self.act_fn])
            if h is None:
                h = apply_activation(self.up_proj(x), self.act_fn, fused_ops=self.fused_ops)
        return self.down_proj(h)
