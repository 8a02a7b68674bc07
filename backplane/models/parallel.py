"""Tensor-parallel layers: column-, row- and vocabulary-parallel projections and embeddings.

A model split over the ranks of a tensor-parallel group
(:func:`~backplane.core.parallel.tensor_parallel`) holds on each rank a slice
of every large projection:

* a **column-parallel** projection holds a slice of the output rows (the
  heads of q/k/v, the channels of gate/up); its output is the rank's slice
  and needs no communication. A merged projection (q/k/v as one matrix) splits
  each part separately, so rank ``r`` holds ``[q_r; k_r; v_r]``; a part may
  also be replicated (a latent projection merged with a sharded one).
* a **row-parallel** projection holds a slice of the input columns; every
  rank computes a partial product of the full output and one all-reduce sums
  them. The bias is added once.
* the **vocabulary-parallel** embedding holds a slice of the rows; ids of
  other ranks look up zeros and one all-reduce joins them. The LM head holds
  the same rows and all-gathers its logits, so every rank sees the logits of
  the full vocabulary and greedy choice and sampling are those of one device.

With one rank the factories here return the plain classes of
:mod:`backplane.models.linear` (and ``nn.Embedding``): a single-device model
is exactly the model without tensor parallelism, fused one-row kernels
included.

Which slice of a full tensor a rank holds is a :class:`ParamShard` per
parameter, kept by the module in its ``tp_shards`` dictionary (keyed by
parameter leaf name). The model uses it to slice checkpoint tensors as they
load (safetensors slices are read without materialising the full tensor) and
to give each rank its slice of the same full random tensor one rank would draw.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from backplane.core.parallel import TensorParallel, UnevenSplitError, tensor_parallel
from backplane.models.linear import Linear, MergedLinear, dense

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "ParamShard",
    "PartShard",
    "RowParallelLinear",
    "ShardSlice",
    "VocabParallelEmbedding",
    "column_parallel_linear",
    "head_shard",
    "kv_head_shard",
    "lm_head",
    "merged_column_parallel_linear",
    "module_shards",
    "row_parallel_linear",
    "vocab_parallel_embedding",
]


@dataclass(frozen=True)
class PartShard:
    """The ``[start, stop)`` slice of a part of ``total`` rows (or columns) that a rank holds.

    :param total: the part's full size along the split dimension.
    :param start: first index this rank holds.
    :param stop: one past the last index this rank holds.
    """

    total: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        """How many indices this rank holds."""
        return self.stop - self.start

    @classmethod
    def whole(cls, total: int) -> PartShard:
        """A replicated part: every rank holds all of it.

        :param total: the part's size.
        :return: ``PartShard(total, 0, total)``.
        """
        return cls(total, 0, total)


@dataclass(frozen=True)
class ShardSlice:
    """The slice of one checkpoint tensor that a rank holds: ``part`` along ``dim``.

    :param dim: the split dimension of the checkpoint tensor.
    :param part: the slice along it.
    """

    dim: int
    part: PartShard

    def full_shape(self, local: Sequence[int]) -> tuple[int, ...]:
        """The full tensor's shape, given the shape of this rank's slice.

        :param local: this rank's slice's shape.
        :return: the shape with ``dim`` at its full size.
        """
        shape = list(local)
        shape[self.dim] = self.part.total
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``full`` (a view).

        :param full: the whole checkpoint tensor.
        :return: ``full`` narrowed along :attr:`dim`.
        """
        return full.narrow(self.dim, self.part.start, self.part.size)

    def index(self, ndim: int) -> tuple[slice, ...]:
        """The slice as an index of a tensor of ``ndim`` dimensions (for safetensors' ``get_slice``).

        :param ndim: the full tensor's number of dimensions.
        :return: one ``slice`` per dimension up to :attr:`dim`.
        """
        dim = self.dim % ndim
        return (slice(None),) * dim + (slice(self.part.start, self.part.stop),)


@dataclass(frozen=True)
class ParamShard:
    """How a rank's parameter is cut from the full one: parts stacked along ``dim``.

    The full parameter is the parts joined along ``dim``; the rank's parameter
    is each part's slice, joined in the same order (a merged q/k/v projection
    on rank ``r`` holds ``[q_r; k_r; v_r]``).

    :param dim: the split dimension of the parameter.
    :param parts: the parts along it, in order.
    """

    dim: int
    parts: tuple[PartShard, ...]

    def full_shape(self, local: Sequence[int]) -> tuple[int, ...]:
        """The full parameter's shape, given this rank's.

        :param local: this rank's parameter shape.
        :return: the shape with ``dim`` at the parts' full total.
        """
        shape = list(local)
        shape[self.dim] = sum(p.total for p in self.parts)
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's parameter cut from ``full``.

        :param full: the full parameter (shape :meth:`full_shape`).
        :return: the rank's slices of the parts, joined along :attr:`dim`.
        """
        pieces = []
        start = 0
        for p in self.parts:
            pieces.append(full.narrow(self.dim, start + p.start, p.size))
            start += p.total
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def part_slices(self) -> Iterator[tuple[int, int, ShardSlice]]:
        """Yield ``(local start, local size, checkpoint slice)`` of each part.

        :return: where each part lies in the rank's parameter along :attr:`dim`,
            and the slice of the part's checkpoint tensor it holds.
        """
        start = 0
        for p in self.parts:
            yield start, p.size, ShardSlice(self.dim, p)
            start += p.size

    @property
    def sharded(self) -> bool:
        """Whether any part is split (not every part replicated)."""
        return any(p.size != p.total for p in self.parts)


def head_shard(tp: TensorParallel, num_heads: int, head_size: int, what: str) -> PartShard:
    """The rows of ``num_heads`` heads of ``head_size`` that ``tp``'s rank holds (an even split).

    :param tp: the group.
    :param num_heads: heads of the projection.
    :param head_size: rows per head.
    :param what: what the heads are, for the error message.
    :return: the rank's slice of the ``num_heads * head_size`` rows.
    :raises UnevenSplitError: ``num_heads`` is not a multiple of the group size.
    """
    start, stop = tp.shard(num_heads, what)
    return PartShard(num_heads * head_size, start * head_size, stop * head_size)


def kv_head_shard(tp: TensorParallel, num_kv_heads: int, head_size: int) -> PartShard:
    """The rows of the key/value heads ``tp``'s rank holds.

    With at least as many KV heads as ranks they are split evenly; with fewer
    each rank keeps the one KV head its query heads read (ranks
    ``[i * size / kv, (i + 1) * size / kv)`` replicate head ``i``).

    :param tp: the group.
    :param num_kv_heads: the model's key/value heads.
    :param head_size: rows per head.
    :return: the rank's slice of the ``num_kv_heads * head_size`` rows.
    :raises UnevenSplitError: neither count divides the other.
    """
    if tp.size <= num_kv_heads:
        return head_shard(tp, num_kv_heads, head_size, "key/value heads")
    if tp.size % num_kv_heads:
        raise UnevenSplitError(
            f"{num_kv_heads} key/value heads can neither be split over nor replicated on "
            f"{tp.size} tensor-parallel ranks; choose a tensor_parallel_size that divides "
            f"{num_kv_heads} or is a multiple of it"
        )
    head = tp.rank // (tp.size // num_kv_heads)
    return PartShard(num_kv_heads * head_size, head * head_size, (head + 1) * head_size)


def module_shards(module: nn.Module) -> dict[str, ParamShard]:
    """The :class:`ParamShard` of each of ``module``'s own sharded parameters (by leaf name).

    :param module: any module.
    :return: its ``tp_shards`` (empty for a module that is not split).
    """
    return getattr(module, "tp_shards", None) or {}


class ColumnParallelLinear(Linear):
    """A projection holding a slice of the output rows (see :func:`column_parallel_linear`).

    :param in_features: the input width (whole on every rank).
    :param shard: this rank's slice of the output rows.
    :param bias: the projection has a bias (split like the rows).
    """

    def __init__(self, in_features: int, shard: PartShard, bias: bool = False) -> None:
        super().__init__(in_features, shard.size, bias=bias)
        layout = ParamShard(0, (shard,))
        self.tp_shards = {"weight": layout, **({"bias": layout} if bias else {})}


class MergedColumnParallelLinear(MergedLinear):
    """A merged projection whose every part holds a slice of its rows (or all of them).

    See :func:`merged_column_parallel_linear`.

    :param in_features: the input width.
    :param parts: ``(checkpoint module name, this rank's slice of its rows)`` per part.
    :param bias: every part has a bias.
    """

    def __init__(
        self, in_features: int, parts: Sequence[tuple[str, PartShard]], bias: bool = False
    ) -> None:
        super().__init__(in_features, [(name, p.size) for name, p in parts], bias=bias)
        layout = ParamShard(0, tuple(p for _, p in parts))
        self.tp_shards = {"weight": layout, **({"bias": layout} if bias else {})}


class RowParallelLinear(Linear):
    """A projection holding a slice of the input columns; its output is all-reduced.

    At one row the one-row kernel of :class:`~backplane.models.linear.Linear`
    computes this rank's partial product, plain or with a gated MLP's product
    formed as its input (:meth:`forward_gated`), without the bias; the
    all-reduce and the bias follow as they do after ``dense``. Variants whose
    epilogue acts on the whole output (an activation, a rotation, a gated
    epilogue) or whose prologue normalises the row are not used: the partial
    sums are not the output. A quantised shard (``quant`` set) multiplies
    through its quantisation, also without the bias.

    :param shard: this rank's slice of the input columns.
    :param out_features: the output width (whole on every rank).
    :param bias: the projection has a bias (whole, added once).
    :param reduce: all-reduce the output; ``False`` returns the partial sum
        (the bias then counted on rank 0 only) for a caller that adds several
        partial results and reduces them once.
    :param tp: the group.
    """

    def __init__(
        self,
        shard: PartShard,
        out_features: int,
        bias: bool = False,
        *,
        reduce: bool = True,
        tp: TensorParallel,
    ) -> None:
        super().__init__(shard.size, out_features, bias=bias)
        self.tp_shards = {"weight": ParamShard(1, (shard,))}
        self.reduce = reduce
        self.tp = tp

    def _projection(self, x: torch.Tensor, variant: tuple) -> Any:
        """The one-row kernel for the plain and gated-input partial products only (see the
        class docstring)."""
        if variant[0] not in ("plain", "gated"):
            return None
        return super()._projection(x, variant)

    def _kernel_bias(self) -> torch.Tensor | None:
        """None: the bias is added once, after the partial products are summed."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The product of ``x``'s columns with this rank's, summed over the ranks.

        :param x: ``[..., in_features]``, this rank's slice of the input.
        :return: ``[..., out_features]``: the full output (or, without
            ``reduce``, this rank's partial sum).
        """
        proj = self._projection(x, ("plain",))
        if proj is not None:
            return self._sum(proj(x)[0])
        bias = self.bias
        first = bias is not None and not self.reduce and self.tp.rank == 0
        if self.quant is not None:
            y = self.quant.apply(self, x, bias=first)
        else:
            y = dense(x, self.weight, bias if first else None, self.packed_weight)
        if not self.reduce:
            return y
        self.tp.all_reduce(y)
        return y if bias is None else y + bias

    def forward_gated(self, x: torch.Tensor, act: str) -> torch.Tensor | None:
        """``self(act(gate) * up)`` for ``x = [gate | up]`` (this rank's inner channels), with
        the product formed as the one-row kernel reads its input; ``None`` where that kernel
        does not run (see :meth:`Linear.forward_gated
        <backplane.models.linear.Linear.forward_gated>`)."""
        y = super().forward_gated(x, act)
        return None if y is None else self._sum(y)

    def _sum(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial product ``y`` (no bias) all-reduced and biased, or, without
        ``reduce``, biased on rank 0 only (the caller sums the ranks' partials once)."""
        bias = self.bias
        if not self.reduce:
            return y + bias if bias is not None and self.tp.rank == 0 else y
        self.tp.all_reduce(y)
        return y if bias is None else y + bias


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding a slice of the vocabulary rows; lookups are all-reduced.

    :param shard: this rank's slice of the vocabulary.
    :param embedding_dim: the embedding width.
    :param tp: the group.
    """

    def __init__(self, shard: PartShard, embedding_dim: int, *, tp: TensorParallel) -> None:
        super().__init__(shard.size, embedding_dim)
        self.tp_shards = {"weight": ParamShard(0, (shard,))}
        self.vocab_start, self.vocab_stop = shard.start, shard.stop
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Look up ``input_ids``; ids outside this rank's rows contribute zeros before the sum.

        :param input_ids: token ids of the full vocabulary.
        :return: ``[..., embedding_dim]`` embeddings, the same on every rank.
        """
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_stop)
        local = torch.where(outside, 0, input_ids - self.vocab_start)
        y = super().forward(local)
        y = y.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(y)


class ParallelLMHead(Linear):
    """The LM head holding a slice of the vocabulary rows; logits are all-gathered.

    :param in_features: the hidden width.
    :param shard: this rank's slice of the vocabulary.
    :param tp: the group.
    """

    def __init__(self, in_features: int, shard: PartShard, *, tp: TensorParallel) -> None:
        super().__init__(in_features, shard.size, bias=False)
        self.tp_shards = {"weight": ParamShard(0, (shard,))}
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the full vocabulary, on every rank.

        :param x: ``[N, in_features]``.
        :return: ``[N, vocabulary]``, this rank's columns joined with the others'.
        """
        return self.tp.all_gather(super().forward(x), dim=-1)


def _group(tp: TensorParallel | None) -> TensorParallel:
    return tensor_parallel() if tp is None else tp


def column_parallel_linear(
    in_features: int,
    out_features: int,
    bias: bool = False,
    *,
    head_size: int = 1,
    what: str = "output features",
    tp: TensorParallel | None = None,
) -> Linear:
    """A projection whose output rows are split over the ranks (whole heads per rank).

    :param in_features: the input width.
    :param out_features: the full output width.
    :param bias: the projection has a bias.
    :param head_size: rows that must stay on one rank (a head's rows); the
        split is over ``out_features // head_size`` units.
    :param what: what the units are, for the error message of an uneven split.
    :param tp: the group (the process's by default).
    :return: a plain :class:`~backplane.models.linear.Linear` with one rank,
        else a :class:`ColumnParallelLinear`.
    :raises UnevenSplitError: the units cannot be split evenly over the ranks.
    """
    tp = _group(tp)
    if not tp.enabled:
        return Linear(in_features, out_features, bias=bias)
    shard = head_shard(tp, out_features // head_size, head_size, what)
    return ColumnParallelLinear(in_features, shard, bias=bias)


def merged_column_parallel_linear(
    in_features: int,
    parts: Sequence[tuple[str, int | PartShard]],
    bias: bool = False,
    *,
    tp: TensorParallel | None = None,
) -> MergedLinear:
    """Several projections of one input as one matrix, each part split over the ranks separately.

    :param in_features: the input width.
    :param parts: ``(checkpoint module name, rows)`` per part, in output order:
        an ``int`` is split evenly over the ranks, a :class:`PartShard` is the
        rank's slice as given (:func:`head_shard`, :func:`kv_head_shard`, or
        :meth:`PartShard.whole` for a replicated part).
    :param bias: every part has a bias.
    :param tp: the group (the process's by default).
    :return: a plain :class:`~backplane.models.linear.MergedLinear` of the full
        sizes with one rank or when every part is whole, else a
        :class:`MergedColumnParallelLinear`.
    :raises UnevenSplitError: a part cannot be split evenly over the ranks.
    """
    tp = _group(tp)
    if not tp.enabled:
        return MergedLinear(
            in_features,
            [(name, n if isinstance(n, int) else n.total) for name, n in parts],
            bias=bias,
        )
    shards = [
        (name, n if isinstance(n, PartShard) else head_shard(tp, n, 1, f"rows of {name}"))
        for name, n in parts
    ]
    if all(p.size == p.total for _, p in shards):
        return MergedLinear(in_features, [(name, p.total) for name, p in shards], bias=bias)
    return MergedColumnParallelLinear(in_features, shards, bias=bias)


def row_parallel_linear(
    in_features: int,
    out_features: int,
    bias: bool = False,
    *,
    head_size: int = 1,
    reduce: bool = True,
    what: str = "input features",
    tp: TensorParallel | None = None,
) -> Linear:
    """A projection whose input columns are split over the ranks, its output all-reduced.

    :param in_features: the full input width.
    :param out_features: the output width.
    :param bias: the projection has a bias.
    :param head_size: columns that must stay on one rank (a head's).
    :param reduce: all-reduce the output (see :class:`RowParallelLinear`).
    :param what: what the units are, for the error message of an uneven split.
    :param tp: the group (the process's by default).
    :return: a plain :class:`~backplane.models.linear.Linear` with one rank,
        else a :class:`RowParallelLinear`.
    :raises UnevenSplitError: the units cannot be split evenly over the ranks.
    """
    tp = _group(tp)
    if not tp.enabled:
        return Linear(in_features, out_features, bias=bias)
    shard = head_shard(tp, in_features // head_size, head_size, what)
    return RowParallelLinear(shard, out_features, bias=bias, reduce=reduce, tp=tp)


def vocab_parallel_embedding(
    num_embeddings: int, embedding_dim: int, *, tp: TensorParallel | None = None
) -> nn.Embedding:
    """The input embedding, its vocabulary rows split over the ranks.

    :param num_embeddings: the vocabulary size.
    :param embedding_dim: the embedding width.
    :param tp: the group (the process's by default).
    :return: ``nn.Embedding`` with one rank, else a :class:`VocabParallelEmbedding`.
    :raises UnevenSplitError: the vocabulary cannot be split evenly over the ranks.
    """
    tp = _group(tp)
    if not tp.enabled:
        return nn.Embedding(num_embeddings, embedding_dim)
    return VocabParallelEmbedding(
        head_shard(tp, num_embeddings, 1, "vocabulary entries"), embedding_dim, tp=tp
    )


def lm_head(in_features: int, vocab_size: int, *, tp: TensorParallel | None = None) -> Linear:
    """The LM head, its vocabulary rows split over the ranks and its logits all-gathered.

    :param in_features: the hidden width.
    :param vocab_size: the vocabulary size.
    :param tp: the group (the process's by default).
    :return: a plain :class:`~backplane.models.linear.Linear` with one rank,
        else a :class:`ParallelLMHead`.
    :raises UnevenSplitError: the vocabulary cannot be split evenly over the ranks.
    """
    tp = _group(tp)
    if not tp.enabled:
        return Linear(in_features, vocab_size, bias=False)
    return ParallelLMHead(in_features, head_shard(tp, vocab_size, 1, "vocabulary entries"), tp=tp)
