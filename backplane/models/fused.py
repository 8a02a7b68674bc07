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
* :func:`gated_rms_norm` — RMS normalisation gated by ``silu(gate)``, in
  groups (the Mamba2 and gated-delta mixers);
* :func:`silu_and_mul`, :func:`act_and_mul`, :func:`apply_activation` and
  :func:`relu_squared` — the feed-forward activations, gated ones over a fused
  ``[gate | up]`` projection;
* :func:`apply_rotary_` and :func:`apply_rotary_interleaved` — rotary position
  embedding with a precomputed ``cos``/``sin``, without concatenation.

Every function keeps the rounding steps of the HF reference implementations
(the same products and casts, in the same order), so results match them to the
last bit wherever the underlying kernels do.

Each function takes ``fused_ops``: ``"torch"`` (the default) runs the plain
torch ops above, which are the reference; ``"triton"`` runs one Triton kernel
(:mod:`backplane.kernels`) when the tensors are on a CUDA device (or on
the CPU in the Triton interpreter) and of a dtype and shape the kernels take,
else the torch ops. The layers hold the choice in their ``fused_ops`` attribute;
:meth:`~backplane.models.base.CausalLM.set_fused_ops` sets it on every layer of
a model. Which one a model uses is decided with the backends, by
:func:`backplane.engine.selection.select_fused_ops` from the engine's
``fused_ops`` setting; :func:`check_fused_ops` checks that it can run.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from backplane import kernels
from backplane.core.errors import ConfigError

#: the implementations a layer can run its fused work with
FUSED_OPS: tuple[str, ...] = ("torch", "triton")

# The kernels module once imported (a cache of the import, not a choice: every
# call names its implementation). Read as a plain global so that torch.compile
# traces the dispatch without calling into the import machinery.
_KERNELS: ModuleType | None = None


def load_kernels() -> ModuleType:
    """Import the Triton kernels (and ``triton``) and return their module.

    :return: :mod:`backplane.kernels.elementwise`.
    :raises ImportError: when ``triton`` cannot be imported.
    """
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = kernels.load()
    return _KERNELS


def triton_unavailable_reason(device: torch.device | str) -> str | None:
    """Say why the Triton kernels cannot run on ``device`` without importing them.

    :param device: the device of the model's tensors.
    :return: the reason, or ``None`` when they can run there.
    """
    return kernels.unavailable_reason(torch.device(device))


def check_fused_ops(impl: str, device: torch.device | str) -> None:
    """Make sure the layers can run their fused work with ``impl`` on ``device``.

    Which implementation to use is decided by
    :func:`backplane.engine.selection.select_fused_ops`; this only checks that
    the chosen one can run, and imports the Triton kernels for ``"triton"``.

    :param impl: ``"torch"`` or ``"triton"``.
    :param device: the device of the model's tensors.
    :raises ConfigError: for ``"triton"`` where the kernels cannot run (no CUDA
        device, ``triton`` missing or failing to import), or for anything other
        than the two implementations.
    """
    if impl == "torch":
        return
    if impl != "triton":
        raise ConfigError(
            f"fused_ops: expected one of {', '.join(FUSED_OPS)}, got {impl!r}; an 'auto' "
            "setting is resolved by backplane.engine.selection.select_fused_ops"
        )
    dev = torch.device(device)
    reason = kernels.unavailable_reason(dev)
    if reason is not None:
        raise ConfigError(
            f"fused_ops=triton cannot run on device {str(dev)!r}: {reason}; "
            "set fused_ops to auto or torch"
        )
    try:
        load_kernels()
    except ImportError as exc:
        raise ConfigError(
            f"fused_ops=triton: the Triton kernels do not import ({exc}); "
            "set fused_ops to auto or torch"
        ) from exc


def _triton(fused_ops: str, x: torch.Tensor, *others: torch.Tensor) -> ModuleType | None:
    """The kernels module when ``fused_ops`` asks for Triton and the tensors allow it, else ``None``.

    :param fused_ops: ``"torch"`` or ``"triton"``.
    :param x: the main input (its device decides).
    :param others: further tensors the kernel reads (their dtypes must be supported too).
    """
    if fused_ops != "triton":
        return None
    k = _KERNELS if _KERNELS is not None else load_kernels()
    if not x.is_cuda and not (x.device.type == "cpu" and k.INTERPRET):
        return None
    if x.dtype not in k.DTYPES or any(t.dtype not in k.DTYPES for t in others):
        return None
    return k


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool = False,
    *,
    fused_ops: str = "torch",
) -> torch.Tensor:
    """RMS-normalise the last dimension of ``x``, computing the statistics in float32.

    :param x: ``[..., D]`` (any strides).
    :param weight: ``[D]`` scale.
    :param eps: added to the mean square.
    :param zero_centered: ``weight`` stores ``w - 1``: scale by ``1 + weight`` in
        float32 (Qwen3-Next, Qwen3.5); otherwise the normalised value is cast to
        ``x.dtype`` before the scale (Llama and most others).
    :param fused_ops: ``"torch"`` or ``"triton"`` (see the module docstring).
    :return: a new ``[..., D]`` tensor in ``x.dtype`` (zero-centred) or in the
        promotion of ``weight.dtype`` and ``x.dtype``.
    """
    k = _triton(fused_ops, x, weight)
    if k is not None and _norm_fits(k, x, weight):
        return k.rms_norm(x, weight, eps, zero_centered)
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


def _norm_fits(k: ModuleType, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The norm kernels take a row of ``x`` in one program and a contiguous weight."""
    return x.dim() >= 1 and x.shape[-1] <= k.MAX_ROW and weight.is_contiguous()


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool = False,
    *,
    fused_ops: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``x`` to the residual stream and RMS-normalise the sum.

    The sum is taken in ``x.dtype``, as the HF decoder layers take it, so the
    residual stream is the same tensor they carry.

    :param x: ``[T, D]`` a layer's output.
    :param residual: ``[T, D]`` the residual stream so far.
    :param weight: ``[D]`` norm scale.
    :param eps: added to the mean square.
    :param zero_centered: see :func:`rms_norm`.
    :param fused_ops: ``"torch"`` or ``"triton"`` (one kernel writes both results).
    :return: ``(normed, new residual)``, both new tensors.
    """
    k = _triton(fused_ops, x, residual, weight)
    if (
        k is not None
        and x.dtype == residual.dtype
        and x.shape == residual.shape
        and _norm_fits(k, x, weight)
    ):
        return k.add_rms_norm(x, residual, weight, eps, zero_centered)
    residual = x + residual
    return rms_norm(residual, weight, eps, zero_centered), residual


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
    *,
    fused_ops: str = "torch",
) -> torch.Tensor:
    """RMS normalisation gated by ``silu(gate)``, over groups of ``group_size`` channels.

    Statistics and the gate are computed in float32; the normalised value is
    cast to ``x.dtype`` before the weight scales it.

    :param x: ``[..., D]``, ``D`` a multiple of ``group_size``.
    :param gate: the shape of ``x``.
    :param weight: ``[D]`` scale.
    :param eps: added to each group's mean square.
    :param group_size: channels normalised together (``D`` for one group).
    :param norm_before_gate: ``True``: ``norm(x) * silu(gate)``, returned in
        ``x.dtype`` (Qwen3-Next, Qwen3.5); ``False``: ``norm(x * silu(gate))``,
        returned in the promotion of ``weight.dtype`` and ``x.dtype`` (Mamba2).
    :param fused_ops: ``"torch"`` or ``"triton"`` (see the module docstring).
    :return: a new ``[..., D]`` tensor.
    """
    k = _triton(fused_ops, x, gate, weight)
    if (
        k is not None
        and gate.shape == x.shape
        and group_size <= k.MAX_ROW
        and x.shape[-1] % group_size == 0
        and weight.is_contiguous()
    ):
        return k.gated_rms_norm(x, gate, weight, eps, group_size, norm_before_gate)
    dtype = x.dtype
    xf = x.float()
    if not norm_before_gate:
        xf = xf * F.silu(gate.float())
    shape = xf.shape
    g = xf.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    xf = g.reshape(shape)
    if norm_before_gate:
        out = weight * xf.to(dtype)
        return (out.float() * F.silu(gate.float())).to(dtype)
    return weight * xf.to(dtype)


def silu_and_mul(x: torch.Tensor, *, fused_ops: str = "torch") -> torch.Tensor:
    """``silu(gate) * up`` over a fused ``[..., 2I]`` gate/up projection output.

    :param x: ``[..., 2I]``, the gate channels first.
    :param fused_ops: ``"torch"`` or ``"triton"`` (see the module docstring).
    :return: ``[..., I]``.
    """
    k = _triton(fused_ops, x)
    if k is not None and x.dim() >= 1 and x.shape[-1] % 2 == 0:
        return k.act_and_mul(x, "silu")
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (HF's ``gelu_pytorch_tanh``).

    :param x: any tensor.
    :return: a new tensor of the same shape and dtype.
    """
    return F.gelu(x, approximate="tanh")


def relu_squared(x: torch.Tensor, *, fused_ops: str = "torch") -> torch.Tensor:
    """``relu(x) ** 2`` (Nemotron-H's non-gated MLP activation).

    :param x: any tensor.
    :param fused_ops: ``"torch"`` or ``"triton"`` (see the module docstring).
    :return: a new tensor of the same shape and dtype.
    """
    k = _triton(fused_ops, x)
    if k is not None and x.dim() >= 1:
        return k.activation(x, "relu2")
    return torch.square(F.relu(x))


#: the activations the Triton kernels compute, by function
_KERNEL_ACTS: dict[Callable[[torch.Tensor], torch.Tensor], str] = {
    F.silu: "silu",
    F.relu: "relu",
    relu_squared: "relu2",
    F.gelu: "gelu",
    gelu_tanh: "gelu_tanh",
}


def act_and_mul(
    x: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    *,
    fused_ops: str = "torch",
) -> torch.Tensor:
    """``act(gate) * up`` over a fused ``[..., 2I]`` gate/up projection output.

    :param x: ``[..., 2I]``, the gate channels first.
    :param act: the activation (:func:`silu_and_mul` is the SiLU case); the
        Triton kernel computes ``F.silu``, ``F.relu``, :func:`relu_squared`,
        ``F.gelu`` and :func:`gelu_tanh`, any other runs as torch ops.
    :param fused_ops: ``"torch"`` or ``"triton"`` (see the module docstring).
    :return: ``[..., I]``.
    """
    k = _triton(fused_ops, x)
    name = _KERNEL_ACTS.get(act)
    if k is not None and name is not None and x.dim() >= 1 and x.shape[-1] % 2 == 0:
        return k.act_and_mul(x, name)
    gate, up = x.chunk(2, dim=-1)
    return act(gate) * up


def apply_activation(
    x: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    *,
    fused_ops: str = "torch",
) -> torch.Tensor:
    """``act(x)``: a non-gated activation (one kernel with Triton, for those :func:`act_and_mul` lists).

    :param x: any tensor.
    :param act: the activation.
    :param fused_ops: ``"torch"`` or ``"triton"`` (see the module docstring).
    :return: a new tensor of the same shape and dtype.
    """
    k = _triton(fused_ops, x)
    name = _KERNEL_ACTS.get(act)
    if k is not None and name is not None and x.dim() >= 1:
        return k.activation(x, name)
    return act(x)


def _rotary_fits(k: ModuleType, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The rotary kernels read ``[T, H, D]`` (unit stride in ``D``) and per-token cos/sin rows."""
    return (
        x.dim() == 3
        and (x.stride(-1) == 1 or x.shape[-1] <= 1)
        and cos.dtype == sin.dtype == x.dtype
        and cos.shape == sin.shape
        and cos.dim() == 3
        and cos.shape[0] == x.shape[0]
        and cos.shape[1] == 1
        and 2 * cos.shape[-1] <= x.shape[-1]
        and cos.stride(-1) == 1
        and sin.stride(-1) == 1
    )


def apply_rotary_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, fused_ops: str = "torch"
) -> torch.Tensor:
    """Rotate channel pairs ``(i, i + h)`` of ``x`` in place, ``h = cos.shape[-1]``.

    ``x[..., :h], x[..., h:2h] <- x1 * cos - x2 * sin, x2 * cos + x1 * sin``;
    channels from ``2h`` on (partial rotary) are left as they are. ``x`` may be
    a strided view (e.g. the query and key heads of a fused projection output),
    which is how one call rotates queries and keys together.

    :param x: ``[T, H, D]`` with ``D >= 2h``; modified in place.
    :param cos: ``[T, 1, h]``, in ``x.dtype``.
    :param sin: ``[T, 1, h]``, in ``x.dtype``.
    :param fused_ops: ``"torch"`` or ``"triton"`` (one kernel, in place).
    :return: ``x``.
    """
    k = _triton(fused_ops, x, cos, sin)
    if k is not None and _rotary_fits(k, x, cos, sin):
        return k.rotary_(x, cos, sin)
    h = cos.shape[-1]
    x1, x2 = x[..., :h], x[..., h : 2 * h]
    x1_sin = x1 * sin
    x1.mul_(cos).sub_(x2 * sin)
    x2.mul_(cos).add_(x1_sin)
    return x


def head_norm_rotary_(
    x: torch.Tensor,
    n_first: int,
    first_weight: torch.Tensor,
    second_weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    fused_ops: str = "torch",
) -> torch.Tensor:
    """RMS-normalise each head of ``x``, then rotate its channel pairs ``(i, i + D/2)``, in place.

    What a Qwen3 layer does to its queries and keys (per-head norms, then
    rotary over whole heads): :func:`rms_norm` of the first ``n_first`` heads
    with ``first_weight`` and of the rest with ``second_weight``, then
    :func:`apply_rotary_`, with the same roundings. With ``fused_ops="triton"``
    it is one kernel for both (four launches otherwise).

    :param x: ``[T, H, D]`` with unit stride in ``D`` (e.g. the query and key heads of a
        fused projection output); modified in place.
    :param n_first: how many leading heads take ``first_weight``.
    :param first_weight: ``[D]``; in ``x.dtype`` unless ``zero_centered`` (the norm's
        result must be in ``x.dtype`` to be written back).
    :param second_weight: like ``first_weight``.
    :param eps: added to the mean square.
    :param zero_centered: the weights store ``w - 1`` (see :func:`rms_norm`).
    :param cos: ``[T, 1, D/2]``, in ``x.dtype``.
    :param sin: ``[T, 1, D/2]``, in ``x.dtype``.
    :param fused_ops: ``"torch"`` or ``"triton"`` (see the module docstring).
    :return: ``x``.
    :raises ValueError: the norm would return another dtype than ``x``'s.
    """
    for w in (first_weight, second_weight):
        if not norm_keeps_dtype(x.dtype, w, zero_centered):
            raise ValueError(
                f"head_norm_rotary_: a {w.dtype} weight would normalise {x.dtype} heads into "
                f"{torch.promote_types(w.dtype, x.dtype)}; cast the weights to {x.dtype}"
            )
    k = _triton(fused_ops, x, first_weight, second_weight, cos, sin)
    if (
        k is not None
        and _rotary_fits(k, x, cos, sin)
        and 2 * cos.shape[-1] == x.shape[-1]
        and _norm_fits(k, x, first_weight)
        and second_weight.is_contiguous()
    ):
        return k.head_norm_rotary_(
            x, n_first, first_weight, second_weight, eps, zero_centered, cos, sin
        )
    x[:, :n_first] = rms_norm(x[:, :n_first], first_weight, eps, zero_centered, fused_ops=fused_ops)
    x[:, n_first:] = rms_norm(
        x[:, n_first:], second_weight, eps, zero_centered, fused_ops=fused_ops
    )
    return apply_rotary_(x, cos, sin, fused_ops=fused_ops)


def norm_keeps_dtype(dtype: torch.dtype, weight: torch.Tensor, zero_centered: bool) -> bool:
    """Whether :func:`rms_norm` of ``dtype`` rows with ``weight`` returns ``dtype`` (the result
    can then be written back over its input, as :func:`head_norm_rotary_` does).

    :param dtype: the rows' dtype.
    :param weight: the norm's weight.
    :param zero_centered: as for :func:`rms_norm`.
    :return: ``True`` when no promotion changes the dtype.
    """
    return zero_centered or torch.promote_types(weight.dtype, dtype) == dtype


def apply_rotary_interleaved(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, fused_ops: str = "torch"
) -> torch.Tensor:
    """Rotate channel pairs ``(2i, 2i + 1)`` of ``x`` and return them de-interleaved.

    The result holds the rotated first channels of the pairs in ``[..., :h]``
    and the rotated second ones in ``[..., h:2h]`` (DeepSeek's
    ``rope_interleave``, laid out as HF writes it, which keeps ``q . k``
    unchanged); channels from ``2h`` on are copied.

    :param x: ``[T, H, D]`` with ``D >= 2h`` (any strides; not modified).
    :param cos: ``[T, 1, h]``, in ``x.dtype``.
    :param sin: ``[T, 1, h]``, in ``x.dtype``.
    :param fused_ops: ``"torch"`` or ``"triton"`` (one kernel).
    :return: a new contiguous ``[T, H, D]`` tensor.
    """
    k = _triton(fused_ops, x, cos, sin)
    if k is not None and _rotary_fits(k, x, cos, sin):
        return k.rotary_interleaved(x, cos, sin)
    h = cos.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # One strided copy de-interleaves the pairs; the rotation then runs in place.
    out[..., : 2 * h].unflatten(-1, (2, h)).copy_(
        x[..., : 2 * h].unflatten(-1, (h, 2)).transpose(-1, -2)
    )
    if x.shape[-1] > 2 * h:
        out[..., 2 * h :].copy_(x[..., 2 * h :])
    return apply_rotary_(out, cos, sin)
