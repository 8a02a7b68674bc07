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

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from backplane.models import kernels

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


class Linear(nn.Linear):
    """``nn.Linear`` whose product runs through :func:`dense` (same parameters, same checkpoint names).

    With ``fused_ops = "triton"`` (set by
    :meth:`~backplane.models.base.CausalLM.set_fused_ops`), a one-row input on a
    CUDA device runs the split-K kernel of :mod:`backplane.models.kernels.gemv`
    where that kernel is faster than cuBLAS for the weight's shape (batch-1
    decode of tall and small projections; see
    :func:`~backplane.models.kernels.gemv.plan`), and on CPU tensors in the
    Triton interpreter (the tests). Traced and compiled calls keep
    :func:`dense`. :meth:`forward_activated` and :meth:`forward_normed` run the
    same kernel with an activation epilogue or an RMS-norm prologue.
    """

    #: the weight in oneDNN's blocked layout, once :meth:`pack` has run
    packed_weight: torch.Tensor | None = None
    #: ``"torch"`` or ``"triton"``: who runs one-row products on CUDA
    fused_ops: str = "torch"
    #: the split-K launch for this weight once decided (``()``: cuBLAS is as fast)
    _gemv_launch: tuple[int, ...] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project ``x``; see :func:`dense` and the class docstring."""
        launch = self._one_row_launch(x)
        if launch:
            return kernels.load_gemv().gemv(x, self.weight, self.bias, launch=launch)
        return dense(x, self.weight, self.bias, self.packed_weight)

    def forward_activated(self, x: torch.Tensor, act: str) -> torch.Tensor | None:
        """``act(self(x))`` in one kernel, where the one-row kernel runs this projection.

        :param x: the input, as for :meth:`forward`.
        :param act: the activation's kernel name (a key of
            :data:`~backplane.models.kernels.elementwise.ACT_CODES`).
        :return: the activated output, rounded as the projection followed by
            the activation kernel round it; ``None`` where :meth:`forward` would
            not use the one-row kernel (the caller applies the activation).
        """
        launch = self._one_row_launch(x)
        if not launch:
            return None
        return kernels.load_gemv().gemv(x, self.weight, self.bias, launch=launch, act=act)

    def forward_gated(self, x: torch.Tensor, act: str) -> torch.Tensor | None:
        """``self(act(gate) * up)`` for ``x = [gate | up]`` in one kernel, where the one-row kernel
        runs this projection.

        :param x: a gated MLP's ``[1, 2 * in_features]`` gate/up output.
        :param act: the gate's activation (a key of
            :data:`~backplane.models.kernels.elementwise.ACT_CODES`).
        :return: the projection, rounded as the gated activation kernel followed
            by :meth:`forward` round it; ``None`` where :meth:`forward` would not
            use the one-row kernel (the caller forms the product).
        """
        launch = self._one_row_launch(x)
        if not launch or x.shape[-1] != 2 * self.in_features:
            return None
        return kernels.load_gemv().gemv(x, self.weight, self.bias, launch=launch, gate_act=act)

    def forward_normed(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        zero_centered: bool,
        act: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Project the RMS-normalised ``x (+ residual)`` in one kernel, where the one-row kernel runs.

        See :func:`~backplane.models.kernels.gemv.norm_gemv`: the results are
        those of the norm followed by :meth:`forward` (and ``act``).

        :param x: a layer's output (or the embeddings), ``[1, in_features]``.
        :param residual: the residual stream, or ``None`` when it starts at ``x``.
        :param norm_weight: the norm's scale, ``[in_features]``.
        :param eps: the norm's epsilon.
        :param zero_centered: the norm weight stores ``w - 1``.
        :param act: an activation applied as the epilogue, or ``None``.
        :return: ``(output, residual stream)``, or ``None`` where the kernel
            does not run this input (the caller normalises and projects).
        """
        launch = self._one_row_launch(x)
        if (
            not launch
            or x.shape[-1] > kernels.load_gemv().NORM_MAX_ROW
            or norm_weight.dtype != x.dtype
            or not norm_weight.is_contiguous()
            or (
                residual is not None
                and (
                    residual.shape != x.shape
                    or residual.dtype != x.dtype
                    or residual.stride(-1) != 1
                )
            )
        ):
            return None
        return kernels.load_gemv().norm_gemv(
            x,
            residual,
            norm_weight,
            eps,
            zero_centered,
            self.weight,
            self.bias,
            launch=launch,
            act=act,
        )

    def _one_row_launch(self, x: torch.Tensor) -> tuple[int, ...] | None:
        """The split-K launch for ``x``, or ``None``/``()`` where :func:`dense` runs it."""
        if (
            self.fused_ops == "triton"
            and not torch.compiler.is_compiling()
            and (x.is_cuda or kernels.interpreting())
            and x.dim() == 2
            and x.shape[0] == 1
            and x.stride(-1) == 1
            and not torch.is_grad_enabled()
        ):
            launch = self._gemv_launch
            if launch is None:
                launch = self._gemv_launch = self._plan_gemv(x)
            return launch
        return None

    def _plan_gemv(self, x: torch.Tensor) -> tuple[int, ...]:
        """The split-K launch for one-row inputs like ``x``, or ``()`` to keep cuBLAS."""
        w = self.weight
        if (
            self.packed_weight is not None
            or w.dtype != x.dtype
            or w.stride(-1) != 1
            or (self.bias is not None and not self.bias.is_contiguous())
        ):
            return ()
        gemv = kernels.load_gemv()
        if x.dtype not in gemv.DTYPES:
            return ()
        # The interpreter (CPU tests) stands in for a small device.
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        return gemv.plan(w.shape[0], w.shape[1], sms) or ()

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
