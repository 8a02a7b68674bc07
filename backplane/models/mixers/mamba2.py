""":class:`Mamba2Mixer`: the Mamba2 mixer over the ``ssm`` op family (``conv`` and ``scan``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from backplane.core.errors import ConfigError
from backplane.core.families import ConvLayerSpec, SSMLayerSpec
from backplane.models.mixers.base import CachedMixer
from backplane.models.norm import GatedRMSNorm
from backplane.models.rotary import RopeCosSin


class Mamba2Mixer(CachedMixer):
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
        self.backend = backend
        self.num_heads, self.head_dim, self.d_state, self.n_groups = (
            num_heads,
            head_dim,
            d_state,
            n_groups,
        )
        self.inner = num_heads * head_dim
        self.conv_dim = self.inner + 2 * n_groups * d_state
        if act not in ("silu", "swish"):
            raise ConfigError(f"Mamba2 conv activation {act!r} is not supported (only silu)")
        self.in_proj = nn.Linear(
            hidden_size, self.inner + self.conv_dim + num_heads, bias=proj_bias
        )
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel))
        self.conv1d.bias = nn.Parameter(torch.empty(self.conv_dim)) if conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.D = nn.Parameter(torch.empty(num_heads))
        self.norm = GatedRMSNorm(
            self.inner, norm_eps, group_size=self.inner // n_groups, norm_before_gate=False
        )
        self.out_proj = nn.Linear(self.inner, hidden_size, bias=proj_bias)
        self.conv_spec = ConvLayerSpec(
            layer_id=layer_id, conv_dim=self.conv_dim, kernel_size=conv_kernel, activation="silu"
        )
        self.ssm_spec = SSMLayerSpec(
            layer_id=layer_id,
            nheads=num_heads,
            head_dim=head_dim,
            d_state=d_state,
            n_groups=n_groups,
            dt_softplus=True,
            chunk_size=chunk_size,
        )

    def cache_specs(self, *, num_pages, page_size, num_slots, dtype):
        """Conv state and SSM state from the ``ssm`` backend."""
        specs = dict(self.backend.conv_cache_spec(self.conv_spec, num_slots=num_slots, dtype=dtype))
        specs.update(self.backend.cache_spec(self.ssm_spec, num_slots=num_slots, dtype=dtype))
        return specs

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        rope: RopeCosSin | None = None,
    ) -> torch.Tensor:
        """Mix ``x`` ``[T, hidden]`` (``positions`` and ``rope`` are not used)."""
        t = x.shape[0]
        proj = self.in_proj(x)
        gate, xbc, dt = proj.split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        xbc = self.backend.conv(
            xbc.contiguous(),
            self.conv1d.weight.view(self.conv_dim, -1),
            self.conv1d.bias,
            self.cache("conv_state"),
            self.conv_spec,
        )
        gs = self.n_groups * self.d_state
        xs, B, C = xbc.split([self.inner, gs, gs], dim=-1)
        y = self.backend.scan(
            xs.reshape(t, self.num_heads, self.head_dim).contiguous(),
            dt.contiguous(),
            -torch.exp(self.A_log.float()),
            B.reshape(t, self.n_groups, self.d_state).contiguous(),
            C.reshape(t, self.n_groups, self.d_state).contiguous(),
            self.D,
            self.dt_bias,
            None,
            self.cache("ssm_state"),
            self.ssm_spec,
        )
        y = self.norm(y.reshape(t, self.inner), gate)
        return self.out_proj(y.to(x.dtype))
