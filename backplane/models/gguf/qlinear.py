"""Projections whose weights stay GGUF-quantised in memory: :class:`QuantizedLinear`.

A GGUF file stores a matrix row by row, each row a run of fixed-size blocks
(Q8_0: 32 values in 34 bytes; Q4_K: 256 values in 144 bytes), and a block
never spans two rows. So the raw bytes of a ``[rows, in_features]`` matrix
are a ``uint8`` tensor ``[rows, row_bytes]`` whose rows can be sliced,
permuted and stacked like the rows of a float matrix. :class:`QuantizedLinear`
keeps those bytes and dequantises inside the product, so a Q4_K projection
reads about a quarter of the bytes of its bfloat16 form per token:

- on CUDA with the Triton fused ops (``fused_ops = "triton"``, which
  ``auto`` picks there), one input row runs the kernel of
  :mod:`backplane.kernels.qgemv`, which reads the blocks and dequantises in
  registers; more rows expand the blocks into a matrix of the input's dtype
  with one kernel of the same module and multiply (the matrix is dropped);
- Q4_K and Q6_K rows there are first repacked
  (:meth:`QuantizedLinear.prepare_fused_ops`, once, when the fused ops are
  set, or at the first product; :data:`REPACKED` says how): Q4_K into the
  layout of :mod:`backplane.kernels.q4k_layout` (4.625 bits a weight against
  4.5), which the one-row kernel of :mod:`backplane.kernels.qgemv_packed`
  reads at a third of the instructions per byte, Q6_K into that of
  :mod:`backplane.kernels.q6k_layout` (its own 6.5625 bits a weight) for
  :mod:`backplane.kernels.qgemv_packed_q6k`. The raw blocks are dropped, so
  the weight is kept once;
- elsewhere (CPU, traced forwards) the matrix is dequantised per call with
  the vectorised torch code of :mod:`~backplane.models.gguf.dequant` (kept
  nowhere) and multiplied.

Like vLLM, the loader keeps every projection stored as Q8_0, Q4_K, Q5_K or
Q6_K quantised (:data:`KEPT_TYPES`), with no option to turn it off; other
types, embeddings and norms are dequantised at load as before. A merged
projection (q/k/v, gate/up) whose parts have one type stacks their rows into
one tensor; parts of different types (Q4_K_M files store some ``attn_v`` as
Q6_K) are kept as separate runs of rows, each multiplied on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from backplane import kernels
from backplane.kernels.q4k_layout import PackedQ4K, dequantize_packed, repack_q4k
from backplane.kernels.q6k_layout import PackedQ6K, dequantize_packed_q6k, repack_q6k
from backplane.models.base import CausalLM
from backplane.models.gguf.dequant import GGML_TYPES, dequantize
from backplane.models.linear import Linear, MergedLinear, dense

logger = logging.getLogger(__name__)

#: ggml type ids kept quantised in memory: Q8_0, Q4_K, Q5_K, Q6_K
KEPT_TYPES: frozenset[int] = frozenset({8, 12, 13, 14})
#: a run of rows repacked for the Triton kernels
Packed = PackedQ4K | PackedQ6K


class Repacking(NamedTuple):
    """How the runs of one ggml type are repacked for the Triton kernels.

    :param prefix: the repacked tensors are buffers ``{prefix}_{field}_{run index}``,
        one per field of ``layout``.
    :param layout: the named tuple of tensors :attr:`repack` returns.
    :param repack: ``(raw blocks [rows, row_bytes], in_features) -> layout``.
    :param dequantize: the torch reference, ``layout -> float32 [rows, in_features]``.
    :param kernels: the kernel module (a name :func:`backplane.kernels.load` takes) with
        ``supports``, ``packed_gemv`` (one row) and ``dequantize_packed_matrix``.
    """

    prefix: str
    layout: type
    repack: Callable[[torch.Tensor, int], Packed]
    dequantize: Callable[[Any], torch.Tensor]
    kernels: str


#: ggml type id -> how its runs are repacked for the Triton kernels (Q4_K, Q6_K)
REPACKED: dict[int, Repacking] = {
    12: Repacking("q4k", PackedQ4K, repack_q4k, dequantize_packed, "qgemv_packed"),
    14: Repacking("q6k", PackedQ6K, repack_q6k, dequantize_packed_q6k, "qgemv_packed_q6k"),
}


def row_bytes(ggml_type: int, in_features: int) -> int | None:
    """Bytes of one row of ``in_features`` values of ``ggml_type``, or ``None`` where the
    row is not a whole number of blocks.

    :param ggml_type: a key of :data:`~backplane.models.gguf.dequant.GGML_TYPES`.
    :param in_features: values per row.
    :return: the row's size in bytes.
    """
    layout = GGML_TYPES[int(ggml_type)]
    if in_features % layout.block_size:
        return None
    return in_features // layout.block_size * layout.type_size


class QuantizedLinear(MergedLinear):
    """A (merged) projection whose weight rows stay as GGUF blocks.

    It answers to the loader as a :class:`~backplane.models.linear.MergedLinear`
    does: :meth:`checkpoint_slices` names a row slice of the raw blocks per
    checkpoint tensor, so each GGUF tensor's bytes (``[rows, row_bytes]``
    ``uint8``) are copied into place. The fused one-row paths of
    :class:`~backplane.models.linear.Linear` (norm prologue, activation
    epilogues) decline, so their callers run the separate steps around
    :meth:`forward`.

    :param in_features: the input width.
    :param parts: ``(checkpoint module name, output rows, ggml type id)`` of
        each projection, in output order (one part for a plain projection,
        named as the module itself).
    :param bias: every projection has a bias.
    :param dtype: the dtype of the bias and of the outputs' computation.
    :param device: where the blocks and the bias live.
    :raises ValueError: a type not in :data:`KEPT_TYPES`, or rows that are
        not whole blocks of it.
    """

    def __init__(
        self,
        in_features: int,
        parts: Sequence[tuple[str, int, int]],
        bias: bool = False,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        # nn.Linear's constructor would allocate the float matrix this class exists to avoid.
        nn.Module.__init__(self)
        self.in_features = int(in_features)
        self.part_names = tuple(name for name, _, _ in parts)
        self.part_sizes = tuple(int(rows) for _, rows, _ in parts)
        self.part_types = tuple(int(t) for _, _, t in parts)
        self.out_features = sum(self.part_sizes)
        for name, t in zip(self.part_names, self.part_types, strict=True):
            if t not in KEPT_TYPES or row_bytes(t, self.in_features) is None:
                layout = GGML_TYPES.get(t)
                raise ValueError(
                    f"{name}: ggml type {layout.name if layout else t} rows of "
                    f"{self.in_features} values cannot stay quantised; dequantise it at load"
                )
        # Consecutive parts of one type share one tensor of stacked rows.
        runs: list[tuple[int, int, int]] = []  # (first row, rows, type)
        start = 0
        for rows, t in zip(self.part_sizes, self.part_types, strict=True):
            if runs and runs[-1][2] == t:
                first, n, _ = runs[-1]
                runs[-1] = (first, n + rows, t)
            else:
                runs.append((start, rows, t))
            start += rows
        self.runs = tuple(runs)
        for i, (_, rows, t) in enumerate(runs):
            blocks = torch.zeros(
                rows, row_bytes(t, self.in_features) or 0, dtype=torch.uint8, device=device
            )
            self.register_parameter(f"qweight_{i}", nn.Parameter(blocks, requires_grad=False))
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.compute_dtype = dtype
        #: runs of rows repacked (:meth:`prepare_fused_ops`), by index
        self.packed_runs: set[int] = set()
        #: set once a product was traced or captured with the raw blocks: they stay
        self._keep_raw = False

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        """The first run of rows as stored (raw ``uint8`` blocks, or the int32 quant words of a
        repacked run), for code that asks a projection where its weight lives; the float
        matrix does not exist (see :meth:`dequantized`)."""
        first, _ = next(self.blocks())
        return first if isinstance(first, torch.Tensor) else first[0]

    def blocks(self) -> Iterator[tuple[torch.Tensor | Packed, int]]:
        """Yield ``(weight, ggml type)`` per run of rows, in output order: its raw blocks
        ``[rows, row_bytes]`` ``uint8``, or the layout of a repacked run
        (:class:`~backplane.kernels.q4k_layout.PackedQ4K`,
        :class:`~backplane.kernels.q6k_layout.PackedQ6K`; see :data:`REPACKED`)."""
        for i, (_, _, t) in enumerate(self.runs):
            if i in self.packed_runs:
                how = REPACKED[t]
                fields = how.layout._fields
                yield how.layout(*(getattr(self, f"{how.prefix}_{f}_{i}") for f in fields)), t
            else:
                yield getattr(self, f"qweight_{i}"), t

    def prepare_fused_ops(self) -> int:
        """With the Triton fused ops on CUDA (or the Triton interpreter), repack each run of
        rows of a type of :data:`REPACKED` (Q4_K, Q6_K) for its one-row kernel, once, and
        drop its raw blocks.

        Called by :meth:`~backplane.models.base.CausalLM.set_fused_ops` after it sets
        :attr:`fused_ops` (before any graph is captured), and by the first product.
        Nothing is repacked while a CUDA graph is captured or a forward traced; a run
        that such a product read raw stays raw (the graph reads its bytes).

        :return: how many runs were repacked now.
        """
        if (
            self.fused_ops != "triton"
            or self._keep_raw
            or torch.compiler.is_compiling()
            or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
        ):
            return 0
        done = 0
        for i, (_, _, t) in enumerate(self.runs):
            blocks = getattr(self, f"qweight_{i}")
            if (
                i in self.packed_runs
                or t not in REPACKED
                or not (blocks.is_cuda or kernels.interpreting())
            ):
                continue
            how = REPACKED[t]
            with torch.no_grad():
                packed = how.repack(blocks, self.in_features)
            for field, tensor in zip(packed._fields, packed, strict=True):
                self.register_buffer(f"{how.prefix}_{field}_{i}", tensor)
            # the raw blocks go: one copy of the weight (an empty tensor keeps the name)
            empty = blocks.new_empty((0, blocks.shape[1]))
            setattr(self, f"qweight_{i}", nn.Parameter(empty, requires_grad=False))
            self.packed_runs.add(i)
            done += 1
        return done

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole weight as a float matrix ``[out_features, in_features]`` (tests, inspection).

        :param dtype: its dtype (default: :attr:`compute_dtype`).
        :return: a new tensor on the blocks' device.
        """
        mats = [_dequantize_rows(b, t, self.in_features) for b, t in self.blocks()]
        return torch.cat(mats).to(dtype or self.compute_dtype)

    def _unpacked(self) -> bool:
        """Whether a run of a type of :data:`REPACKED` is still to be repacked for the Triton
        kernels."""
        return (
            self.fused_ops == "triton"
            and not self._keep_raw
            and any(
                t in REPACKED and i not in self.packed_runs for i, (_, _, t) in enumerate(self.runs)
            )
        )

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether ``x`` runs the Triton kernels (as opposed to torch)."""
        return (
            self.fused_ops == "triton"
            and (x.is_cuda or kernels.interpreting())
            and not torch.compiler.is_compiling()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + bias`` with ``W`` dequantised inside the product (see the module docstring).

        :param x: ``[..., in_features]``.
        :return: ``[..., out_features]`` in ``x``'s dtype.
        """
        flat = x.reshape(-1, self.in_features)
        if self._unpacked():
            if self._fused(flat) and not (
                flat.is_cuda and torch.cuda.is_current_stream_capturing()
            ):
                self.prepare_fused_ops()
            else:
                # a graph or a trace of this product may hold the raw blocks from now on
                self._keep_raw = True
        outs = [self._run(flat, b, t) for b, t in self.blocks()]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _run(self, x: torch.Tensor, blocks: torch.Tensor | Packed, ggml_type: int) -> torch.Tensor:
        """One run of rows: ``x [n, in] @ dequant(blocks).T`` -> ``[n, rows]`` in ``x``'s dtype."""
        if not isinstance(blocks, torch.Tensor):
            how = REPACKED[ggml_type]
            if self._fused(x):
                packed = kernels.load(how.kernels)
                if packed.supports(self.in_features, x.dtype):
                    if x.shape[0] == 1:
                        return packed.packed_gemv(x, blocks)
                    return dense(x, packed.dequantize_packed_matrix(blocks, x.dtype))
            return dense(x, how.dequantize(blocks).to(x.dtype))
        if self._fused(x):
            qgemv = kernels.load_qgemv()
            if qgemv.supports(ggml_type, self.in_features, x.dtype):
                if x.shape[0] == 1:
                    return qgemv.quantized_gemv(x, blocks, ggml_type, self.in_features)
                w = qgemv.dequantize_blocks(blocks, ggml_type, self.in_features, x.dtype)
                return dense(x, w)
        w = _dequantize_rows(blocks, ggml_type, self.in_features)
        return dense(x, w.to(x.dtype))

    def checkpoint_slices(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(checkpoint name relative to the parent module, target)`` per tensor: each
        part's rows of raw blocks for its ``weight``, its slice of the bias for its ``bias``."""
        start = 0
        for name, size in zip(self.part_names, self.part_sizes, strict=True):
            yield f"{name}.weight", self._rows(start, size)
            if self.bias is not None:
                yield f"{name}.bias", self.bias[start : start + size]
            start += size

    def _rows(self, start: int, size: int) -> torch.Tensor:
        """The raw blocks of output rows ``[start, start + size)`` (one part: inside one run)."""
        for i, (first, rows, _) in enumerate(self.runs):
            if first <= start < first + rows:
                if i in self.packed_runs:
                    raise RuntimeError(
                        "the weight was repacked for the Triton kernels; load the "
                        "checkpoint before setting the fused ops"
                    )
                return getattr(self, f"qweight_{i}")[start - first : start - first + size]
        raise IndexError(f"row {start} is outside {self.out_features} rows")

    def _projection(self, x: torch.Tensor, variant: tuple) -> Any:
        """Decline the fused one-row variants: the kernel of :meth:`_run` has no prologue or epilogue."""
        return None

    def pack(self, rows: int, *, release: bool) -> bool:
        """Nothing to pack: oneDNN's blocked layout is for float weights.

        :return: ``False``.
        """
        return False

    def extra_repr(self) -> str:
        """Show the shape, the parts and their types."""
        parts = ", ".join(
            f"{n}={s}:{GGML_TYPES[t].name}"
            for n, s, t in zip(self.part_names, self.part_sizes, self.part_types, strict=True)
        )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, parts=({parts})"
        )


def _dequantize_rows(
    blocks: torch.Tensor | Packed, ggml_type: int, in_features: int
) -> torch.Tensor:
    """Raw blocks ``[rows, row_bytes]`` (or a repacked run) -> float32 ``[rows, in_features]``."""
    if not isinstance(blocks, torch.Tensor):
        return REPACKED[ggml_type].dequantize(blocks)
    return dequantize(blocks.reshape(-1), ggml_type, (blocks.shape[0], in_features))


def quantized_parts(
    lm: CausalLM, types: Mapping[str, int]
) -> dict[str, list[tuple[str, int, int]]]:
    """Which projections of ``lm`` can keep their GGUF blocks, and their parts.

    :param lm: the built model (before its weights are loaded).
    :param types: ``{module-side checkpoint name (as ``weight_targets`` keys
        it): ggml type id}`` of every tensor of the file.
    :return: ``{module name: parts as QuantizedLinear takes them}`` for every
        :class:`~backplane.models.linear.Linear` whose weight tensors are all
        of :data:`KEPT_TYPES` and whole blocks per row.
    """
    found: dict[str, list[tuple[str, int, int]]] = {}
    for mod_name, m in lm.named_modules():
        if not isinstance(m, Linear) or isinstance(m, QuantizedLinear):
            continue
        parent, _, leaf = mod_name.rpartition(".")
        prefix = f"{parent}." if parent else ""
        if isinstance(m, MergedLinear):
            named = list(zip(m.part_names, m.part_sizes, strict=True))
        else:
            named = [(leaf, m.out_features)]
        parts = []
        for name, rows in named:
            t = types.get(f"{prefix}{name}.weight")
            if t not in KEPT_TYPES or row_bytes(t, m.in_features) is None:
                break
            parts.append((name, rows, t))
        else:
            found[mod_name] = parts
    return found


def keep_projections_quantized(lm: CausalLM, types: Mapping[str, int]) -> set[str]:
    """Replace the projections of ``lm`` that :func:`quantized_parts` picks by
    :class:`QuantizedLinear` modules (their float weights are freed).

    Not with tensor parallelism: a rank's slice of a quantised matrix along its
    input would cut blocks, so a split model dequantises at load.

    :param lm: the built model, weights not loaded yet.
    :param types: as for :func:`quantized_parts`.
    :return: the module-side checkpoint names (``...q_proj.weight``) whose
        tensors the loader must now deliver as raw blocks.
    """
    if lm.tp.enabled:
        logger.info("tensor parallelism: GGUF weights are dequantised at load")
        return set()
    kept: set[str] = set()
    for mod_name, parts in quantized_parts(lm, types).items():
        old = lm.get_submodule(mod_name)
        new = QuantizedLinear(
            old.in_features,
            parts,
            bias=old.bias is not None,
            dtype=old.weight.dtype,
            device=old.weight.device,
        )
        new.fused_ops = old.fused_ops
        parent, _, leaf = mod_name.rpartition(".")
        setattr(lm.get_submodule(parent) if parent else lm, leaf, new)
        prefix = f"{parent}." if parent else ""
        kept.update(f"{prefix}{name}.weight" for name, _, _ in parts)
    if kept:
        logger.info("%d GGUF weight tensors stay quantised in memory", len(kept))
    return kept
