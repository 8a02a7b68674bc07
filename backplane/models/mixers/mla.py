""":class:`MLAMixer`: DeepSeek multi-head latent attention over the ``mla`` op family."""

from __future__ import annotations

from typing import Any

import torch

from backplane.core.families import MLALayerSpec
from backplane.core.parallel import tensor_parallel
from backplane.models.linear import Linear
from backplane.models.mixers.base import PagedMixer
from backplane.models.norm import RMSNorm
from backplane.models.parallel import (
    PartShard,
    column_parallel_linear,
    head_shard,
    merged_column_parallel_linear,
    row_parallel_linear,
)
from backplane.models.rotary import RopeCosSin, RotaryEmbedding


class MLAMixer(PagedMixer):
    """DeepSeek multi-head latent attention.

    The query comes from ``q_proj`` or the low-rank ``q_a_proj -> q_a_layernorm
    -> q_b_proj``; ``kv_a_proj_with_mqa`` produces the latent and the shared
    rotary key; ``kv_b_proj`` holds the per-head up-projections the backend
    applies (``w_uk``, ``w_uv``), prepared once after loading by
    :meth:`finalize_weights`.

    ``q_a_proj`` (or ``q_proj``) and ``kv_a_proj_with_mqa`` read the same
    hidden state: they are one
    :class:`~backplane.models.linear.MergedLinear`, ``fused_qkv_a_proj``
    (unless a plain ``q_proj`` without bias meets biased ``kv_a_proj_with_mqa``).

    On a tensor-parallel rank the heads are split: ``q_b_proj`` (or the plain
    ``q_proj``) and ``kv_b_proj`` are column-parallel by head, the latent
    projections (``q_a_proj``, ``kv_a_proj_with_mqa``) are replicated, and so
    is the latent cache; ``o_proj`` is row-parallel. ``num_heads`` and the
    backend's layer spec are the rank's.
    """

    families = ("mla",)

    def __init__(
        self,
        layer_id: int,
        backend: Any,
        hidden_size: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        rotary: RotaryEmbedding,
        bias: bool = False,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        tp = tensor_parallel()
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        q_shard = head_shard(tp, num_heads, qk_head_dim, "attention heads")
        # From here on the head count is this rank's.
        num_heads = q_shard.size // qk_head_dim
        self.backend = backend
        self.num_heads = num_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        kv_a_out = kv_lora_rank + qk_rope_head_dim
        # HF's plain q_proj never has a bias; merging needs the same bias setting.
        self.merged = q_lora_rank is not None or not bias
        q_part: tuple[str, PartShard]
        if q_lora_rank is None:
            q_part = ("q_proj", q_shard)
        else:
            q_part = ("q_a_proj", PartShard.whole(q_lora_rank))
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps)
            self.q_b_proj = column_parallel_linear(
                q_lora_rank, q_shard.total, head_size=qk_head_dim, what="attention heads", tp=tp
            )
        if self.merged:
            self.fused_qkv_a_proj = merged_column_parallel_linear(
                hidden_size,
                [q_part, ("kv_a_proj_with_mqa", PartShard.whole(kv_a_out))],
                bias=bias,
                tp=tp,
            )
        else:
            self.q_proj = column_parallel_linear(
                hidden_size, q_shard.total, head_size=qk_head_dim, what="attention heads", tp=tp
            )
            self.kv_a_proj_with_mqa = Linear(hidden_size, kv_a_out, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps)
        kv_b_head = qk_nope_head_dim + v_head_dim
        self.kv_b_proj = column_parallel_linear(
            kv_lora_rank,
            num_heads * tp.size * kv_b_head,
            head_size=kv_b_head,
            what="attention heads",
            tp=tp,
        )
        self.o_proj = row_parallel_linear(
            num_heads * tp.size * v_head_dim,
            hidden_size,
            bias=bias,
            head_size=v_head_dim,
            what="attention heads",
            tp=tp,
        )
        self.spec = MLALayerSpec(
            layer_id=layer_id,
            num_heads=num_heads,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            scale=scale,
        )
        self.register_buffer(
            "w_uk", torch.empty(num_heads, qk_nope_head_dim, kv_lora_rank), persistent=False
        )
        self.register_buffer(
            "w_uv", torch.empty(num_heads, v_head_dim, kv_lora_rank), persistent=False
        )
        self.__dict__["rotary"] = rotary

    def finalize_weights(self) -> None:
        """Split ``kv_b_proj`` into the contiguous per-head ``w_uk`` / ``w_uv`` the backend takes."""
        w = self.kv_b_proj.weight.detach().view(
            self.num_heads, self.nope + self.v_dim, self.kv_lora_rank
        )
        with torch.no_grad():
            self.w_uk.copy_(w[:, : self.nope])
            self.w_uv.copy_(w[:, self.nope :])

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        rope: RopeCosSin | None = None,
    ) -> torch.Tensor:
        """Latent attention over ``x`` ``[T, hidden]`` at ``positions`` ``[T]``.

        Only the rotary part of queries and keys is rotated; the backend
        applies ``w_uk`` / ``w_uv`` to the cached latent.

        :param rope: the forward's ``cos``/``sin`` (gathered from ``positions``
            when not given).
        """
        t = x.shape[0]
        if self.merged:
            q, kv = self.fused_qkv_a_proj.split(self.fused_qkv_a_proj(x))
        else:
            q, kv = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(t, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        kv_c, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        cos, sin = rope if rope is not None else self.rotary.cos_sin(positions, q.dtype)
        q_pe = self.rotary.rotate(q_pe, cos, sin)
        k_pe = self.rotary.rotate(k_pe.view(t, 1, self.rope_dim), cos, sin)
        o = self.backend.forward(
            q_nope.contiguous(),
            q_pe.contiguous(),
            kv_c.contiguous(),
            k_pe.reshape(t, self.rope_dim).contiguous(),
            self.cache("latent_cache"),
            self.w_uk,
            self.w_uv,
            self.spec,
        )
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))
