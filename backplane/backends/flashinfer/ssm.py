"""Mamba2 with FlashInfer's ``selective_state_update`` for decode.

What runs where
    * decode tokens of the selective scan: ``flashinfer.mamba.selective_state_update``
      in place on the state cache (``state_batch_indices`` = the sequences' state slots);
    * prefill/extend tokens of the scan and the causal conv: the fallback backend
      selection hands over when it loads this one (``auto`` among the other SSM
      backends: Triton when it is available, otherwise the torch reference; see
      :attr:`FlashInferSSMBackend.fallback_name`). Those run on a view of the batch
      holding only the prefill sequences, inside the same custom op.

FlashInfer builds the kernel's module on first use (``nvcc``, seconds to tens of
seconds on a cold machine); the backend starts that build in the background when
it first describes a layer's cache, right after the weights are read, and the
first decode waits for it (:mod:`~backplane.backends.flashinfer._prebuild`).

FlashInfer's kernel wants Mamba2's *tied* layout: ``A`` as ``(nheads, head_dim,
d_state)`` with strides ``(1, 0, 0)``, ``D`` and ``dt_bias`` as ``(nheads, head_dim)``
with strides ``(1, 0)`` and the dtype of ``dt``, and ``dt`` with stride 0 along
``head_dim``. These are ``expand`` views of the per-head parameters. The kernel
widens ``dt``, ``D`` and ``dt_bias`` to float32 as it loads them, so when the three
share a dtype they are passed as they are; otherwise all three are cast to float32
(``dt`` of the decode rows is tiny, ``[num_decode, nheads]``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from backplane.backends.flashinfer import _common, _prebuild
from backplane.backends.torch.verify_states import record_scan_states
from backplane.core import compile_ahead
from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.errors import BackendUnavailableError
from backplane.core.families import ConvLayerSpec, SSMBackend, SSMLayerSpec
from backplane.core.forward_context import forward_context, get_forward_context
from backplane.core.layouts import TensorSpec
from backplane.core.metadata import BatchMetadata

logger = logging.getLogger(__name__)

#: Input dtypes FlashInfer's state-update kernel is instantiated for.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIM_MULTIPLE = 64
D_STATE_MULTIPLE = 32


def state_update_module(
    state: torch.dtype,
    x: torch.dtype,
    weight: torch.dtype,
    index: torch.dtype,
    head_dim: int,
    d_state: int,
) -> tuple:
    """The specialisation of FlashInfer's ``selective_state_update`` module a decode builds.

    FlashInfer 0.6 builds one module per ``(state, input, weight, A, index)``
    dtype, ``head_dim``, ``d_state`` and tokens per row (one for decode); ``A``
    is passed as float32.

    :param state: the SSM state's dtype.
    :param x: the inputs' dtype.
    :param weight: the dtype of ``dt``, ``D`` and ``dt_bias`` as passed.
    :param index: the state slots' dtype.
    :param head_dim: the heads' width.
    :param d_state: the state size.
    :return: the arguments of ``get_selective_state_update_module`` after the device.
    """
    return (state, x, weight, torch.float32, index, int(head_dim), int(d_state), 1)


def _build_state_update(device: torch.device, module: tuple) -> None:
    from flashinfer.mamba.selective_state_update import get_selective_state_update_module

    get_selective_state_update_module(device, *module)


def _can_prebuild() -> bool:
    """Whether to build ahead: an engine is starting (not a test describing caches), on CUDA."""
    return compile_ahead.in_startup_window() and torch.cuda.is_available()


@dataclass
class SSMStepPlan:
    """What :meth:`FlashInferSSMBackend.plan` made for one step.

    :param batch: the full batch.
    :param fallback_plan: the fallback backend's plan for the full batch (conv).
    :param prefill_batch: the prefill sequences as a batch of their own.
    :param prefill_plan: the fallback backend's plan for ``prefill_batch``.
    """

    batch: BatchMetadata
    fallback_plan: Any = None
    prefill_batch: BatchMetadata | None = None
    prefill_plan: Any = None


class FlashInferSSMBackend(SSMBackend):
    """Mamba2 decode on FlashInfer; prefill scan and conv on a fallback SSM backend.

    :param fallback: the backend running the prefill scan and the conv; when
        ``None``, selection provides it through :meth:`set_fallback` (Triton when
        available, else torch).
    """

    name: ClassVar[str] = "flashinfer"
    needs_fallback: ClassVar[bool] = True

    def __init__(self, fallback: SSMBackend | None = None) -> None:
        self.handle = _common.register_backend(self)
        self._fallback: SSMBackend | None = None
        #: Name of the backend running the prefill scan and the conv (``""`` until set).
        self.fallback_name: str = ""
        if fallback is not None:
            self.set_fallback(fallback)

    def set_fallback(self, backend: SSMBackend) -> None:
        """Run the prefill scan and the conv on ``backend`` (see :meth:`Backend.set_fallback`).

        :param backend: a loaded SSM backend other than this one.
        """
        self._fallback = backend
        self.fallback_name = getattr(backend, "name", "") or type(backend).__name__

    @property
    def fallback(self) -> SSMBackend:
        """The backend running the prefill scan and the conv.

        :raises BackendUnavailableError: none was given.
        """
        if self._fallback is None:
            raise BackendUnavailableError(
                "the FlashInfer ssm backend runs the prefill scan and the conv on another ssm "
                "backend and was given none: load it with "
                "backplane.engine.selection.load_backend, or pass "
                "FlashInferSSMBackend(fallback=...)",
                family="ssm",
                backend=self.name,
            )
        return self._fallback

    @staticmethod
    def supports(layer: SSMLayerSpec, dtype: torch.dtype) -> tuple[bool, str]:
        """Say whether FlashInfer's state-update kernel can run ``layer`` in ``dtype``."""
        if dtype not in SUPPORTED_DTYPES:
            return False, f"FlashInfer selective_state_update does not take {dtype}"
        if layer.nheads % layer.n_groups:
            return False, "nheads must be a multiple of n_groups"
        # FlashInfer 0.6 instantiates its sm90 kernels for every (head_dim, d_state) it
        # builds; they need whole 64-row tiles and at least one 32-lane load per row.
        if layer.head_dim % HEAD_DIM_MULTIPLE or layer.d_state % D_STATE_MULTIPLE:
            return False, (
                f"FlashInfer selective_state_update needs head_dim a multiple of "
                f"{HEAD_DIM_MULTIPLE} and d_state a multiple of {D_STATE_MULTIPLE} "
                f"(got {layer.head_dim}, {layer.d_state})"
            )
        return True, ""

    def _check(self, layer: SSMLayerSpec, dtype: torch.dtype) -> None:
        ok, reason = self.supports(layer, dtype)
        if not ok:
            raise _common.UnsupportedLayerError(
                f"ssm backend 'flashinfer' cannot run layer {layer.layer_id}: {reason}; "
                "select backends.ssm: triton or torch",
                family="ssm",
                backend="flashinfer",
            )

    def cache_spec(
        self, layer: SSMLayerSpec, *, num_slots: int, dtype: torch.dtype
    ) -> dict[str, TensorSpec]:
        """The shared SSM-state layout, after checking FlashInfer can run ``layer``.

        The first call for a layer shape also starts building the decode kernel's
        module in the background (:meth:`prebuild`).
        """
        self._check(layer, dtype)
        specs = super().cache_spec(layer, num_slots=num_slots, dtype=dtype)
        self.prebuild(layer, dtype, specs["ssm_state"].dtype)
        return specs

    def prebuild(
        self, layer: SSMLayerSpec, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32
    ) -> _prebuild.BackgroundBuild | None:
        """Start building the decode module ``layer`` will need, on a background thread.

        The module assumed is the one a model of ``dtype`` uses (inputs, ``dt``,
        ``D`` and ``dt_bias`` in ``dtype``, int32 state slots); a decode that
        needs another builds that one on first use, as without this.

        :param layer: the scan layer.
        :param dtype: the model's dtype.
        :param state_dtype: the SSM state's dtype.
        :return: the build, or ``None`` outside an engine's start-up or without
            a CUDA device.
        """
        if not _can_prebuild():
            return None
        module = state_update_module(
            state_dtype, dtype, dtype, torch.int32, layer.head_dim, layer.d_state
        )
        device = torch.device("cuda", torch.cuda.current_device())
        name = f"selective_state_update (head_dim {layer.head_dim}, d_state {layer.d_state})"
        return _prebuild.start(module, name, lambda: _build_state_update(device, module))

    def plan(self, batch: BatchMetadata) -> SSMStepPlan:
        """Plan the fallback for the full batch and for its prefill part (host only)."""
        step = SSMStepPlan(batch=batch, fallback_plan=self.fallback.plan(batch))
        if batch.num_prefill_seqs:
            if batch.num_decode_seqs or batch.padded_num_tokens != batch.num_prefill_tokens:
                step.prefill_batch = _common.slice_prefill(batch)
                step.prefill_plan = self.fallback.plan(step.prefill_batch)
            else:
                step.prefill_batch, step.prefill_plan = batch, step.fallback_plan
        return step

    def _step_plan(self) -> SSMStepPlan:
        ctx = get_forward_context()
        step = ctx.plan("ssm")
        if not isinstance(step, SSMStepPlan) or step.batch is not ctx.batch:
            step = self.plan(ctx.batch)
            ctx.plans["ssm"] = step
        return step

    def dynamic_ops(self) -> tuple[Any, ...]:
        """The conv and scan ops of this backend."""
        return (
            torch.ops.backplane_flashinfer.ssm_conv.default,
            torch.ops.backplane_flashinfer.ssm_scan.default,
        )

    def conv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        layer: ConvLayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal depthwise conv with state, on the fallback backend (family contract)."""
        return _ssm_conv_op(
            x,
            weight,
            bias,
            conv_state,
            self.handle,
            layer.layer_id,
            layer.conv_dim,
            layer.kernel_size,
            layer.activation,
            out,
        )

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
        """Selective scan: prefill on the fallback, decode on FlashInfer (family contract)."""
        self._check(layer, x.dtype)
        return _ssm_scan_op(
            x,
            dt,
            A,
            B,
            C,
            D,
            dt_bias,
            z,
            ssm_state,
            self.handle,
            layer.layer_id,
            layer.nheads,
            layer.head_dim,
            layer.d_state,
            layer.n_groups,
            layer.dt_softplus,
            layer.chunk_size,
            out,
        )


# ``out`` has no schema default (callers always pass it): torch 2.11 mishandles a
# trailing optional mutable argument that the dispatcher dropped as a default.
@cached_op(
    "backplane_flashinfer::ssm_conv",
    mutates_args=("conv_state", "out"),
    output_shape=SSMBackend.conv_output_shape,
)
def _ssm_conv_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    handle: int,
    layer_id: int,
    conv_dim: int,
    kernel_size: int,
    activation: str,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """The causal conv on the fallback backend, under its own plan (out-buffer contract)."""
    backend: FlashInferSSMBackend = _common.backend_for(handle)
    step = backend._step_plan()
    layer = ConvLayerSpec(layer_id, conv_dim, kernel_size, activation)
    with forward_context(step.batch, {"ssm": step.fallback_plan}):
        res = backend.fallback.conv(x, weight, bias, conv_state, layer, out=out)
    if out is not None:
        return x.new_empty(0)
    # A custom op may not return an alias of an input; the fallback returns a new tensor.
    return res


# ``out`` has no schema default (callers always pass it): torch 2.11 mishandles a
# trailing optional mutable argument that the dispatcher dropped as a default.
@cached_op(
    "backplane_flashinfer::ssm_scan",
    mutates_args=("ssm_state", "out"),
    output_shape=SSMBackend.scan_output_shape,
)
def _ssm_scan_op(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    z: torch.Tensor | None,
    ssm_state: torch.Tensor,
    handle: int,
    layer_id: int,
    nheads: int,
    head_dim: int,
    d_state: int,
    n_groups: int,
    dt_softplus: bool,
    chunk_size: int,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Prefill rows through the fallback, decode rows through FlashInfer (out-buffer contract)."""
    backend: FlashInferSSMBackend = _common.backend_for(handle)
    step = backend._step_plan()
    batch = step.batch
    layer = SSMLayerSpec(layer_id, nheads, head_dim, d_state, n_groups, dt_softplus, chunk_size)
    buf = output_buffer(out, x.shape, x.dtype, x.device)
    # per-position states of verification chunks, over the whole batch (the prefill view has none)
    record_scan_states(x, dt, A, B, dt_bias, ssm_state, dt_softplus)
    npt = batch.num_prefill_tokens
    n = batch.num_tokens
    if npt:
        with forward_context(step.prefill_batch, {"ssm": step.prefill_plan}):
            backend.fallback.scan(
                x[:npt],
                dt[:npt],
                A,
                B[:npt],
                C[:npt],
                D,
                dt_bias,
                None if z is None else z[:npt],
                ssm_state,
                layer,
                out=buf[:npt],
            )
    if n > npt:
        _common.require_cuda(x, "SSM")
        from flashinfer.mamba import selective_state_update

        np_ = batch.num_prefill_seqs
        # dt, D and dt_bias share one dtype in the kernel, which widens each value
        # to float32 as it loads it: when the three already agree (the model's
        # dtype) they go in as they are, else all three are cast to float32. Either
        # way the kernel sees the same values; the first saves three casts per layer.
        wdt = dt.dtype if D.dtype == dt_bias.dtype == dt.dtype else torch.float32
        dec = slice(npt, n)
        xd = x[dec]
        if xd.stride(-1) != 1 or xd.stride(1) != head_dim:
            xd = xd.contiguous()
        zd = None
        if z is not None:
            zd = z[dec]
            if zd.stride(-1) != 1 or zd.stride(1) != head_dim:
                zd = zd.contiguous()
        # the module may still be building in the background (FlashInferSSMBackend.prebuild)
        _prebuild.wait(
            state_update_module(
                ssm_state.dtype, x.dtype, wdt, batch.state_slots.dtype, head_dim, d_state
            )
        )
        dtd = dt[dec].to(wdt).contiguous()
        Bd, Cd = B[dec], C[dec]
        if Bd.stride(-1) != 1 or Bd.stride(1) != d_state:
            Bd = Bd.contiguous()
        if Cd.stride(-1) != 1 or Cd.stride(1) != d_state:
            Cd = Cd.contiguous()
        selective_state_update(
            ssm_state,
            xd,
            dtd.unsqueeze(-1).expand(-1, nheads, head_dim),
            A.float()[:, None, None].expand(nheads, head_dim, d_state),
            Bd,
            Cd,
            D.to(wdt)[:, None].expand(nheads, head_dim),
            z=zd,
            dt_bias=dt_bias.to(wdt)[:, None].expand(nheads, head_dim),
            dt_softplus=dt_softplus,
            state_batch_indices=batch.state_slots[np_ : batch.num_seqs],
            pad_slot_id=-1,
            out=buf[dec],
        )
    return finish_output(out, buf, n)
