"""RMS normalisation: :class:`RMSNorm` and :class:`GatedRMSNorm` (gated, optionally grouped).

The arithmetic lives in :mod:`backplane.models.fused`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backplane.models.fused import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last dimension, computed in float32.

    :param dim: the normalised size.
    :param eps: added to the mean square.
    :param zero_centered: the weight is stored as ``w - 1`` (Qwen3-Next/Qwen3.5):
        the output is scaled by ``1 + w``.
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` (any leading shape)."""
        return rms_norm(x, self.weight, self.eps, self.zero_centered)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``x`` to the residual stream and normalise the sum (one fused function).

        :param x: a layer's output ``[T, dim]``.
        :param residual: the residual stream ``[T, dim]``.
        :return: ``(normed, new residual)``.
        """
        return fused_add_rms_norm(x, residual, self.weight, self.eps, self.zero_centered)

    def norm_input(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise a layer's input, starting the residual stream at the first layer.

        :param x: the previous layer's output, or the embeddings for the first layer.
        :param residual: the residual stream, ``None`` for the first layer.
        :return: ``(normed, residual)``, as :meth:`add_and_norm`.
        """
        if residual is None:
            return self(x), x
        return self.add_and_norm(x, residual)


class GatedRMSNorm(nn.Module):
    """RMS normalisation gated by ``silu(gate)``, optionally in groups.

    :param dim: the normalised size (the last dimension of the input).
    :param eps: added to the mean square.
    :param group_size: normalise groups of this many channels separately
        (default: the whole dimension).
    :param norm_before_gate: ``True`` computes ``norm(x) * silu(gate)``
        (Qwen3-Next, Qwen3.5); ``False`` computes ``norm(x * silu(gate))``
        (Mamba2 / Nemotron-H).
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        group_size: int | None = None,
        norm_before_gate: bool = True,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.group_size = group_size or dim
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` and gate it with ``gate`` (same shape)."""
        dtype = x.dtype
        xf = x.float()
        if not self.norm_before_gate:
            xf = xf * F.silu(gate.float())
        shape = xf.shape
        g = xf.reshape(*shape[:-1], shape[-1] // self.group_size, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        xf = g.reshape(shape)
        if self.norm_before_gate:
            out = self.weight * xf.to(dtype)
            return (out.float() * F.silu(gate.float())).to(dtype)
        return self.weight * xf.to(dtype)
