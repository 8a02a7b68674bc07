""":class:`AttentionMixer`: multi-head attention over the ``attention`` op family."""

from __future__ import annotations

from typing import Any

import torch

from backplane.core.families import AttentionLayerSpec
from backplane.core.parallel import tensor_parallel
from backplane.models.fused import head_norm_rotary_, norm_keeps_dtype
from backplane.models.linear import InputProjection, RotaryEpilogue
from backplane.models.mixers.base import PagedMixer
from backplane.models.norm import RMSNorm
from backplane.models.parallel import (
    head_shard,
    kv_head_shard,
    merged_column_parallel_linear,
    row_parallel_linear,
)
from backplane.models.rotary import RopeCosSin, RotaryEmbedding


class AttentionMixer(PagedMixer):
    """Multi-head attention with GQA, optional q/k norm, RoPE and output gate.

    ``q_proj``, ``k_proj`` and ``v_proj`` are one
    :class:`~backplane.models.linear.MergedLinear`, ``qkv_proj``; its output
    is split into views, and without q/k norms the queries and keys are
    rotated together, in place, in that output.

    On a tensor-parallel rank (:func:`~backplane.core.parallel.tensor_parallel`)
    the layer holds its share of the query heads and the key/value heads they
    read (split, or one replicated head when there are fewer than ranks);
    ``num_heads`` / ``num_kv_heads`` and the backend's layer spec are the
    rank's, and ``o_proj`` is row-parallel (one all-reduce).

    :param layer_id: index of the layer (passed to the backend).
    :param backend: the ``attention`` backend.
    :param bias: q/k/v (and, unless ``o_bias`` says otherwise, o) have biases.
    :param o_bias: ``o_proj`` has a bias (default: ``bias``).
    :param qk_norm: ``None``, ``"rms"`` (Qwen3) or ``"rms_zero_centered"`` (Qwen3-Next).
    :param rotary: the rotary embedding, or ``None`` (Nemotron-H has none).
    :param output_gate: ``q_proj`` also produces a per-channel gate and the
        output is multiplied by ``sigmoid(gate)`` (Qwen3-Next, Qwen3.5).
    """

    families = ("attention",)

    def __init__(
        self,
        layer_id: int,
        backend: Any,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool = False,
        o_bias: bool | None = None,
        qk_norm: str | None = None,
        norm_eps: float = 1e-6,
        rotary: RotaryEmbedding | None = None,
        output_gate: bool = False,
        sliding_window: int = 0,
    ) -> None:
        super().__init__()
        tp = tensor_parallel()
        q_rows = head_dim * (2 if output_gate else 1)
        q_shard = head_shard(tp, num_heads, q_rows, "attention heads")
        kv_shard = kv_head_shard(tp, num_kv_heads, head_dim)
        # From here on the counts are this rank's.
        num_heads, num_kv_heads = q_shard.size // q_rows, kv_shard.size // head_dim
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate = output_gate
        self.spec = AttentionLayerSpec(
            layer_id=layer_id,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            sliding_window=sliding_window or 0,
        )
        self.qkv_proj = merged_column_parallel_linear(
            hidden_size,
            [("q_proj", q_shard), ("k_proj", kv_shard), ("v_proj", kv_shard)],
            bias=bias,
            tp=tp,
        )
        self.o_proj = row_parallel_linear(
            num_heads * head_dim * tp.size,
            hidden_size,
            bias=bias if o_bias is None else o_bias,
            head_size=head_dim,
            what="attention heads",
            tp=tp,
        )
        self.qk_norm = qk_norm
        if qk_norm:
            zc = qk_norm == "rms_zero_centered"
            self.q_norm = RMSNorm(head_dim, norm_eps, zero_centered=zc)
            self.k_norm = RMSNorm(head_dim, norm_eps, zero_centered=zc)
        # Not a registered submodule: several layers share one rotary embedding.
        self.__dict__["rotary"] = rotary
        # The queries and keys lie rotated as qkv_proj stores them when the
        # rotation is over whole heads in rotate-half pairs, before anything
        # else touches them (no q/k norm, no output gate inside the heads).
        self._rotary_rows = (
            (num_heads + num_kv_heads) * head_dim
            if rotary is not None
            and not qk_norm
            and not output_gate
            and not rotary.interleaved
            and rotary.rotary_dim == head_dim
            else 0
        )
        # Per-head norms then rotary over whole rotate-half heads: one call does both,
        # in place on the fused projection's rows (see :func:`head_norm_rotary_`).
        self._norm_rotary = bool(
            qk_norm
            and rotary is not None
            and not output_gate
            and not rotary.interleaved
            and rotary.rotary_dim == head_dim
        )

    def input_projection(self, rope: RopeCosSin | None = None) -> InputProjection:
        """The first projection of the input (``qkv_proj``), with no activation.

        A pre-norm layer may run its norm and this projection in one kernel and
        pass the result to :meth:`forward` as ``projected``. With ``rope``,
        the projection also rotates the queries and keys where the layout
        allows (see :attr:`~backplane.models.linear.InputProjection.rotary`);
        :meth:`forward` then leaves them as they are.

        :param rope: the forward's ``cos``/``sin``, or ``None``.
        """
        if rope is None or not self._rotary_rows:
            return InputProjection(self.qkv_proj)
        return InputProjection(
            self.qkv_proj, rotary=RotaryEpilogue(rope[0], rope[1], self._rotary_rows)
        )

    def _norms_keep_dtype(self, dtype: torch.dtype) -> bool:
        """Whether the q/k norms return ``dtype`` (so their results fit back in the rows)."""
        return all(
            norm_keeps_dtype(dtype, n.weight, n.zero_centered) for n in (self.q_norm, self.k_norm)
        )

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor | None,
        rope: RopeCosSin | None = None,
        *,
        projected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend over ``x`` ``[T, hidden]`` at ``positions`` ``[T]``.

        :param x: the normalised input (``None`` when ``projected`` is given).
        :param rope: the forward's ``cos``/``sin`` (gathered from ``positions``
            when not given).
        :param projected: ``qkv_proj(x)``, already computed as
            :meth:`input_projection` given ``rope`` describes it (rotated
            when it says so).
        """
        qkv = self.qkv_proj(x) if projected is None else projected
        t = qkv.shape[0]
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        gate = None
        if self.output_gate:
            q, k, v = self.qkv_proj.split(qkv)
            # Per head: [query (d) | gate (d)].
            q, gate = q.view(t, h, 2 * d).chunk(2, dim=-1)
            k = k.view(t, hk, d)
            v = v.view(t, hk, d)
        else:
            # One call for the three head views (they run every layer and step).
            q, k, v = qkv.view(t, h + 2 * hk, d).split((h, hk, hk), dim=1)
        rotated = projected is not None and rope is not None and bool(self._rotary_rows)
        if self._norm_rotary and self._norms_keep_dtype(qkv.dtype):
            cos, sin = rope if rope is not None else self.rotary.cos_sin(positions, qkv.dtype)
            head_norm_rotary_(
                qkv[:, : (h + hk) * d].view(t, h + hk, d),
                h,
                self.q_norm.weight,
                self.k_norm.weight,
                self.q_norm.eps,
                self.q_norm.zero_centered,
                cos,
                sin,
                fused_ops=self.q_norm.fused_ops,
            )
            rotated = True
        elif self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None and not rotated:
            cos, sin = rope if rope is not None else self.rotary.cos_sin(positions, q.dtype)
            if self.qk_norm or self.output_gate:
                self.rotary.rotate_(q, cos, sin)
                self.rotary.rotate_(k, cos, sin)
            else:
                # Queries and keys are adjacent in every row of qkv: one call rotates both.
                self.rotary.rotate_(qkv[:, : (h + hk) * d].view(t, h + hk, d), cos, sin)
        # Views of the fused projection's rows: backends read them as they lie
        # (the kit's fused-projection test holds every backend to it).
        o = self.backend.forward(q, k, v, self.cache("kv_cache"), self.spec)
        if gate is not None:
            o = o.reshape(t, h, d) * torch.sigmoid(gate)
        return self.o_proj(o.reshape(t, h * d))
