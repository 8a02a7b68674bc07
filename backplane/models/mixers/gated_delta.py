""":class:`GatedDeltaNetMixer`: Gated DeltaNet over the ``ssm`` (conv) and ``delta`` families.

Split over a tensor-parallel group (:func:`~backplane.core.parallel.tensor_parallel`),
each rank holds a slice of the value heads (their ``v``, ``z``, ``b`` and ``a``
rows, conv channels, ``A_log`` and ``dt_bias``, and their columns of the
row-parallel ``out_proj``) and the key heads those value heads read (their
``q`` and ``k`` rows and channels): a share of the key heads, or with fewer
key heads than ranks a copy of one. The delta-rule and conv states of a rank
hold its heads only; the one all-reduce is ``out_proj``'s.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from backplane.core.families import DeltaLayerSpec
from backplane.core.parallel import TensorParallel, divide, tensor_parallel
from backplane.models.linear import Linear, MergedLinear
from backplane.models.mixers.base import ConvStateMixer
from backplane.models.mixers.shards import group_shard
from backplane.models.norm import GatedRMSNorm
from backplane.models.parallel import (
    ParamShard,
    PartShard,
    head_shard,
    merged_column_parallel_linear,
    row_parallel_linear,
)
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
        tp = tensor_parallel()
        divide(num_v_heads, num_k_heads, "value heads (linear_num_value_heads) per key head")
        # This rank's slices of the full layer's key heads (q, k), value heads
        # (v, z) and per-value-head scalars (b, a, A_log, dt_bias).
        keys = group_shard(tp, num_k_heads, k_head_dim, "key heads (linear_num_key_heads)")
        values = head_shard(tp, num_v_heads, v_head_dim, "value heads (linear_num_value_heads)")
        v_heads = head_shard(tp, num_v_heads, 1, "value heads (linear_num_value_heads)")
        self.nk, self.nv = keys.size // k_head_dim, v_heads.size
        self.dk, self.dv = k_head_dim, v_head_dim
        self.key_dim, self.value_dim = keys.size, values.size
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.fused_qkvz = fused_qkvz
        if fused_qkvz:
            tensors = _grouped_shards(tp, num_k_heads, num_v_heads, k_head_dim, v_head_dim)
        else:
            tensors = [
                ("in_proj_qkv", ParamShard(0, (keys, keys, values))),
                ("in_proj_z", ParamShard(0, (values,))),
                ("in_proj_b", ParamShard(0, (v_heads,))),
                ("in_proj_a", ParamShard(0, (v_heads,))),
            ]
        self._build_input_projections(hidden_size, tensors, tp)
        self.init_conv(layer_id, conv_kernel, self.nv, act=act, name="gated delta net", bias=False)
        self.norm = GatedRMSNorm(v_head_dim, norm_eps, norm_before_gate=True)
        self.out_proj = row_parallel_linear(
            num_v_heads * v_head_dim, hidden_size, bias=False, head_size=v_head_dim, tp=tp
        )
        if tp.enabled:
            per_head = ParamShard(0, (v_heads,))
            self.conv1d.tp_shards = {"weight": ParamShard(0, (keys, keys, values))}
            self.tp_shards = {"A_log": per_head, "dt_bias": per_head}
        self.state_spec = DeltaLayerSpec(
            layer_id=layer_id,
            num_k_heads=self.nk,
            num_v_heads=self.nv,
            k_head_dim=k_head_dim,
            v_head_dim=v_head_dim,
            use_qk_l2norm=True,
        )

    def _build_input_projections(
        self, hidden_size: int, tensors: list[tuple[str, ParamShard]], tp: TensorParallel
    ) -> None:
        """Build the input projections of the checkpoint's ``tensors``, this rank's rows of each.

        As many as possible form one merged projection (``in_proj_qkvzba``):
        all of them on one rank, and every tensor whose rank's rows are one
        contiguous slice on several. A tensor whose rows are several slices
        (Qwen3.5's ``in_proj_qkv`` holds q, k and v heads) is a projection of
        its own, named as in the checkpoint; those come first, in order, and
        :attr:`separate_projections` lists them.

        :param hidden_size: the input width.
        :param tensors: ``(checkpoint name, this rank's rows)`` in output order.
        :param tp: the group of ranks.
        """
        split = 0
        if tp.enabled:
            for i, (_, shard) in enumerate(tensors):
                if len(shard.parts) > 1:
                    split = i + 1
        self.separate_projections = tuple(name for name, _ in tensors[:split])
        for name, shard in tensors[:split]:
            rows = sum(p.size for p in shard.parts)
            proj = Linear(hidden_size, rows, bias=False)
            proj.tp_shards = {"weight": shard}
            setattr(self, name, proj)
        merged = tensors[split:]
        if not merged:
            self.in_proj_qkvzba = None
        elif tp.enabled:
            self.in_proj_qkvzba = merged_column_parallel_linear(
                hidden_size, [(name, shard.parts[0]) for name, shard in merged], tp=tp
            )
        else:
            self.in_proj_qkvzba = MergedLinear(
                hidden_size, [(name, sum(p.total for p in shard.parts)) for name, shard in merged]
            )

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Return ``(mixed [T, conv_dim], z [T, V], b [T, nv], a [T, nv])`` (possibly views)."""
        t = x.shape[0]
        proj = tuple(getattr(self, name)(x) for name in self.separate_projections)
        if self.in_proj_qkvzba is not None:
            proj += self.in_proj_qkvzba.split(self.in_proj_qkvzba(x))
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


def _grouped_shards(
    tp: TensorParallel, num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int
) -> list[tuple[str, ParamShard]]:
    """This rank's rows of Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``.

    Their rows are grouped per key head: ``[q, k, v-group, z-group]`` and
    ``[b-group, a-group]``, a group being the value heads of that key head.
    With at least as many key heads as ranks a rank holds whole key-head
    blocks; with fewer it holds one key head's ``q`` and ``k`` and its slice
    of that head's value group. Either way its rows keep the grouped layout
    (with its own counts), so :meth:`GatedDeltaNetMixer._project` reads them
    as it reads the full layer's.

    :return: ``[("in_proj_qkvz", rows), ("in_proj_ba", rows)]``.
    """
    per_key = num_v_heads // num_k_heads
    qkvz_block = 2 * k_head_dim + 2 * per_key * v_head_dim
    if num_k_heads % tp.size == 0:
        return [
            (
                "in_proj_qkvz",
                ParamShard(0, (head_shard(tp, num_k_heads, qkvz_block, "key heads"),)),
            ),
            ("in_proj_ba", ParamShard(0, (head_shard(tp, num_k_heads, 2 * per_key, "key heads"),))),
        ]
    key = group_shard(tp, num_k_heads, 1, "key heads (linear_num_key_heads)").start
    lo, hi = (
        (v - key * per_key) for v in tp.shard(num_v_heads, "value heads (linear_num_value_heads)")
    )
    before, after = key, num_k_heads - key - 1

    def rows(block: int, *parts: PartShard) -> ParamShard:
        # The key heads before and after this rank's contribute no rows.
        empty_before = PartShard(before * block, 0, 0)
        empty_after = PartShard(after * block, 0, 0)
        return ParamShard(0, (empty_before, *parts, empty_after))

    def group(size: int) -> PartShard:
        return PartShard(per_key * size, lo * size, hi * size)

    return [
        (
            "in_proj_qkvz",
            rows(qkvz_block, PartShard.whole(2 * k_head_dim), group(v_head_dim), group(v_head_dim)),
        ),
        ("in_proj_ba", rows(2 * per_key, group(1), group(1))),
    ]
