"""What a backend object of each op family provides.

A backend's ``BackendSpec.load`` produces an instance of one of the classes
below. Each provides:

* ``cache_spec(layer, ...)``: the cache tensors one layer needs (defaults are
  the shared layouts of :mod:`backplane.core.layouts`); a pure description,
  also used to check that the backend can run the layer;
* ``plan(batch)``: host-side preparation called once per step for all layers,
  outside any CUDA graph; it reads how the step runs from ``batch.mode``; what
  it returns is handed back to the ops through
  :class:`~backplane.core.forward_context.ForwardContext`;
* ``prepare_capture(mode, batch)``: called by the CUDA-graph runner before it
  captures each bucket (default: nothing to do);
* the cached op(s), each ending in ``out=None`` and honouring the out-buffer
  contract of :mod:`backplane.core.contract`;
* ``dynamic_ops()``: the custom-op overloads the piecewise CUDA-graph runner
  must leave out of captured segments (matched by identity);
* the output shape of each cached op (``output_shape`` and, for SSM,
  ``conv_output_shape`` / ``scan_output_shape``): static functions of the op's
  arguments that every backend passes to
  :func:`~backplane.core.contract.cached_op` as its fake implementation.

The recurrent families (``ssm``, ``delta``) derive from :class:`RecurrentBackend`:
their ops also keep the state after every position of a speculative
verification chunk (``batch.verify_states``), and ``copy_state_slots`` copies
the kept one back into each sequence's slot once the engine knows what was
accepted.

A backend that runs part of its work on another backend of its family sets
``needs_fallback`` and receives that backend through ``set_fallback`` when it is
selected.

Tensor shapes below use ``T`` for the padded token count of the batch; the real
token count and everything else per step come from the forward context.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

import torch

from backplane.core import layouts
from backplane.core.hookspecs import FAMILIES
from backplane.core.layouts import TensorSpec
from backplane.core.metadata import BatchMetadata, StepMode

#: What a backend's :meth:`Backend.plan` returns for one step: the backend's own
#: object (a FlashInfer wrapper, index tensors, ``None``), handed back only to the
#: backend that made it, so nothing between the two may assume a type for it.
BackendPlan: TypeAlias = Any

# -- per-layer constants ------------------------------------------------------


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Constants of one attention layer.

    :param sliding_window: attend to at most this many most recent keys
        (including the query's own position); ``0`` means full causal attention.
    :param k_scale: with an FP8 KV cache, the cache holds ``key / k_scale``.
    :param v_scale: with an FP8 KV cache, the cache holds ``value / v_scale``.
    """

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float | None = None
    sliding_window: int = 0
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def softmax_scale(self) -> float:
        """The scale applied to ``q @ k^T`` (default ``head_dim ** -0.5``)."""
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)


@dataclass(frozen=True)
class MLALayerSpec:
    """Constants of one multi-head latent attention layer (DeepSeek).

    :param kv_scale: with an FP8 latent cache, the cache holds ``latent /
        kv_scale`` (the rotary key too).
    """

    layer_id: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float
    kv_scale: float = 1.0


@dataclass(frozen=True)
class ConvLayerSpec:
    """Constants of one causal depthwise convolution (Mamba2 and delta-rule mixers).

    :param activation: ``"silu"`` or ``""`` (none).
    """

    layer_id: int
    conv_dim: int
    kernel_size: int
    activation: str = "silu"


@dataclass(frozen=True)
class SSMLayerSpec:
    """Constants of one Mamba2 selective-scan layer."""

    layer_id: int
    nheads: int
    head_dim: int
    d_state: int
    n_groups: int
    dt_softplus: bool = True
    chunk_size: int = 256


@dataclass(frozen=True)
class DeltaLayerSpec:
    """Constants of one gated delta rule layer.

    :param scale: applied to ``q`` (default ``k_head_dim ** -0.5``).
    :param use_qk_l2norm: L2-normalise ``q`` and ``k`` per head inside the kernel.
    """

    layer_id: int
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    scale: float | None = None
    use_qk_l2norm: bool = True

    @property
    def q_scale(self) -> float:
        """The scale applied to ``q``."""
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.k_head_dim)


# -- backend base classes -----------------------------------------------------


#: ``(shape, dtype)`` of a cached op's full (padded) result.
OutputShape = tuple[tuple[int, ...], torch.dtype]


def _rows_like(t: torch.Tensor) -> OutputShape:
    return tuple(t.shape), t.dtype


class Backend(ABC):
    """Common base of all family backends."""

    family: ClassVar[str]
    #: The backend's name; set by the implementation (matches its BackendSpec).
    name: ClassVar[str] = ""
    #: Whether the backend runs part of its work on another backend of its family;
    #: selection then hands it one through :meth:`set_fallback` when it loads it.
    needs_fallback: ClassVar[bool] = False

    def set_fallback(self, backend: Backend) -> None:
        """Receive the backend that runs what this one does not.

        Called once by selection, right after loading, on a backend whose
        :attr:`needs_fallback` is true. The fallback is chosen like ``auto``
        among the other available backends of the family.

        :param backend: a loaded backend of the same family.
        :raises TypeError: the backend takes no fallback.
        """
        raise TypeError(
            f"{self.family} backend {self.name!r} runs all of its work itself and takes no "
            "fallback backend"
        )

    def plan(self, batch: BatchMetadata) -> BackendPlan:
        """Prepare host-side state for one step, for all layers.

        Called once per step, outside any CUDA graph, before the model runs
        (also before every replay of a captured graph). ``batch.mode`` says how
        the step runs: eagerly, as the decode graph of a bucket (the ops are
        replayed from a capture, so what they read must sit at the addresses
        they were captured with), or piecewise (the ops run eagerly).

        :param batch: the step's metadata.
        :return: the backend's own object (:data:`BackendPlan`); its ops get it back
            from ``get_forward_context().plan(family)``.
        """
        return None

    def prepare_capture(self, mode: StepMode, batch: BatchMetadata) -> None:
        """Get ready for the graph of ``mode`` to be captured.

        Called by the CUDA-graph runner once per bucket, outside any graph,
        before it plans the capture batch and captures it. For a decode graph,
        ``batch`` is the largest batch of its bucket: every step replayed on the
        graph has at most its sequences and block-table width. A backend that
        keeps per-bucket device buffers sets them up here; they must stay where
        they are from then on. The default does nothing.

        :param mode: the decode graph or piecewise bucket about to be captured.
        :param batch: the batch it is captured with (``batch.mode == mode``).
        """
        return None

    def dynamic_ops(self) -> tuple[torch._ops.OpOverload, ...]:
        """Return the custom-op overloads this backend's forward calls.

        The piecewise graph runner splits the model at exactly these ops.
        """
        return ()


class AttentionBackend(Backend):
    """Causal attention over a paged KV cache for a ragged batch."""

    family: ClassVar[str] = "attention"
    #: whether :meth:`forward` reads and writes a float8_e4m3fn KV cache (with
    #: the layer's ``k_scale`` / ``v_scale``)
    supports_fp8_kv_cache: ClassVar[bool] = False

    # Any: the op's remaining arguments, of every type it takes, are ignored
    @staticmethod
    def output_shape(q: torch.Tensor, *args: Any, **kwargs: Any) -> OutputShape:
        """Return the ``(shape, dtype)`` of :meth:`forward`'s op: that of ``q``.

        :param q: ``[T, num_heads, head_dim]``; the op's other arguments are ignored.
        """
        return _rows_like(q)

    def cache_spec(
        self, layer: AttentionLayerSpec, *, num_pages: int, page_size: int, dtype: torch.dtype
    ) -> dict[str, TensorSpec]:
        """Return ``{"kv_cache": spec}`` for one layer (default: shared paged-KV layout)."""
        return {
            "kv_cache": layouts.paged_kv(
                num_pages, page_size, layer.num_kv_heads, layer.head_dim, dtype
            )
        }

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: AttentionLayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append this step's keys/values to the cache and attend.

        :param q: ``[T, num_heads, head_dim]``, RoPE already applied.
        :param k: ``[T, num_kv_heads, head_dim]``, RoPE already applied.
        :param v: ``[T, num_kv_heads, head_dim]``. ``q``, ``k`` and ``v`` may be
            views of one fused projection's rows (any row stride, unit stride in
            ``head_dim``): a backend copies them only where its kernels need it.
        :param kv_cache: the layer's paged KV cache (written at ``slot_mapping``).
        :param layer: the layer's constants.
        :param out: optional ``[T, num_heads, head_dim]`` buffer (out-buffer contract).
        :return: the attention output, or the empty sentinel when ``out`` is given.
        """


class MLABackend(Backend):
    """DeepSeek multi-head latent attention over a paged latent cache."""

    family: ClassVar[str] = "mla"
    #: whether :meth:`forward` reads and writes a float8_e4m3fn latent cache
    #: (with the layer's ``kv_scale``)
    supports_fp8_kv_cache: ClassVar[bool] = False

    # Any: the op's remaining arguments, of every type it takes, are ignored
    @staticmethod
    def output_shape(
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> OutputShape:
        """Return the ``(shape, dtype)`` of :meth:`forward`'s op: ``[T, H, v_head_dim]``.

        :param q_nope: ``[T, H, qk_nope_head_dim]``, whose dtype the result has.
        :param w_uv: ``[H, v_head_dim, kv_lora_rank]``.
        :return: the shape and dtype; the op's other arguments are ignored.
        """
        return (q_nope.shape[0], q_nope.shape[1], w_uv.shape[1]), q_nope.dtype

    def cache_spec(
        self, layer: MLALayerSpec, *, num_pages: int, page_size: int, dtype: torch.dtype
    ) -> dict[str, TensorSpec]:
        """Return ``{"latent_cache": spec}`` for one layer."""
        return {
            "latent_cache": layouts.mla_latent(
                num_pages, page_size, layer.kv_lora_rank, layer.qk_rope_head_dim, dtype
            )
        }

    @abstractmethod
    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        layer: MLALayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append the latent and rotary key to the cache and attend.

        The key of head ``h`` is ``[kv_c @ w_uk[h]^T, k_pe]`` and its value
        ``kv_c @ w_uv[h]^T``; backends may absorb the weights into the query
        (decode) or expand the cache (prefill).

        :param q_nope: ``[T, H, qk_nope_head_dim]``.
        :param q_pe: ``[T, H, qk_rope_head_dim]``, RoPE applied.
        :param kv_c: ``[T, kv_lora_rank]``, the normalised latent.
        :param k_pe: ``[T, qk_rope_head_dim]``, RoPE applied (shared by heads).
        :param latent_cache: the layer's latent cache.
        :param w_uk: ``[H, qk_nope_head_dim, kv_lora_rank]``.
        :param w_uv: ``[H, v_head_dim, kv_lora_rank]``.
        :param out: optional ``[T, H, v_head_dim]`` buffer.
        :return: the output or the empty sentinel.
        """


class RecurrentBackend(Backend):
    """A family whose caches hold one state per sequence slot (``ssm`` and its conv, ``delta``).

    A speculative verification step (``batch.verify_states`` set, see
    :class:`~backplane.core.metadata.VerifyStates`) runs each verifying
    sequence's chunk as an extend sequence; the family's cached ops then also
    write the state after every position of that chunk into the scratch slots
    ``batch.verify_states.slots`` names. Once the engine knows how many
    proposals each sequence accepted, it copies the kept position's state back
    into the sequence's slot with :meth:`copy_state_slots`.

    A backend whose :attr:`chains_rows` is true also runs the chunks of such
    a step as decode rows of a captured verify graph: its ops then read and
    write the slots ``batch.chained_rows`` names
    (:class:`~backplane.core.metadata.ChainedRows`) instead of each row's own.
    """

    #: whether the ops follow ``batch.chained_rows`` in a verify graph; the engine
    #: verifies a recurrent model in verify graphs only when all its recurrent backends do
    chains_rows: ClassVar[bool] = False

    def copy_state_slots(
        self, state: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
    ) -> None:
        """Copy the states of slots ``src_slots`` into slots ``dst_slots`` of one state cache.

        Every source is read before any destination is written, and nothing is
        read on the host, so the copy may follow a step's sampling on the device.

        :param state: one of the family's state caches (``[num_slots, ...]``).
        :param src_slots: ``[V]`` slot indices to read (from
            :meth:`~backplane.core.metadata.VerifyStates.keep_slots`).
        :param dst_slots: ``[V]`` distinct slot indices to write.
        """
        state.index_copy_(0, dst_slots, state.index_select(0, src_slots))


class SSMBackend(RecurrentBackend):
    """Mamba2: causal depthwise convolution with state, and the selective scan."""

    family: ClassVar[str] = "ssm"

    # Any: the op's remaining arguments, of every type it takes, are ignored
    @staticmethod
    def conv_output_shape(x: torch.Tensor, *args: Any, **kwargs: Any) -> OutputShape:
        """Return the ``(shape, dtype)`` of :meth:`conv`'s op: that of ``x``.

        :param x: ``[T, conv_dim]``; the op's other arguments are ignored.
        """
        return _rows_like(x)

    # Any: the op's remaining arguments, of every type it takes, are ignored
    @staticmethod
    def scan_output_shape(x: torch.Tensor, *args: Any, **kwargs: Any) -> OutputShape:
        """Return the ``(shape, dtype)`` of :meth:`scan`'s op: that of ``x``.

        :param x: ``[T, nheads, head_dim]``; the op's other arguments are ignored.
        """
        return _rows_like(x)

    def cache_spec(
        self, layer: SSMLayerSpec, *, num_slots: int, dtype: torch.dtype
    ) -> dict[str, TensorSpec]:
        """Return ``{"ssm_state": spec}`` for one scan layer."""
        return {
            "ssm_state": layouts.ssm_state(num_slots, layer.nheads, layer.head_dim, layer.d_state)
        }

    def conv_cache_spec(
        self, layer: ConvLayerSpec, *, num_slots: int, dtype: torch.dtype
    ) -> dict[str, TensorSpec]:
        """Return ``{"conv_state": spec}`` for one convolution."""
        return {
            "conv_state": layouts.conv_state(num_slots, layer.conv_dim, layer.kernel_size, dtype)
        }

    @abstractmethod
    def conv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        layer: ConvLayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal depthwise conv1d per sequence, continuing from the conv state.

        :param x: ``[T, conv_dim]``.
        :param weight: ``[conv_dim, kernel_size]``.
        :param bias: ``[conv_dim]`` or ``None``.
        :param conv_state: the last ``kernel_size - 1`` inputs per slot; read
            when ``has_initial_state`` and updated for every sequence.
        :param out: optional ``[T, conv_dim]`` buffer.
        :return: activation(conv(x)) or the empty sentinel.
        """

    @abstractmethod
    def scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor,
        dt_bias: torch.Tensor,
        z: torch.Tensor | None,
        ssm_state: torch.Tensor,
        layer: SSMLayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Selective scan: ``h = exp(dt*A) h + dt * B x``; ``y = C h + D x``.

        ``dt`` is ``softplus(dt + dt_bias)`` when ``layer.dt_softplus``; with
        ``z`` the output is gated as ``y * silu(z)``.

        :param x: ``[T, nheads, head_dim]``.
        :param dt: ``[T, nheads]``.
        :param A: ``[nheads]`` (negative).
        :param B: ``[T, n_groups, d_state]``.
        :param C: ``[T, n_groups, d_state]``.
        :param D: ``[nheads]``.
        :param dt_bias: ``[nheads]``.
        :param z: ``[T, nheads, head_dim]`` or ``None``.
        :param ssm_state: the layer's state cache, read when ``has_initial_state``
            and left holding the state after the last token of each sequence.
        :param out: optional ``[T, nheads, head_dim]`` buffer.
        :return: ``y`` or the empty sentinel.
        """


class DeltaBackend(RecurrentBackend):
    """Gated delta rule with one float32 state per sequence slot."""

    family: ClassVar[str] = "delta"

    # Any: the op's remaining arguments, of every type it takes, are ignored
    @staticmethod
    def output_shape(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any
    ) -> OutputShape:
        """Return the ``(shape, dtype)`` of :meth:`forward`'s op: that of ``v``.

        :param v: ``[T, num_v_heads, v_head_dim]``; ``q``, ``k`` and the op's other
            arguments are ignored.
        """
        return _rows_like(v)

    def cache_spec(
        self, layer: DeltaLayerSpec, *, num_slots: int, dtype: torch.dtype
    ) -> dict[str, TensorSpec]:
        """Return ``{"delta_state": spec}`` for one layer."""
        return {
            "delta_state": layouts.delta_state(
                num_slots, layer.num_v_heads, layer.k_head_dim, layer.v_head_dim
            )
        }

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        layer: DeltaLayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The gated delta rule recurrence per sequence.

        For each token, with ``S`` of shape ``[k_head_dim, v_head_dim]`` per value head:
        ``S = exp(g) * S``; ``S = S + beta * k (v - k^T S)``; ``o = (scale * q)^T S``.
        Key heads are shared by ``num_v_heads // num_k_heads`` value heads.

        :param q: ``[T, num_k_heads, k_head_dim]``.
        :param k: ``[T, num_k_heads, k_head_dim]``.
        :param v: ``[T, num_v_heads, v_head_dim]``.
        :param g: ``[T, num_v_heads]``, log of the decay (``<= 0``).
        :param beta: ``[T, num_v_heads]``, in ``(0, 1)``.
        :param state: the layer's float32 state cache.
        :param out: optional ``[T, num_v_heads, v_head_dim]`` buffer.
        :return: ``o`` or the empty sentinel.
        """


def _bases_by_family(bases: Sequence[type[Backend]]) -> dict[str, type[Backend]]:
    by_family = {base.family: base for base in bases}
    missing = [family for family in FAMILIES if family not in by_family]
    if missing:  # a family added to hookspecs.FAMILIES needs its base class here
        raise ImportError(f"no backend base class for op families {', '.join(missing)}")
    return {family: by_family[family] for family in FAMILIES}


FAMILY_BASES: dict[str, type[Backend]] = _bases_by_family(
    (AttentionBackend, SSMBackend, MLABackend, DeltaBackend)
)
"""The base class every backend of each family derives from, in :data:`FAMILIES` order."""
