"""The models' elementwise work as a few functions of plain torch ops.

Each function does in one call what the layers would otherwise spell out in
several places, with as few intermediate tensors as the arithmetic allows, so
that eager mode launches fewer kernels and ``torch.compile`` (inductor) sees one
small region it can fuse into a single kernel:

* :func:`rms_norm` and :func:`fused_add_rms_norm` — RMS normalisation (float32
  statistics, as the HF models compute them), the latter with the residual
  add before it;
* :func:`silu_and_mul`, :func:`act_and_mul` and :func:`relu_squared` — the
  feed-forward activations, gated ones over a fused ``[gate | up]`` projection;
* :func:`apply_rotary_` and :func:`apply_rotary_interleaved` — rotary position
  embedding with a precomputed ``cos``/``sin``, without concatenation.

Every function keeps the rounding steps of the HF reference implementations
(the same products and casts, in the same order), so results match them to the
last bit wherever the underlying kernels do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False
) -> torch.Tensor:
    """RMS-normalise the last dimension of ``x``, computing the statistics in float32.

    :param x: ``[..., D]`` (any strides).
    :param weight: ``[D]`` scale.
    :param eps: added to the mean square.
    :param zero_centered: ``weight`` stores ``w - 1``: scale by ``1 + weight`` in
        float32 (Qwen3-Next, Qwen3.5); otherwise the normalised value is cast to
        ``x.dtype`` before the scale (Llama and most others).
    :return: a new ``[..., D]`` tensor in ``x.dtype``.
    """
    dtype = x.dtype
    # Casts only where there is something to cast: in float32 they would be no-op calls.
    xf = x if dtype == torch.float32 else x.float()
    # The float32 mean square is a fresh tensor: eps and rsqrt go in place.
    inv = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    if zero_centered:
        w = weight if weight.dtype == torch.float32 else weight.float()
        out = xf * inv * (1.0 + w)
        return out if dtype == torch.float32 else out.to(dtype)
    normed = xf * inv
    return weight * (normed if dtype == torch.float32 else normed.to(dtype))


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``x`` to the residual stream and RMS-normalise the sum.

    The sum is taken in ``x.dtype``, as the HF decoder layers take it, so the
    residual stream is the same tensor they carry.

    :param x: ``[T, D]`` a layer's output.
    :param residual: ``[T, D]`` the residual stream so far.
    :param weight: ``[D]`` norm scale.
    :param eps: added to the mean square.
    :param zero_centered: see :func:`rms_norm`.
    :return: ``(normed, new residual)``, both new tensors.
    """
    residual = x + residual
    return rms_norm(residual, weight, eps, zero_centered), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over a fused ``[..., 2I]`` gate/up projection output.

    :param x: ``[..., 2I]``, the gate channels first.
    :return: ``[..., I]``.
    """
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def act_and_mul(x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``act(gate) * up`` over a fused ``[..., 2I]`` gate/up projection output.

    :param x: ``[..., 2I]``, the gate channels first.
    :param act: the activation (:func:`silu_and_mul` is the SiLU case).
    :return: ``[..., I]``.
    """
    gate, up = x.chunk(2, dim=-1)
    return act(gate) * up


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2`` (Nemotron-H's non-gated MLP activation).

    :param x: any tensor.
    :return: a new tensor of the same shape and dtype.
    """
    return torch.square(F.relu(x))


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(i, i + h)`` of ``x`` in place, ``h = cos.shape[-1]``.

    ``x[..., :h], x[..., h:2h] <- x1 * cos - x2 * sin, x2 * cos + x1 * sin``;
    channels from ``2h`` on (partial rotary) are left as they are. ``x`` may be
    a strided view (e.g. the query and key heads of a fused projection output),
    which is how one call rotates queries and keys together.

    :param x: ``[T, H, D]`` with ``D >= 2h``; modified in place.
    :param cos: ``[T, 1, h]``, in ``x.dtype``.
    :param sin: ``[T, 1, h]``, in ``x.dtype``.
    :return: ``x``.
    """
    h = cos.shape[-1]
    x1, x2 = x[..., :h], x[..., h : 2 * h]
    x1_sin = x1 * sin
    x1.mul_(cos).sub_(x2 * sin)
    x2.mul_(cos).add_(x1_sin)
    return x


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(2i, 2i + 1)`` of ``x`` and return them de-interleaved.

    The result holds the rotated first channels of the pairs in ``[..., :h]``
    and the rotated second ones in ``[..., h:2h]`` (DeepSeek's
    ``rope_interleave``, laid out as HF writes it, which keeps ``q . k``
    unchanged); channels from ``2h`` on are copied.

    :param x: ``[T, H, D]`` with ``D >= 2h`` (any strides; not modified).
    :param cos: ``[T, 1, h]``, in ``x.dtype``.
    :param sin: ``[T, 1, h]``, in ``x.dtype``.
    :return: a new contiguous ``[T, H, D]`` tensor.
    """
    h = cos.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # One strided copy de-interleaves the pairs; the rotation then runs in place.
    out[..., : 2 * h].unflatten(-1, (2, h)).copy_(
        x[..., : 2 * h].unflatten(-1, (h, 2)).transpose(-1, -2)
    )
    if x.shape[-1] > 2 * h:
        out[..., 2 * h :].copy_(x[..., 2 * h :])
    return apply_rotary_(out, cos, sin)
