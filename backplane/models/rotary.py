"""Rotary position embeddings.

* :func:`rope_inv_freq` — inverse frequencies for the HF rope types
  (``default``, ``linear``, ``llama3``, ``yarn``);
* :class:`RotaryEmbedding` — the rotation of ``[T, heads, head_dim]`` queries and keys,
  with ``cos``/``sin`` tabulated per position;
* :func:`rope_parameters` — a config's rope parameters in the HF 5.x form.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from backplane.core.errors import ConfigError
from backplane.models.fused import apply_rotary_, apply_rotary_interleaved


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """Return YaRN's attention scale for a context extended ``scale`` times.

    :param scale: the rope scaling factor.
    :param mscale: the config's ``mscale`` (or ``mscale_all_dim``) multiplier.
    :return: ``0.1 * mscale * ln(scale) + 1``, or ``1`` when not extended.
    """
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(
    dim: int, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """Compute the inverse frequencies of a rotary embedding (float32, CPU).

    Supports the rope types ``default``, ``linear``, ``llama3`` and ``yarn``
    with the parameter names of HF ``rope_parameters``, and ``freq_factors``:
    the default frequencies each divided by its entry of ``freq_factors`` (one
    per rotated pair), how GGUF files store scaled rope (llama.cpp's
    ``rope_freqs`` tensor, e.g. Llama 3.1's ``llama3`` scaling).

    :param dim: the number of rotated channels (even).
    :param params: ``rope_theta``, ``rope_type`` and the type's parameters.
    :param max_position: the model's ``max_position_embeddings`` (yarn default factor).
    :return: ``(inv_freq [dim // 2], attention_factor)``; cos/sin are scaled by the factor.
    :raises ConfigError: for an unsupported rope type.
    """
    base = float(params.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "freq_factors":
        factors = torch.tensor([float(f) for f in params["freq_factors"]], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ConfigError(
                f"rope freq_factors has {factors.numel()} entries; the rotary embedding of "
                f"{dim} channels needs {inv_freq.numel()}"
            )
        return inv_freq / factors, 1.0
    if rope_type == "llama3":
        factor = float(params["factor"])
        low = float(params["low_freq_factor"])
        high = float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        original = float(params["original_max_position_embeddings"])
        factor = params.get("factor") or max_position / original
        factor = float(factor)
        attention_factor = params.get("attention_factor")
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = yarn_mscale(factor)
        beta_fast = params.get("beta_fast") or 32
        beta_slow = params.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
        extrapolation = 1 - ramp
        inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
        return inv_freq, float(attention_factor)
    raise ConfigError(
        f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3, yarn, "
        "freq_factors"
    )


#: ``(cos, sin)`` of a forward's positions, each ``[T, 1, rotary_dim // 2]``
#: (see :meth:`RotaryEmbedding.cos_sin`)
RopeCosSin = tuple[torch.Tensor, torch.Tensor]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding applied to ``[T, heads, head_dim]`` tensors.

    Rotates the first ``rotary_dim`` channels (partial rotary when smaller
    than the head dim) and passes the rest through. ``cos``/``sin`` of every
    position below ``max_position`` are tabulated once (:attr:`cos_sin_cache`,
    in the model dtype); a forward gathers its positions' rows once with
    :meth:`cos_sin` and every layer rotates with them.

    :param rotary_dim: rotated channels per head.
    :param params: HF ``rope_parameters`` (see :func:`rope_inv_freq`).
    :param max_position: ``max_position_embeddings``: positions run below it.
    :param interleaved: channel pairs are ``(2i, 2i+1)`` (DeepSeek
        ``rope_interleave``) instead of ``(i, i + rotary_dim/2)``; the result is
        written de-interleaved, as HF does, which keeps ``q . k`` unchanged.
    """

    #: ``"torch"`` or ``"triton"``: who runs the rotation (:mod:`backplane.models.fused`)
    fused_ops: str = "torch"

    def __init__(
        self,
        rotary_dim: int,
        params: dict[str, Any],
        max_position: int,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.params = dict(params)
        self.max_position = max_position
        self.interleaved = interleaved
        self.register_buffer(
            "inv_freq", torch.empty(rotary_dim // 2, dtype=torch.float32), persistent=False
        )
        # [position, cos (rotary_dim / 2) | sin (rotary_dim / 2)], in the default
        # (model) dtype: the rotation multiplies in the activations' dtype.
        self.register_buffer(
            "cos_sin_cache", torch.empty(max_position, rotary_dim), persistent=False
        )
        self.attention_factor = 1.0
        if not self.inv_freq.is_meta:
            self.reset_buffers_()

    def reset_buffers_(self) -> None:
        """(Re)compute ``inv_freq`` and the cos/sin table (after materialising on a device)."""
        inv_freq, self.attention_factor = rope_inv_freq(
            self.rotary_dim, self.params, self.max_position
        )
        # The same float32 products the per-step computation would form, then
        # the attention factor, then one cast to the table dtype.
        freqs = torch.arange(self.max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * self.attention_factor
        with torch.no_grad():
            self.inv_freq.copy_(inv_freq.to(self.inv_freq.device, torch.float32))
            self.cos_sin_cache.copy_(table.to(self.cos_sin_cache.device))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype | None = None) -> RopeCosSin:
        """Gather ``cos``/``sin`` of ``positions`` from the table (once per forward).

        :param positions: ``[T]`` integer positions, each below ``max_position``.
        :param dtype: the activations' dtype (default: the table's).
        :return: ``(cos, sin)``, each ``[T, 1, rotary_dim // 2]``.
        """
        cs = self.cos_sin_cache.index_select(0, positions)
        if dtype is not None and cs.dtype != dtype:
            cs = cs.to(dtype)
        cos, sin = cs.unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    def rotate_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, H, D]`` in place with ``cos``/``sin`` from :meth:`cos_sin`.

        :return: ``x``.
        :raises ValueError: for an ``interleaved`` embedding, whose output layout
            differs from its input's (use :meth:`rotate`).
        """
        if self.interleaved:
            raise ValueError("an interleaved rotary embedding cannot rotate in place; use rotate()")
        return apply_rotary_(x, cos, sin, fused_ops=self.fused_ops)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Return ``x`` ``[T, H, D]`` rotated with ``cos``/``sin`` from :meth:`cos_sin`."""
        if self.interleaved:
            return apply_rotary_interleaved(x, cos, sin, fused_ops=self.fused_ops)
        return apply_rotary_(x.clone(), cos, sin, fused_ops=self.fused_ops)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]`` at ``positions`` ``[T]``."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)


def rope_parameters(cfg: Any) -> dict[str, Any]:
    """Return the rope parameters of a config in the HF 5.x ``rope_parameters`` form.

    Older configs carry ``rope_theta`` plus ``rope_scaling`` (and sometimes a
    top-level ``partial_rotary_factor``); both forms are accepted.
    """
    params = cfg.get("rope_parameters")
    if params:
        out = dict(params)
    else:
        out = dict(cfg.get("rope_scaling") or {})
        if "type" in out and "rope_type" not in out:
            out["rope_type"] = out.pop("type")
        out.setdefault("rope_type", "default")
    out.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "partial_rotary_factor" not in out and cfg.get("partial_rotary_factor") is not None:
        out["partial_rotary_factor"] = cfg.get("partial_rotary_factor")
    return out
