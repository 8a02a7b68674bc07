"""Cache layouts shared by all backends of a family.

A backend may ask for another layout by overriding its ``cache_spec``; these
are the defaults every in-tree backend uses, so caches can be moved between
backends and inspected by tests.

==========  ==============================================================  =========
cache       shape                                                           dtype
==========  ==============================================================  =========
paged KV    ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (0=K,1=V)  model
MLA latent  ``[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]``      model
SSM state   ``[num_slots, nheads, head_dim, d_state]``                       float32
conv state  ``[num_slots, conv_dim, kernel_size - 1]``                       model
delta state ``[num_slots, num_v_heads, k_head_dim, v_head_dim]``             float32
==========  ==============================================================  =========

``num_pages`` and ``num_slots`` include the reserved scratch page 0 / slot 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one cache tensor of one layer."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def allocate(self, device: torch.device | str) -> torch.Tensor:
        """Allocate the tensor zero-filled on ``device``."""
        return torch.zeros(self.shape, dtype=self.dtype, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes the tensor occupies."""
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def paged_kv(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> TensorSpec:
    """Paged KV: ``[num_pages, 2, page_size, num_kv_heads, head_dim]``."""
    return TensorSpec((num_pages, 2, page_size, num_kv_heads, head_dim), dtype)


def mla_latent(
    num_pages: int, page_size: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype
) -> TensorSpec:
    """MLA latent cache: ``[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]``."""
    return TensorSpec((num_pages, page_size, kv_lora_rank + qk_rope_head_dim), dtype)


def ssm_state(num_slots: int, nheads: int, head_dim: int, d_state: int) -> TensorSpec:
    """Mamba2 SSM state: ``[num_slots, nheads, head_dim, d_state]`` float32."""
    return TensorSpec((num_slots, nheads, head_dim, d_state), torch.float32)


def conv_state(num_slots: int, conv_dim: int, kernel_size: int, dtype: torch.dtype) -> TensorSpec:
    """Causal-conv state: ``[num_slots, conv_dim, kernel_size - 1]``."""
    return TensorSpec((num_slots, conv_dim, kernel_size - 1), dtype)


def delta_state(num_slots: int, num_v_heads: int, k_head_dim: int, v_head_dim: int) -> TensorSpec:
    """Gated delta rule state: ``[num_slots, num_v_heads, k_head_dim, v_head_dim]`` float32."""
    return TensorSpec((num_slots, num_v_heads, k_head_dim, v_head_dim), torch.float32)
