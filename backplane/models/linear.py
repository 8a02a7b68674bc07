""":class:`MergedLinear`: several projections of one input computed as one matmul.

Checkpoints store, say, ``q_proj``, ``k_proj`` and ``v_proj`` as separate
matrices; read from the same input they are one matrix with their rows
stacked, which costs one GEMM launch and one pass over the input instead of
three. The loader copies each checkpoint tensor into its row slice of the
merged parameter (see :meth:`MergedLinear.checkpoint_slices`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn


class MergedLinear(nn.Linear):
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
