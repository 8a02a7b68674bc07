""":class:`GatedDeltaNetMixer`: Gated DeltaNet over the ``ssm`` (conv) and ``delta`` families."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from backplane.core.families import DeltaLayerSpec
from backplane.models.linear import Linear, MergedLinear
from backplane.models.mixers.base import ConvStateMixer
from backplane.models.norm import GatedRMSNorm
from backplane.models.rotary import RopeCosSin


class GatedDeltaNetMixer(ConvStateMixer):
    """Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5).

    Projections -> causal conv over ``[q, k, v]`` (``ssm`` family ``conv``) ->
    gated delta rule (``delta`` family) -> gated RMS norm with ``z`` -> out_proj.

    The checkpoint's input projections all read the layer input; they are one
    :class:`~backplane.models.linear.MergedLinear`, ``in_proj_qkvzba``.

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
        self.conv_backend, self.state_backend = conv_backend, delta_backend
        self.nk, self.nv, self.dk, self.dv = num_k_heads, num_v_heads, k_head_dim, v_head_dim
        self.key_dim, self.value_dim = num_k_heads * k_head_dim, num_v_heads * v_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.fused_qkvz = fused_qkvz
        if fused_qkvz:
            parts = [
                ("in_proj_qkvz", 2 * self.key_dim + 2 * self.value_dim),
                ("in_proj_ba", 2 * num_v_heads),
            ]
        else:
            parts = [
                ("in_proj_qkv", self.conv_dim),
                ("in_proj_z", self.value_dim),
                ("in_proj_b", num_v_heads),
                ("in_proj_a", num_v_heads),
            ]
        self.in_proj_qkvzba = MergedLinear(hidden_size, parts, bias=False)
        self.init_conv(
            layer_id, conv_kernel, num_v_heads, act=act, name="gated delta net", bias=False
        )
        self.norm = GatedRMSNorm(v_head_dim, norm_eps, norm_before_gate=True)
        self.out_proj = Linear(self.value_dim, hidden_size, bias=False)
        self.state_spec = DeltaLayerSpec(
            layer_id=layer_id,
            num_k_heads=num_k_heads,
            num_v_heads=num_v_heads,
            k_head_dim=k_head_dim,
            v_head_dim=v_head_dim,
            use_qk_l2norm=True,
        )

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Return ``(mixed [T, conv_dim], z [T, V], b [T, nv], a [T, nv])`` (possibly views)."""
        t = x.shape[0]
        proj = self.in_proj_qkvzba.split(self.in_proj_qkvzba(x))
        if not self.fused_qkvz:
            return proj
        # Qwen3-Next groups the projections per key head: [q, k, v-group, z-group] per head.
        r = self.nv // self.nk
        qkvz = proj[0].view(t, self.nk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = proj[1].view(t, self.nk, 2 * r).split([r, r], dim=-1)
        # The conv reads [q | k | v] contiguous: one strided copy per part regroups it.
        mixed = torch.empty(t, self.conv_dim, dtype=x.dtype, device=x.device)
        mq, mk, mv = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        mq.view(t, self.nk, self.dk).copy_(q)
        mk.view(t, self.nk, self.dk).copy_(k)
        mv.view(t, self.nk, r * self.dv).copy_(v)
        return mixed, z.reshape(t, -1), b.reshape(t, self.nv), a.reshape(t, self.nv)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        rope: RopeCosSin | None = None,
    ) -> torch.Tensor:
        """Mix ``x`` ``[T, hidden]`` (``positions`` and ``rope`` are not used)."""
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        mixed = self.conv(mixed)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = torch.sigmoid(b.float())
        g = self.neg_exp_a * F.softplus(a.float() + self.dt_bias.float())
        o = self.state_backend.forward(
            q.reshape(t, self.nk, self.dk).contiguous(),
            k.reshape(t, self.nk, self.dk).contiguous(),
            v.reshape(t, self.nv, self.dv).contiguous(),
            g.contiguous(),
            beta.contiguous(),
            self.cache("delta_state"),
            self.state_spec,
        )
        o = self.norm(o.reshape(t, self.nv, self.dv), z.reshape(t, self.nv, self.dv))
        return self.out_proj(o.reshape(t, self.value_dim).to(x.dtype))
