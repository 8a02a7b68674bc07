"""RMS normalisation: :class:`RMSNorm` and :class:`GatedRMSNorm` (gated, optionally grouped).

The arithmetic lives in :mod:`backplane.models.fused`; each norm's
``fused_ops`` attribute (``"torch"`` or ``"triton"``, set for the whole model by
:meth:`~backplane.models.base.CausalLM.set_fused_ops`) says which implementation runs it.
"""

from __future__ import annotations

import torch
from torch import nn

from backplane.models.fused import fused_add_rms_norm, gated_rms_norm, rms_norm
from backplane.models.rotary import RopeCosSin


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last dimension, computed in float32.

    :param dim: the normalised size.
    :param eps: added to the mean square.
    :param zero_centered: the weight is stored as ``w - 1`` (Qwen3-Next/Qwen3.5):
        the output is scaled by ``1 + w``.
    """

    #: ``"torch"`` or ``"triton"``: who runs the arithmetic (:mod:`backplane.models.fused`)
    fused_ops: str = "torch"

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` (any leading shape)."""
        return rms_norm(x, self.weight, self.eps, self.zero_centered, fused_ops=self.fused_ops)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``x`` to the residual stream and normalise the sum (one fused function).

        :param x: a layer's output ``[T, dim]``.
        :param residual: the residual stream ``[T, dim]``.
        :return: ``(normed, new residual)``.
        """
        return fused_add_rms_norm(
            x, residual, self.weight, self.eps, self.zero_centered, fused_ops=self.fused_ops
        )

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

    def project_input(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        block: nn.Module,
        rope: RopeCosSin | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Normalise a layer's input and run ``block``'s first projection in one kernel.

        With ``fused_ops = "triton"``, at one token on a CUDA device, the norm
        becomes the prologue of the block's first projection (see
        :meth:`~backplane.models.linear.Linear.forward_normed`), so the
        normalised row is never stored and one launch is saved per norm.

        :param x: the previous layer's output, or the embeddings for the first layer.
        :param residual: the residual stream, ``None`` for the first layer.
        :param block: a mixer or feed-forward block with an
            ``input_projection(rope)`` method (an
            :class:`~backplane.models.linear.InputProjection` or ``None``).
        :param rope: the forward's rotary ``cos``/``sin``, for a block whose
            projection rotates (attention); ``None`` for none.
        :return: ``(the block's projected input, residual stream)`` to pass as
            the block's ``projected`` argument (with the same ``rope``), or
            ``None`` where the fused kernel does not apply with everything the
            block asked for (the caller calls :meth:`norm_input` and the block
            as usual).
        """
        # Before any shape test: a traced forward (piecewise graphs) must not
        # specialise on the token count.
        if self.fused_ops != "triton" or torch.compiler.is_compiling():
            return None
        if x.dim() != 2 or x.shape[0] != 1:
            return None
        first = getattr(block, "input_projection", None)
        spec = first(rope) if first is not None else None
        if spec is None:
            return None
        return spec.linear.forward_normed(
            x, residual, self.weight, self.eps, self.zero_centered, spec.act, spec.rotary, spec.glu
        )


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

    #: ``"torch"`` or ``"triton"``: who runs the arithmetic (:mod:`backplane.models.fused`)
    fused_ops: str = "torch"

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
        """Normalise ``x`` and gate it with ``gate`` (same shape); see :func:`gated_rms_norm`."""
        return gated_rms_norm(
            x,
            gate,
            self.weight,
            self.eps,
            self.group_size,
            self.norm_before_gate,
            fused_ops=self.fused_ops,
        )
