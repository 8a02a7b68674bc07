""":class:`GatedDeltaNetMixer`: Gated DeltaNet over the ``ssm`` (conv) and ``delta`` families."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backplane.core.errors import ConfigError
from backplane.core.families import ConvLayerSpec, DeltaLayerSpec
from backplane.models.mixers.base import CachedMixer
from backplane.models.norm import GatedRMSNorm


class GatedDeltaNetMixer(CachedMixer):
    """Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5).

    Projections -> causal conv over ``[q, k, v]`` (``ssm`` family ``conv``) ->
    gated delta rule (``delta`` family) -> gated RMS norm with ``z`` -> out_proj.

    :param fused_qkvz: Qwen3-Next layout: one ``in_proj_qkvz`` and one
        ``in_proj_ba`` whose outputs are grouped per key head; ``False`` is the
        Qwen3.5 layout (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).
    """

    families = ("ssm", "delta")

    def __init__(
        self,
        layer_id: int,
        conv_backend: Any,
        delta_backend: Any,
        hidden_size: int,
        *,
        num_k_heads: int,
        num_v_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        conv_kernel: int,
        fused_qkvz: bool,
        norm_eps: float = 1e-6,
        act: str = "silu",
    ) -> None:
        super().__init__()
        self.conv_backend, self.delta_backend = conv_backend, delta_backend
        self.nk, self.nv, self.dk, self.dv = num_k_heads, num_v_heads, k_head_dim, v_head_dim
        self.key_dim, self.value_dim = num_k_heads * k_head_dim, num_v_heads * v_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.fused_qkvz = fused_qkvz
        if act not in ("silu", "swish"):
            raise ConfigError(
                f"gated delta net conv activation {act!r} is not supported (only silu)"
            )
        if fused_qkvz:
            self.in_proj_qkvz = nn.Linear(
                hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False
            )
            self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel))
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads))
        self.norm = GatedRMSNorm(v_head_dim, norm_eps, norm_before_gate=True)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.conv_spec = ConvLayerSpec(
            layer_id=layer_id, conv_dim=self.conv_dim, kernel_size=conv_kernel, activation="silu"
        )
        self.delta_spec = DeltaLayerSpec(
            layer_id=layer_id,
            num_k_heads=num_k_heads,
            num_v_heads=num_v_heads,
            k_head_dim=k_head_dim,
            v_head_dim=v_head_dim,
            use_qk_l2norm=True,
        )

    def cache_specs(self, *, num_pages, page_size, num_slots, dtype):
        """Conv state from the ``ssm`` backend and recurrent state from the ``delta`` backend."""
        specs = dict(
            self.conv_backend.conv_cache_spec(self.conv_spec, num_slots=num_slots, dtype=dtype)
        )
        specs.update(
            self.delta_backend.cache_spec(self.delta_spec, num_slots=num_slots, dtype=dtype)
        )
        return specs

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = x.shape[0]
        if not self.fused_qkvz:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        # Qwen3-Next groups the projections per key head: [q, k, v-group, z-group] per head.
        r = self.nv // self.nk
        qkvz = self.in_proj_qkvz(x).view(t, self.nk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        ba = self.in_proj_ba(x).view(t, self.nk, 2 * r)
        b, a = ba.split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, -1), b.reshape(t, self.nv), a.reshape(t, self.nv)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Mix ``x`` ``[T, hidden]``."""
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        mixed = self.conv_backend.conv(
            mixed.contiguous(),
            self.conv1d.weight.view(self.conv_dim, -1),
            None,
            self.cache("conv_state"),
            self.conv_spec,
        )
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = torch.sigmoid(b.float())
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        o = self.delta_backend.forward(
            q.reshape(t, self.nk, self.dk).contiguous(),
            k.reshape(t, self.nk, self.dk).contiguous(),
            v.reshape(t, self.nv, self.dv).contiguous(),
            g.contiguous(),
            beta.contiguous(),
            self.cache("delta_state"),
            self.delta_spec,
        )
        o = self.norm(o.reshape(t, self.nv, self.dv), z.reshape(t, self.nv, self.dv))
        return self.out_proj(o.reshape(t, self.value_dim).to(x.dtype))
