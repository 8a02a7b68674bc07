""":class:`Mamba2Mixer`: the Mamba2 mixer over the ``ssm`` op family (``conv`` and ``scan``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from backplane.core.families import SSMLayerSpec
from backplane.models.linear import InputProjection, Linear
from backplane.models.mixers.base import ConvStateMixer
from backplane.models.norm import GatedRMSNorm
from backplane.models.rotary import RopeCosSin


class Mamba2Mixer(ConvStateMixer):
    """Mamba2 mixer (Nemotron-H): in_proj -> causal conv -> selective scan -> gated norm -> out_proj.

    Uses the ``ssm`` family's ``conv`` and ``scan``.
    """

    families = ("ssm",)

    def __init__(
        self,
        layer_id: int,
        backend: Any,
        hidden_size: int,
        *,
        num_heads: int,
        head_dim: int,
        d_state: int,
        n_groups: int,
        conv_kernel: int,
        conv_bias: bool = True,
        proj_bias: bool = False,
        norm_eps: float = 1e-5,
        chunk_size: int = 256,
        act: str = "silu",
    ) -> None:
        super().__init__()
        self.conv_backend = self.state_backend = backend
        self.num_heads, self.head_dim, self.d_state, self.n_groups = (
            num_heads,
            head_dim,
            d_state,
            n_groups,
        )
        self.inner = num_heads * head_dim
        self.conv_dim = self.inner + 2 * n_groups * d_state
        self.in_proj = Linear(hidden_size, self.inner + self.conv_dim + num_heads, bias=proj_bias)
        self.init_conv(layer_id, conv_kernel, num_heads, act=act, name="Mamba2", bias=conv_bias)
        self.D = nn.Parameter(torch.empty(num_heads))
        self.norm = GatedRMSNorm(
            self.inner, norm_eps, group_size=self.inner // n_groups, norm_before_gate=False
        )
        self.out_proj = Linear(self.inner, hidden_size, bias=proj_bias)
        self.state_spec = SSMLayerSpec(
            layer_id=layer_id,
            nheads=num_heads,
            head_dim=head_dim,
            d_state=d_state,
            n_groups=n_groups,
            dt_softplus=True,
            chunk_size=chunk_size,
        )

    def input_projection(self, rope: RopeCosSin | None = None) -> InputProjection:
        """The first projection of the input (``in_proj``), with no activation.

        A pre-norm layer may run its norm and this projection in one kernel and
        pass the result to :meth:`forward` as ``projected``.

        :param rope: not used.
        """
        return InputProjection(self.in_proj)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor | None,
        rope: RopeCosSin | None = None,
        *,
        projected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mix ``x`` ``[T, hidden]`` (``positions`` and ``rope`` are not used).

        :param x: the normalised input (``None`` when ``projected`` is given).
        :param projected: ``in_proj(x)``, already computed (see :meth:`input_projection`).
        """
        proj = self.in_proj(x) if projected is None else projected
        t = proj.shape[0]
        gate, xbc, dt = proj.split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        xbc = self.conv(xbc)
        gs = self.n_groups * self.d_state
        xs, B, C = xbc.split([self.inner, gs, gs], dim=-1)
        y = self.state_backend.scan(
            xs.reshape(t, self.num_heads, self.head_dim).contiguous(),
            dt.contiguous(),
            self.neg_exp_a,
            B.reshape(t, self.n_groups, self.d_state).contiguous(),
            C.reshape(t, self.n_groups, self.d_state).contiguous(),
            self.D,
            self.dt_bias,
            None,
            self.cache("ssm_state"),
            self.state_spec,
        )
        y = self.norm(y.reshape(t, self.inner), gate)
        return self.out_proj(y.to(proj.dtype))
