"""The base of the cached mixers: :class:`CachedMixer` owns a layer's cache tensors.

Mixers work on the flat, ragged token layout of a backplane step:
activations are ``[T, ...]`` with ``T`` the padded token count, and the batch
(sequence boundaries, page tables, state slots) reaches the cached ops through
:mod:`backplane.core.forward_context`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from backplane.core.errors import ConfigError
from backplane.core.families import ConvLayerSpec
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

    def keep_verified_states(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy recurrent states from slots ``src_slots`` into ``dst_slots`` after a verification.

        Only mixers with per-slot recurrent state hold anything to copy; the
        default does nothing (paged KV of rejected tokens is simply overwritten
        by later steps).

        :param src_slots: ``[V]`` slots holding the kept states
            (:meth:`~backplane.core.metadata.VerifyStates.keep_slots`).
        :param dst_slots: ``[V]`` the verifying sequences' own slots.
        """
        return None

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


class PagedMixer(CachedMixer):
    """A mixer whose one cache is its backend's paged cache for ``self.spec``.

    Subclasses set ``backend`` and ``spec`` (the layer spec the backend takes).
    """

    backend: Any
    spec: Any
    #: the dtype of this layer's cache when it differs from the model's (an FP8
    #: KV cache, see :func:`backplane.models.quant.kv_cache.use_fp8_kv_cache`)
    kv_cache_dtype: torch.dtype | None = None

    def cache_specs(
        self, *, num_pages: int, page_size: int, num_slots: int, dtype: torch.dtype
    ) -> dict[str, TensorSpec]:
        """The backend's paged cache for this layer (in :attr:`kv_cache_dtype` when set)."""
        return self.backend.cache_spec(
            self.spec,
            num_pages=num_pages,
            page_size=page_size,
            dtype=self.kv_cache_dtype or dtype,
        )


class ConvStateMixer(CachedMixer):
    """A mixer that runs a causal depthwise conv, then a per-head recurrence with a state.

    The conv (``ssm`` family ``conv``) keeps a per-slot conv state; the
    recurrence (``state_backend`` with ``state_spec``) keeps its own per-slot
    state. Subclasses set ``conv_backend``, ``state_backend`` and ``state_spec``
    and call :meth:`init_conv`.
    """

    conv_backend: Any
    state_backend: Any
    state_spec: Any
    #: the names of the caches the conv backend describes (the rest are the recurrence's)
    conv_cache_names: frozenset[str] = frozenset({"conv_state"})

    def init_conv(
        self, layer_id: int, conv_kernel: int, num_heads: int, *, act: str, name: str, bias: bool
    ) -> None:
        """Create the conv weights, the per-head ``dt_bias`` and ``A_log``, and ``conv_spec``.

        The conv has ``self.conv_dim`` channels (set by the subclass).

        :param layer_id: index of the layer (passed to the backend).
        :param conv_kernel: the conv's kernel size.
        :param num_heads: heads of the recurrence (length of ``dt_bias`` and ``A_log``).
        :param act: the conv activation of the config.
        :param name: the mixer's name in the error message.
        :param bias: the conv has a bias.
        :raises ConfigError: ``act`` is not SiLU, the only activation the conv ops apply.
        """
        if act not in ("silu", "swish"):
            raise ConfigError(f"{name} conv activation {act!r} is not supported (only silu)")
        conv_dim = self.conv_dim
        # Checkpoints name the weights conv1d.weight / conv1d.bias.
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(conv_dim, 1, conv_kernel))
        self.conv1d.bias = nn.Parameter(torch.empty(conv_dim)) if bias else None
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.A_log = nn.Parameter(torch.empty(num_heads))
        # -exp(A_log) in float32, derived once the weights are final (NaN until then,
        # so a forward before finalize_weights cannot pass for a correct one)
        self.register_buffer(
            "neg_exp_a", torch.full((num_heads,), math.nan, dtype=torch.float32), persistent=False
        )
        self.conv_spec = ConvLayerSpec(
            layer_id=layer_id, conv_dim=conv_dim, kernel_size=conv_kernel, activation="silu"
        )

    def finalize_weights(self) -> None:
        """Derive ``neg_exp_a`` = ``-exp(A_log)`` (float32) from the loaded ``A_log``.

        Every step reads the per-head decay rate; computing it here saves two
        kernels per layer and step.
        """
        with torch.no_grad():
            self.neg_exp_a.copy_(-torch.exp(self.A_log.detach().float()))

    def cache_specs(
        self, *, num_pages: int, page_size: int, num_slots: int, dtype: torch.dtype
    ) -> dict[str, TensorSpec]:
        """Conv state from ``conv_backend`` and recurrent state from ``state_backend``."""
        specs = dict(
            self.conv_backend.conv_cache_spec(self.conv_spec, num_slots=num_slots, dtype=dtype)
        )
        self.conv_cache_names = frozenset(specs)
        specs.update(
            self.state_backend.cache_spec(self.state_spec, num_slots=num_slots, dtype=dtype)
        )
        return specs

    def conv(self, x: torch.Tensor) -> torch.Tensor:
        """Run the causal conv over ``x`` ``[T, conv_dim]``, updating the conv state.

        :return: the activated conv output ``[T, conv_dim]``.
        """
        return self.conv_backend.conv(
            x.contiguous(),
            self.conv1d.weight.view(self.conv_dim, -1),
            self.conv1d.bias,
            self.cache("conv_state"),
            self.conv_spec,
        )

    def keep_verified_states(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy the conv and recurrent states of ``src_slots`` into ``dst_slots``.

        Each cache goes through the backend that describes it
        (:meth:`~backplane.core.families.RecurrentBackend.copy_state_slots`).

        :param src_slots: ``[V]`` slots holding the kept states.
        :param dst_slots: ``[V]`` the verifying sequences' own slots.
        """
        for name, state in self.caches.items():
            backend = self.conv_backend if name in self.conv_cache_names else self.state_backend
            backend.copy_state_slots(state, src_slots, dst_slots)
