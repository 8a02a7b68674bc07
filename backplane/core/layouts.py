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

Specs say which tensors are paged (:attr:`TensorSpec.paged`: their first
dimension counts KV pages), so the engine sizes the KV pool from per-page bytes
read off one set of specs (:func:`cache_footprint`); everything else (the
recurrent state) has a size fixed by the slot count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

# CPU tensors from this size up are allocated as on-demand zero pages (smaller
# ones come from the allocator's pool, where calloc would gain nothing); the
# start is aligned for vector loads.
_LAZY_ZERO_BYTES = 1 << 20
_ALIGN = 64


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one cache tensor of one layer.

    :param shape: the tensor's shape.
    :param dtype: its dtype.
    :param paged: the first dimension counts KV pages (``num_pages``), so the
        tensor grows by :attr:`page_bytes` per page; otherwise its size does not
        depend on the page count (recurrent state per slot).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    paged: bool = False

    def allocate(self, device: torch.device | str) -> torch.Tensor:
        """Allocate the tensor zero-filled on ``device``.

        On the CPU a large tensor takes its memory as zero pages from the OS
        (``calloc`` through numpy) rather than writing zeros into it: memory is
        committed only as pages are written, so a KV pool sized for every
        sequence at full length costs the process only the pages in use.

        :param device: where it goes.
        :return: the tensor.
        """
        nbytes = self.nbytes
        if torch.device(device).type != "cpu" or nbytes < _LAZY_ZERO_BYTES:
            return torch.zeros(self.shape, dtype=self.dtype, device=device)
        raw = torch.from_numpy(np.zeros(nbytes + _ALIGN, dtype=np.uint8))
        start = -raw.data_ptr() % _ALIGN
        return raw[start : start + nbytes].view(self.dtype).view(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes the tensor occupies."""
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes one KV page takes in this tensor (0 when it is not paged)."""
        if not self.paged:
            return 0
        n = 1
        for s in self.shape[1:]:
            n *= s
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class CacheFootprint:
    """What a model's caches take, from one set of specs.

    :param page_bytes: bytes one KV page takes across every paged tensor.
    :param state_bytes: bytes of every tensor that is not paged.
    :param paged: ``(layer, cache name)`` of every paged tensor.
    """

    page_bytes: int
    state_bytes: int
    paged: tuple[tuple[str, str], ...]

    def total_bytes(self, num_pages: int) -> int:
        """Bytes of every cache with ``num_pages`` pages.

        :param num_pages: pages in the pool, scratch page 0 included.
        """
        return self.state_bytes + num_pages * self.page_bytes


def cache_footprint(specs: Mapping[str, Mapping[str, TensorSpec]]) -> CacheFootprint:
    """Read per-page and fixed bytes off a model's cache specs.

    :param specs: ``{layer: {cache name: spec}}``, as ``model.cache_specs`` returns
        them (for any page count).
    :return: the :class:`CacheFootprint`.
    """
    page_bytes = state_bytes = 0
    paged: list[tuple[str, str]] = []
    for layer, layer_specs in specs.items():
        for name, spec in layer_specs.items():
            if spec.paged:
                page_bytes += spec.page_bytes
                paged.append((layer, name))
            else:
                state_bytes += spec.nbytes
    return CacheFootprint(page_bytes, state_bytes, tuple(paged))


def paged_kv(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> TensorSpec:
    """Paged KV: ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (paged)."""
    return TensorSpec((num_pages, 2, page_size, num_kv_heads, head_dim), dtype, paged=True)


def mla_latent(
    num_pages: int, page_size: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype
) -> TensorSpec:
    """MLA latent cache: ``[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`` (paged)."""
    return TensorSpec((num_pages, page_size, kv_lora_rank + qk_rope_head_dim), dtype, paged=True)


def ssm_state(num_slots: int, nheads: int, head_dim: int, d_state: int) -> TensorSpec:
    """Mamba2 SSM state: ``[num_slots, nheads, head_dim, d_state]`` float32."""
    return TensorSpec((num_slots, nheads, head_dim, d_state), torch.float32)


def conv_state(num_slots: int, conv_dim: int, kernel_size: int, dtype: torch.dtype) -> TensorSpec:
    """Causal-conv state: ``[num_slots, conv_dim, kernel_size - 1]``."""
    return TensorSpec((num_slots, conv_dim, kernel_size - 1), dtype)


def delta_state(num_slots: int, num_v_heads: int, k_head_dim: int, v_head_dim: int) -> TensorSpec:
    """Gated delta rule state: ``[num_slots, num_v_heads, k_head_dim, v_head_dim]`` float32."""
    return TensorSpec((num_slots, num_v_heads, k_head_dim, v_head_dim), torch.float32)
