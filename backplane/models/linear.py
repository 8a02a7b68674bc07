"""The projections of every model: :func:`dense`, :class:`Linear` and :class:`MergedLinear`.

:func:`dense` is the one matrix multiply all projections and the LM head run.
On CPU in float32 it calls oneDNN's linear kernel rather than ``F.linear``:
``F.linear`` goes to MKL's sgemm, which on non-Intel x86 CPUs takes a generic
code path that reads the weights at a fraction of the memory bandwidth for the
few-row products of decode (measured on an AMD EPYC with AVX-512: batch-8
decode of SmolLM2-135M 1.6x faster with oneDNN). Elsewhere it is ``F.linear``.

:func:`pack_weight` goes one step further for CPU inference: oneDNN reads a
weight reordered once into its blocked layout about twice as fast at decode
sizes as the plain row-major matrix (SmolLM2-135M's projections at 8 rows: 54
-> 39 ms per step; its LM head 9.2 -> 4.8 ms), so
:meth:`~backplane.models.base.CausalLM.pack_weights_for_cpu` packs every
projection once the weights are loaded.

:class:`MergedLinear` computes several projections of one input as one matmul.

Checkpoints store, say, ``q_proj``, ``k_proj`` and ``v_proj`` as separate
matrices; read from the same input they are one matrix with their rows
stacked, which costs one GEMM launch and one pass over the input instead of
three. The loader copies each checkpoint tensor into its row slice of the
merged parameter (see :meth:`MergedLinear.checkpoint_slices`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from backplane import kernels

logger = logging.getLogger(__name__)

#: Whether this torch build has oneDNN's linear kernel (x86 and Arm builds usually
#: do). Decided at import: the check cannot run inside a ``torch.compile`` trace.
_ONEDNN_LINEAR = bool(torch.backends.mkldnn.is_available()) and hasattr(
    torch.ops.mkldnn, "_linear_pointwise"
)


#: Whether oneDNN can reorder a weight into its blocked layout ahead of time.
_ONEDNN_PACKING = _ONEDNN_LINEAR and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")

#: the fewest rows a packed layout is chosen for: below it oneDNN picks a
#: layout that is slower for every batch size (measured 1 to 16 rows)
_MIN_PACK_ROWS = 8


def can_pack(weight: torch.Tensor) -> bool:
    """Whether :func:`pack_weight` can pack ``weight`` (a CPU float32 matrix, with oneDNN)."""
    return (
        _ONEDNN_PACKING
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
    )


def pack_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """Reorder a CPU float32 weight into oneDNN's blocked layout for :func:`dense`.

    :param weight: ``[out_features, in_features]``, on CPU in float32 (see :func:`can_pack`).
    :param rows: the typical number of input rows (decode batch size); the
        packed weight is correct for any number of rows.
    :return: an opaque oneDNN tensor to pass to :func:`dense` as ``packed``.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), max(rows, _MIN_PACK_ROWS))


def dense(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias``, with the fastest kernel for the device and dtype.

    :param x: ``[..., in_features]``.
    :param weight: ``[out_features, in_features]``.
    :param bias: ``[out_features]`` or ``None``.
    :param packed: ``weight`` as :func:`pack_weight` returned it, used instead
        of ``weight`` (which may then be a placeholder of the same shape).
    :return: ``[..., out_features]`` in ``x``'s dtype.
    """
    if packed is None and not (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not torch.is_grad_enabled()
        and _ONEDNN_LINEAR
    ):
        return F.linear(x, weight, bias)
    # oneDNN's kernel takes a matrix: the models' [tokens, features] inputs go
    # as they are (each reshape is a dispatched call, per projection and step).
    flat = x.dim() == 2
    rows = x if flat else x.reshape(-1, x.shape[-1])
    w = weight if packed is None else packed
    y = torch.ops.mkldnn._linear_pointwise(rows, w, bias, "none", [], "")
    return y if flat else y.view(*x.shape[:-1], weight.shape[0])


class ScaledWeight(NamedTuple):
    """A quantised weight's scales as the one-row kernel reads them.

    See the ``scale``, ``scale_k`` and ``scale_n`` arguments of
    :class:`~backplane.kernels.gemv.OneRowProjection`.
    """

    #: float32 scales: one element, one per output row, or one per block
    scale: torch.Tensor
    #: input columns per scale for block scales; ``None`` for one per tensor or row
    scale_k: int | None
    #: output rows per scale row (block scales only)
    scale_n: int = 1


class WeightQuantization(Protocol):
    """How a quantised :class:`Linear` multiplies (its ``quant`` attribute, e.g.
    :class:`~backplane.models.quant.projection.Fp8Projection`).

    The one-row kernel's variants (plain, RMS-norm prologue, rotary and
    activation epilogues, gated prologue) are built by :class:`Linear` alone
    from :meth:`one_row_scales`, for every scheme the kernel reads.
    """

    def apply(self, linear: Linear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """``x @ W^T + bias`` where the one-row kernel does not run.

        :param linear: the quantised projection.
        :param x: ``[..., in_features]``.
        :param bias: add ``linear.bias`` (a row-parallel rank's partial product
            leaves it to the sum).
        :return: ``[..., out_features]`` in ``x``'s dtype.
        """
        ...

    def one_row_key(self, linear: Linear, x: torch.Tensor) -> tuple | None:
        """What the one-row projections of ``linear`` are built from, for inputs like ``x``.

        :param linear: the quantised projection.
        :param x: a one-row input.
        :return: a key that changes when the weight or its scales are replaced
            or rewritten (the projections are then built anew), or ``None``
            where the kernel does not read this weight on ``x``'s device.
        """
        ...

    def one_row_scales(self, linear: Linear) -> ScaledWeight:
        """The scales of ``linear``'s weight in the layout the one-row kernel reads fastest.

        :param linear: the quantised projection.
        :return: the scales and their layout.
        """
        ...


class Linear(nn.Linear):
    """``nn.Linear`` whose product runs through :func:`dense` (same parameters, same checkpoint names).

    With ``fused_ops = "triton"`` (set by
    :meth:`~backplane.models.base.CausalLM.set_fused_ops`), a one-row input on a
    CUDA device runs the split-K kernel of :mod:`backplane.kernels.gemv`
    where that kernel is faster than cuBLAS for the weight's shape (batch-1
    decode of tall and small projections; see
    :func:`~backplane.kernels.gemv.plan`), and on CPU tensors in the
    Triton interpreter (the tests). Traced and compiled calls keep
    :func:`dense`. :meth:`forward_activated` and :meth:`forward_normed` run the
    same kernel with an activation epilogue or an RMS-norm prologue.

    A quantised projection (``quant`` set, e.g. FP8 weights) takes the same
    one-row paths, every variant, with its weight dequantised in the kernel
    (:meth:`WeightQuantization.one_row_scales`); other inputs go to
    ``quant.apply``.
    """

    #: the weight in oneDNN's blocked layout, once :meth:`pack` has run
    packed_weight: torch.Tensor | None = None
    #: ``"torch"`` or ``"triton"``: who runs one-row products on CUDA
    fused_ops: str = "torch"
    #: the one-row projections built so far, by what rides along (see :meth:`_projection`)
    _projections: dict[tuple, Any] | None = None
    #: how a quantised weight is multiplied (see :class:`WeightQuantization`); ``None``:
    #: full precision
    quant: WeightQuantization | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project ``x``; see :func:`dense` and the class docstring."""
        proj = self._projection(x, ("plain",))
        if proj is not None:
            return proj(x)[0]
        if self.quant is not None:
            return self.quant.apply(self, x)
        return dense(x, self.weight, self.bias, self.packed_weight)

    def forward_activated(self, x: torch.Tensor, act: str) -> torch.Tensor | None:
        """``act(self(x))`` in one kernel, where the one-row kernel runs this projection.

        :param x: the input, as for :meth:`forward`.
        :param act: the activation's kernel name (a key of
            :data:`~backplane.kernels.elementwise.ACT_CODES`).
        :return: the activated output, rounded as the projection followed by
            the activation kernel round it; ``None`` where :meth:`forward` would
            not use the one-row kernel (the caller applies the activation).
        """
        proj = self._projection(x, ("act", act))
        return None if proj is None else proj(x)[0]

    def forward_gated(self, x: torch.Tensor, act: str) -> torch.Tensor | None:
        """``self(act(gate) * up)`` for ``x = [gate | up]`` in one kernel, where the one-row kernel
        runs this projection.

        :param x: a gated MLP's ``[1, 2 * in_features]`` gate/up output.
        :param act: the gate's activation (a key of
            :data:`~backplane.kernels.elementwise.ACT_CODES`).
        :return: the projection, rounded as the gated activation kernel followed
            by :meth:`forward` round it; ``None`` where :meth:`forward` would not
            use the one-row kernel (the caller forms the product).
        """
        if x.shape[-1] != 2 * self.in_features:
            return None
        proj = self._projection(x, ("gated", act))
        return None if proj is None else proj(x)[0]

    def forward_glu(self, x: torch.Tensor, act: str) -> torch.Tensor | None:
        """``act(gate) * up`` of a gated MLP's ``[gate | up]`` projection in one kernel, where the
        one-row kernel runs this projection.

        :param x: the input, as for :meth:`forward`.
        :param act: the gate's activation (a key of
            :data:`~backplane.kernels.elementwise.ACT_CODES`).
        :return: ``[1, out_features / 2]``, rounded as :meth:`forward` followed by
            the gated activation kernel round it; ``None`` where :meth:`forward`
            would not use the one-row kernel (the caller forms the product).
        """
        proj = self._projection(x, ("glu", act))
        return None if proj is None else proj(x)[0]

    def forward_normed(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        zero_centered: bool,
        act: str | None = None,
        rotary: RotaryEpilogue | None = None,
        glu: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Project the RMS-normalised ``x (+ residual)`` in one kernel, where the one-row kernel runs.

        See :func:`~backplane.kernels.gemv.norm_gemv`: the results are
        those of the norm followed by :meth:`forward` (and ``act``, and the
        rotation).

        :param x: a layer's output (or the embeddings), ``[1, in_features]``.
        :param residual: the residual stream, or ``None`` when it starts at ``x``.
        :param norm_weight: the norm's scale, ``[in_features]``.
        :param eps: the norm's epsilon.
        :param zero_centered: the norm weight stores ``w - 1``.
        :param act: an activation applied as the epilogue, or ``None``.
        :param rotary: rotate the leading outputs (an attention layer's query
            and key heads), or ``None``.
        :param glu: the weight is a gated MLP's ``[gate | up]``: the output is
            ``glu(gate) * up`` (see :meth:`forward_glu`), or ``None``.
        :return: ``(output, residual stream)``, or ``None`` where the kernel
            does not run this input with all of the above (the caller
            normalises, projects and rotates).
        """
        if residual is not None and (
            residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1
        ):
            return None
        if rotary is None:
            variant: tuple = ("norm", norm_weight, eps, zero_centered, act, None, glu)
            cos = sin = None
        else:
            cos, sin = rotary.cos, rotary.sin
            half = cos.shape[-1]
            if cos.dtype != x.dtype or cos.stride(-1) != 1 or sin.stride(-1) != 1:
                return None
            variant = ("norm", norm_weight, eps, zero_centered, act, (rotary.rows, half), glu)
        proj = self._projection(x, variant)
        if proj is None:
            return None
        y, res_out = proj(x, residual, cos, sin)
        return y, (x if res_out is None else res_out)

    def _projection(self, x: torch.Tensor, variant: tuple) -> Any:
        """The one-row projection for ``x`` with what ``variant`` adds, or ``None`` where
        :func:`dense` (and separate kernels) run it.

        :param variant: ``("plain",)``, ``("act", act)``, ``("gated", act)``,
            ``("glu", act)`` or ``("norm", norm weight, eps, zero_centered, act,
            (rows, half) or None, glu act or None)``.
        """
        if (
            self.fused_ops != "triton"
            or x.dim() != 2
            or x.shape[0] != 1
            or x.stride(-1) != 1
            or not (x.is_cuda or kernels.interpreting())
            or torch.is_grad_enabled()
            or torch.compiler.is_compiling()
        ):
            return None
        # A weight whose storage moved or changed (reloaded, packed, moved to
        # another device; quantised scales rewritten) gets new projections and
        # a new plan.
        if self.quant is None:
            ident: tuple | None = (self.weight.data_ptr(),)
        else:
            ident = self.quant.one_row_key(self, x)
            if ident is None:
                return None
        cache = self._projections
        if cache is None or ident != self._projections_ident:
            cache = self._projections = {}
            self._projections_ident = ident
        proj = cache.get(variant)
        if proj is None:
            proj = cache[variant] = self._build_projection(x, variant)
        return proj if proj and proj.dtype == x.dtype else None

    #: what :attr:`_projections` were built from (the weight's ``data_ptr()``, or
    #: the quantisation's :meth:`~WeightQuantization.one_row_key`)
    _projections_ident: tuple | None = None

    def _build_projection(self, x: torch.Tensor, variant: tuple) -> Any:
        """Build what :meth:`_projection` returns (``False`` where the kernel does not run it)."""
        kind = variant[0]
        scaled = None if self.quant is None else self.quant.one_row_scales(self)
        launch = self._plan_gemv(x, gated=kind == "gated", scaled=scaled)
        if not launch:
            return False
        gemv = kernels.load_gemv()
        # One weight argument set for every variant: a quantised weight is
        # dequantised in the kernel whatever rides along.
        common: dict[str, Any] = {"launch": launch, "dtype": x.dtype}
        if scaled is not None:
            common.update(scale=scaled.scale, scale_k=scaled.scale_k, scale_n=scaled.scale_n)
        if kind == "plain":
            return gemv.OneRowProjection(self.weight, self._kernel_bias(), **common)
        if kind == "act":
            return gemv.OneRowProjection(self.weight, self._kernel_bias(), act=variant[1], **common)
        if kind == "gated":
            return gemv.OneRowProjection(
                self.weight, self._kernel_bias(), gate_act=variant[1], **common
            )
        if kind == "glu":
            if not gemv.glu_fits(launch, self.out_features):
                return False
            return gemv.OneRowProjection(self.weight, self._kernel_bias(), glu=variant[1], **common)
        _, norm_weight, eps, zero_centered, act, rot, glu = variant
        if (
            x.shape[-1] > gemv.NORM_MAX_ROW
            or norm_weight.dtype != x.dtype
            or not norm_weight.is_contiguous()
            or (rot is not None and not gemv.rotary_fits(launch, self.out_features, *rot, x.dtype))
            or (glu is not None and not gemv.glu_fits(launch, self.out_features, act, rot))
        ):
            return False
        return gemv.OneRowProjection(
            self.weight,
            self._kernel_bias(),
            act=act,
            norm=(norm_weight, eps, zero_centered),
            rotary=rot,
            glu=glu,
            **common,
        )

    def _kernel_bias(self) -> torch.Tensor | None:
        """The bias the one-row kernel adds to its sums (a subclass that adds it later: ``None``)."""
        return self.bias

    def _plan_gemv(
        self,
        x: torch.Tensor,
        scaled: ScaledWeight | None = None,
        gated: bool = False,
    ) -> tuple[int, ...]:
        """The split-K launch for one-row inputs like ``x``, or ``()`` to keep cuBLAS.

        :param gated: the kernel forms the input from a gated MLP's row (see
            :func:`~backplane.kernels.gemv.plan_gated`).
        :param scaled: a quantised weight's scales (see
            :func:`~backplane.kernels.gemv.plan_fp8`: every shape runs the
            kernel), ``None`` for a full-precision weight.
        """
        w = self.weight
        if (
            self.packed_weight is not None
            or (scaled is None and w.dtype != x.dtype)
            or w.stride(-1) != 1
            or (self.bias is not None and not self.bias.is_contiguous())
        ):
            return ()
        gemv = kernels.load_gemv()
        if x.dtype not in gemv.DTYPES:
            return ()
        # The interpreter (CPU tests) stands in for a small device.
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        n, k = w.shape
        if gated and (scaled is None or scaled.scale_k is None):
            launch = gemv.plan_gated(n, k, sms, fp8=scaled is not None)
            if launch is not None:
                return launch
        if scaled is not None:
            try:
                return gemv.plan_fp8(n, k, sms, scaled.scale_k)
            except ValueError as exc:
                logger.warning("quantised projection %dx%d keeps its other paths: %s", n, k, exc)
                return ()
        return gemv.plan(n, k, sms)

    def pack(self, rows: int, *, release: bool) -> bool:
        """Pack the weight for CPU inference (see :func:`pack_weight`).

        :param rows: the typical number of input rows.
        :param release: free the plain weight's memory afterwards; the parameter
            becomes a zero-strided placeholder of the same shape and dtype (do
            not read it). Leave it when another module shares the weight.
        :return: whether the weight was packed (:func:`can_pack`).
        """
        if self.packed_weight is not None:
            return True
        if not can_pack(self.weight):
            return False
        self.packed_weight = pack_weight(self.weight, rows)
        if release:
            placeholder = torch.zeros((), dtype=self.weight.dtype).expand(self.weight.shape)
            self.weight = nn.Parameter(placeholder, requires_grad=False)
        return True


class MergedLinear(Linear):
    """A linear layer whose output rows are the stacked outputs of named projections.

    :param in_features: the input width.
    :param parts: ``(checkpoint module name, output rows)`` of each projection,
        in output order; the names are siblings of this module in the checkpoint
        (``q_proj`` for a merged ``qkv_proj`` of the same attention module).
    :param bias: every projection has a bias.
    """

    def __init__(
        self, in_features: int, parts: Sequence[tuple[str, int]], bias: bool = False
    ) -> None:
        sizes = tuple(int(n) for _, n in parts)
        super().__init__(in_features, sum(sizes), bias=bias)
        self.part_names = tuple(name for name, _ in parts)
        self.part_sizes = sizes

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split an output ``[..., out_features]`` into the projections' outputs (views).

        :param y: this layer's output.
        :return: one view per part, in order.
        """
        return y.split(self.part_sizes, dim=-1)

    def checkpoint_slices(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(checkpoint name relative to the parent module, row slice)`` per tensor.

        E.g. ``("k_proj.weight", qkv_proj.weight[q:q + kv])``: writing the
        checkpoint's ``k_proj.weight`` into the slice loads it.
        """
        for leaf, param in self.named_parameters(recurse=False):
            start = 0
            for name, size in zip(self.part_names, self.part_sizes, strict=True):
                yield f"{name}.{leaf}", param[start : start + size]
                start += size

    def extra_repr(self) -> str:
        """Show the parts next to the shape."""
        parts = ", ".join(f"{n}={s}" for n, s in zip(self.part_names, self.part_sizes, strict=True))
        return f"{super().extra_repr()}, parts=({parts})"


class RotaryEpilogue(NamedTuple):
    """A rotation of a projection's leading outputs, done as it stores them.

    The outputs ``[0, rows)`` are heads of ``2 * h`` channels (``h`` the
    length of ``cos``), rotated in pairs ``(i, i + h)`` as
    :func:`~backplane.models.fused.apply_rotary_` rotates them.
    """

    #: the token's ``h`` cosines (``[..., h]``, unit stride)
    cos: torch.Tensor
    #: the token's ``h`` sines
    sin: torch.Tensor
    #: how many leading outputs are rotated (a multiple of ``2 * h``)
    rows: int


class InputProjection(NamedTuple):
    """A block's first projection of its input, for a pre-norm to run with it in one kernel.

    Returned by a block's ``input_projection()`` (see
    :meth:`~backplane.models.norm.RMSNorm.project_input`).
    """

    #: the projection
    linear: Linear
    #: an activation applied to its output (the kernel's epilogue), or ``None``
    act: str | None = None
    #: a rotation of its leading outputs, or ``None``
    rotary: RotaryEpilogue | None = None
    #: the gate's activation where the projection is a gated MLP's ``[gate | up]``
    #: and the kernel stores ``act(gate) * up`` (half its rows), or ``None``
    glu: str | None = None
