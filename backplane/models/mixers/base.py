"""The base of the cached mixers: :class:`CachedMixer` owns a layer's cache tensors.

Mixers work on the flat, ragged token layout of a backplane step:
activations are ``[T, ...]`` with ``T`` the padded token count, and the batch
(sequence boundaries, page tables, state slots) reaches the cached ops through
:mod:`backplane.core.forward_context`.
"""

from __future__ import annotations

import torch
from torch import nn

from backplane.core.layouts import TensorSpec


class CachedMixer(nn.Module):
    """A mixer that owns per-layer cache tensors handed to an op family.

    Subclasses set ``families`` and implement :meth:`cache_specs`; the model
    binds the allocated tensors with :meth:`bind_caches`.
    """

    families: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.caches: dict[str, torch.Tensor] = {}

    def cache_specs(
        self, *, num_pages: int, page_size: int, num_slots: int, dtype: torch.dtype
    ) -> dict[str, TensorSpec]:
        """Return this layer's cache tensors ``{name: spec}``."""
        raise NotImplementedError

    def bind_caches(self, caches: dict[str, torch.Tensor]) -> None:
        """Use ``caches`` (allocated from :meth:`cache_specs`) from now on."""
        self.caches = dict(caches)

    def cache(self, name: str) -> torch.Tensor:
        """Return the bound cache ``name``.

        :raises RuntimeError: when caches were never bound.
        """
        try:
            return self.caches[name]
        except KeyError:
            raise RuntimeError(
                f"cache {name!r} of {type(self).__name__} is not bound; call "
                "model.bind_caches(...) with tensors allocated from model.cache_specs(...)"
            ) from None
