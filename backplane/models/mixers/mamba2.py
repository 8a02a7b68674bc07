""":class:`Mamba2Mixer`: the Mamba2 mixer over the ``ssm`` op family (``conv`` and ``scan``).

Split over a tensor-parallel group (:func:`~backplane.core.parallel.tensor_parallel`),
each rank holds a slice of the heads: its rows of ``z``, ``x`` and ``dt`` in
``in_proj``, its channels of the conv, its ``A_log``, ``D`` and ``dt_bias``, and
its columns of ``out_proj`` (row-parallel, one all-reduce). ``B`` and ``C`` are
split by groups; with fewer groups than ranks each rank keeps a copy of the
group its heads read. So the conv and SSM states of a rank hold its own heads
only, and the scan needs no communication.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backplane.core.families import SSMLayerSpec
from backplane.core.parallel import tensor_parallel
from backplane.models.linear import InputProjection, Linear
from backplane.models.mixers.base import ConvStateMixer
from backplane.models.mixers.shards import group_shard
from backplane.models.norm import GatedRMSNorm
from backplane.models.parallel import ParamShard, head_shard, row_parallel_linear
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
        tp = self.tp = tensor_parallel()
        # This rank's slices of the full layer's z/x rows, B/C rows and heads.
        channels = head_shard(tp, num_heads, head_dim, "Mamba2 heads (mamba_num_heads)")
        groups = group_shard(tp, n_groups, d_state, "Mamba2 groups (n_groups)")
        heads = head_shard(tp, num_heads, 1, "Mamba2 heads (mamba_num_heads)")
        self.num_heads, self.head_dim, self.d_state, self.n_groups = (
            heads.size,
            head_dim,
            d_state,
            groups.size // d_state,
        )
        self.inner = channels.size
        self.conv_dim = self.inner + 2 * groups.size
        self.in_proj = Linear(
            hidden_size, self.inner + self.conv_dim + self.num_heads, bias=proj_bias
        )
        self.init_conv(
            layer_id, conv_kernel, self.num_heads, act=act, name="Mamba2", bias=conv_bias
        )
        self.D = nn.Parameter(torch.empty(self.num_heads))
        # The norm's groups are the full layer's: with fewer groups than ranks
        # one group spans several ranks (see _spanning_norm).
        group_size = num_heads * head_dim // n_groups
        self.norm_ranks = max(tp.size // n_groups, 1)
        self.norm = GatedRMSNorm(
            self.inner, norm_eps, group_size=min(group_size, self.inner), norm_before_gate=False
        )
        self.out_proj = row_parallel_linear(
            num_heads * head_dim, hidden_size, bias=proj_bias, head_size=head_dim, tp=tp
        )
        if tp.enabled:
            proj = ParamShard(0, (channels, channels, groups, groups, heads))
            conv = ParamShard(0, (channels, groups, groups))
            per_head = ParamShard(0, (heads,))
            self.in_proj.tp_shards = {"weight": proj, **({"bias": proj} if proj_bias else {})}
            self.conv1d.tp_shards = {"weight": conv, **({"bias": conv} if conv_bias else {})}
            self.tp_shards = {"A_log": per_head, "D": per_head, "dt_bias": per_head}
            self.norm.tp_shards = {"weight": ParamShard(0, (channels,))}
        self.state_spec = SSMLayerSpec(
            layer_id=layer_id,
            nheads=self.num_heads,
            head_dim=head_dim,
            d_state=d_state,
            n_groups=self.n_groups,
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
        if self.norm_ranks > 1:
            y = self._spanning_norm(y.reshape(t, self.inner), gate)
        else:
            y = self.norm(y.reshape(t, self.inner), gate)
        return self.out_proj(y.to(proj.dtype))

    def _spanning_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The gated group norm where one group spans ``norm_ranks`` ranks (fewer groups than ranks).

        Each rank sums the squares of its channels of the group; one all-reduce
        of a ``[T, ranks]`` tensor (each rank writing its own column) gives
        every rank the sums of all ranks, of which it adds those of its group.
        The arithmetic is :func:`~backplane.models.fused.gated_rms_norm`'s
        (``norm(y * silu(gate))``, statistics in float32).

        :param y: the scan's output ``[T, inner]`` (this rank's channels).
        :param gate: ``z``, the same shape.
        :return: the normalised, scaled ``[T, inner]``.
        """
        tp = self.tp
        yf = y.float() * F.silu(gate.float())
        sums = yf.new_zeros(y.shape[0], tp.size)
        sums[:, tp.rank] = yf.pow(2).sum(-1)
        tp.all_reduce(sums)
        first = tp.rank - tp.rank % self.norm_ranks
        group = sums[:, first : first + self.norm_ranks].sum(-1, keepdim=True)
        mean = group / (self.inner * self.norm_ranks)
        yf = yf * torch.rsqrt(mean + self.norm.eps)
        return self.norm.weight * yf.to(y.dtype)
