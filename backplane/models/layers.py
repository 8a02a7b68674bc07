"""Building blocks shared by the model implementations.

Everything here works on the flat, ragged token layout of a backplane step:
activations are ``[T, ...]`` with ``T`` the padded token count, and the batch
(sequence boundaries, page tables, state slots) reaches the cached ops through
:mod:`backplane.core.forward_context`. The mixers below own a layer's
projections and call one op family each for the part that needs the cache:

* :class:`AttentionMixer` -> ``attention`` (Llama, Qwen3, Nemotron-H, and the
  output-gated attention of Qwen3-Next / Qwen3.5);
* :class:`MLAMixer` -> ``mla`` (DeepSeek-V3);
* :class:`Mamba2Mixer` -> ``ssm`` (``conv`` and ``scan``; Nemotron-H);
* :class:`GatedDeltaNetMixer` -> ``ssm`` (``conv``) and ``delta`` (Qwen3-Next, Qwen3.5).

Weight names follow the Hugging Face checkpoints so that loading is a name
lookup; where a checkpoint stores one tensor per expert, :class:`MoE` keeps
stacked ``[num_experts, ...]`` parameters and :meth:`MoE.expert_weight_name`
tells the loader where each expert's slice goes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backplane.core.errors import ConfigError
from backplane.core.families import (
    AttentionLayerSpec,
    ConvLayerSpec,
    DeltaLayerSpec,
    MLALayerSpec,
    SSMLayerSpec,
)
from backplane.core.layouts import TensorSpec

# -- activations ---------------------------------------------------------------


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "relu2": _relu2,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return the activation function called ``name`` in HF configs.

    :raises ConfigError: for an unknown name, listing the supported ones.
    """
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ConfigError(
            f"unsupported activation {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}"
        ) from None


# -- normalisation -------------------------------------------------------------


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
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (xf * (1.0 + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)

    def reset_parameters_(self, generator: torch.Generator | None = None) -> None:
        """Set the weight to the identity scale."""
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered else 1.0)


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

    def reset_parameters_(self, generator: torch.Generator | None = None) -> None:
        """Set the weight to ones."""
        with torch.no_grad():
            self.weight.fill_(1.0)


# -- rotary embeddings ---------------------------------------------------------


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(
    dim: int, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """Compute the inverse frequencies of a rotary embedding (float32, CPU).

    Supports the rope types ``default``, ``linear``, ``llama3`` and ``yarn``
    with the parameter names of HF ``rope_parameters``.

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
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(
                    factor, mscale_all_dim
                )
            else:
                attention_factor = _yarn_mscale(factor)
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
        f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3, yarn"
    )


class RotaryEmbedding(nn.Module):
    """Rotary position embedding applied to ``[T, heads, head_dim]`` tensors.

    Rotates the first ``rotary_dim`` channels (partial rotary when smaller
    than the head dim) and passes the rest through.

    :param rotary_dim: rotated channels per head.
    :param params: HF ``rope_parameters`` (see :func:`rope_inv_freq`).
    :param max_position: ``max_position_embeddings``.
    :param interleaved: channel pairs are ``(2i, 2i+1)`` (DeepSeek
        ``rope_interleave``) instead of ``(i, i + rotary_dim/2)``; the result is
        written de-interleaved, as HF does, which keeps ``q . k`` unchanged.
    """

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
        self.attention_factor = 1.0

    def reset_buffers_(self) -> None:
        """(Re)compute ``inv_freq`` (after the module was materialised on a device)."""
        inv_freq, self.attention_factor = rope_inv_freq(
            self.rotary_dim, self.params, self.max_position
        )
        with torch.no_grad():
            self.inv_freq.copy_(inv_freq.to(self.inv_freq.device, torch.float32))

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``cos``/``sin`` of shape ``[T, 1, rotary_dim // 2]`` in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        cos = (freqs.cos() * self.attention_factor).to(dtype)
        sin = (freqs.sin() * self.attention_factor).to(dtype)
        return cos[:, None, :], sin[:, None, :]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Apply the rotation to ``x`` ``[T, H, D]`` with precomputed ``cos``/``sin``."""
        r = self.rotary_dim
        rot, rest = x[..., :r], x[..., r:]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        else:
            x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        if rest.shape[-1] == 0:
            return out
        return torch.cat([out, rest], dim=-1)

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


# -- feed-forward --------------------------------------------------------------


class MLP(nn.Module):
    """Feed-forward block: ``down(act(gate(x)) * up(x))``, or ``down(act(up(x)))`` when not gated.

    :param hidden_size: model width.
    :param intermediate_size: inner width.
    :param act: activation name (``silu``, ``relu2``, ...).
    :param gated: has a ``gate_proj`` (Llama style); ``False`` for Nemotron-H.
    :param bias: the projections have biases.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str = "silu",
        gated: bool = True,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.gated = gated
        self.act = activation(act)
        if gated:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` ``[T, hidden]``."""
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act(self.up_proj(x)))


# -- mixture of experts --------------------------------------------------------


@torch.library.custom_op("backplane_models::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
) -> torch.Tensor:
    """Run the routed experts of a mixture-of-experts block.

    Token-expert pairs are sorted by expert so that each expert runs one
    matmul over all its tokens; results are scaled by the routing weights and
    summed back per token with ``index_add_``. The per-expert loop needs the
    per-expert counts on the host; while a CUDA graph is being captured (where
    that sync is illegal) every expert runs densely over all tokens instead,
    weighted by a routing weight of zero for tokens not routed to it.

    :param x: ``[T, H]``.
    :param topk_ids: ``[T, k]`` expert ids.
    :param topk_weights: ``[T, k]`` routing weights (float32).
    :param w_gate: ``[E, I, H]`` or ``None`` for non-gated experts.
    :param w_up: ``[E, I, H]``.
    :param w_down: ``[E, H, I]``.
    :param act: activation name.
    :return: ``[T, H]`` in ``x.dtype``.
    """
    fn = activation(act)
    num_experts = w_up.shape[0]
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out.to(x.dtype)

    def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
        h = F.linear(xs, w_up[e])
        h = fn(F.linear(xs, w_gate[e])) * h if w_gate is not None else fn(h)
        return F.linear(h, w_down[e])

    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing:
        dense = torch.zeros(num_tokens, num_experts, dtype=torch.float32, device=x.device)
        dense.scatter_add_(1, topk_ids.long(), topk_weights.float())
        for e in range(num_experts):
            out += expert(e, x).float() * dense[:, e : e + 1]
        return out.to(x.dtype)

    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    weights = topk_weights.reshape(-1)[order].float()
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    xs_sorted = x[token_of]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sl = slice(start, start + n)
        y = expert(e, xs_sorted[sl]).float() * weights[sl, None]
        out.index_add_(0, token_of[sl], y)
        start += n
    return out.to(x.dtype)


@moe_experts.register_fake
def _moe_experts_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, act):
    return torch.empty_like(x)


def group_limited_topk(
    scores: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
) -> torch.Tensor:
    """DeepSeek-V3 expert selection: pick ``topk_group`` groups, then ``top_k`` experts in them.

    Groups are ranked by the sum of their two best bias-corrected scores.

    :param scores: ``[T, E]`` sigmoid scores (float32).
    :param correction_bias: ``[E]`` added for selection only, or ``None``.
    :return: ``[T, top_k]`` expert ids.
    """
    choice = scores if correction_bias is None else scores + correction_bias.float()
    num_tokens, num_experts = choice.shape
    if n_group > 1:
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(mask == 0, float("-inf"))
    return torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]


class MoE(nn.Module):
    """A mixture-of-experts block with optional shared experts.

    Routing, per ``router``:

    * ``"sigmoid_grouped"`` (DeepSeek-V3, Nemotron-H): sigmoid scores,
      group-limited top-k selected with ``e_score_correction_bias``, weights
      are the uncorrected scores, optionally renormalised, times
      ``routed_scaling_factor``;
    * ``"softmax"`` (Qwen3-Next): softmax scores, plain top-k, optionally
      renormalised.

    Shared experts are added unweighted, or weighted by
    ``sigmoid(shared_expert_gate(x))`` when ``shared_gate`` is set (Qwen3-Next).

    Expert weights are stacked ``[E, out, in]`` parameters ``experts_gate`` /
    ``experts_up`` / ``experts_down``; checkpoints store them per expert,
    which :meth:`expert_weight_name` maps.

    :param prefix_shared: attribute name of the shared MLP (HF naming differs:
        ``shared_experts`` or ``shared_expert``).
    """

    _EXPERT_RE = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        moe_intermediate_size: int,
        *,
        act: str = "silu",
        gated: bool = True,
        router: str = "sigmoid_grouped",
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        n_group: int = 1,
        topk_group: int = 1,
        shared_intermediate_size: int = 0,
        shared_name: str = "shared_experts",
        shared_gate: bool = False,
        latent_size: int | None = None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.act_name = act
        self.router = router
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.n_group = n_group
        self.topk_group = topk_group
        self.shared_name = shared_name if shared_intermediate_size else None
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if router == "sigmoid_grouped":
            # Kept in float32 whatever the model dtype: it decides expert selection.
            self.gate.register_buffer(
                "e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32)
            )
        elif router != "softmax":
            raise ConfigError(f"unknown MoE router {router!r}")
        inner_dim = latent_size or hidden_size
        self.latent = latent_size is not None
        if self.latent:
            self.fc1_latent_proj = nn.Linear(hidden_size, latent_size, bias=bias)
            self.fc2_latent_proj = nn.Linear(latent_size, hidden_size, bias=bias)
        self.experts_gate = (
            nn.Parameter(torch.empty(num_experts, moe_intermediate_size, inner_dim))
            if gated
            else None
        )
        self.experts_up = nn.Parameter(torch.empty(num_experts, moe_intermediate_size, inner_dim))
        self.experts_down = nn.Parameter(torch.empty(num_experts, inner_dim, moe_intermediate_size))
        if self.shared_name:
            setattr(
                self,
                self.shared_name,
                MLP(hidden_size, shared_intermediate_size, act=act, gated=gated, bias=bias),
            )
        self.shared_gate = shared_gate and bool(self.shared_name)
        if self.shared_gate:
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def expert_weight_name(self, name: str) -> tuple[str, int] | None:
        """Map a per-expert checkpoint name (relative to this module) to ``(param, expert)``."""
        m = self._EXPERT_RE.match(name)
        if m is None:
            return None
        param = {"gate_proj": "experts_gate", "up_proj": "experts_up", "down_proj": "experts_down"}
        return param[m.group(2)], int(m.group(1))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(topk_ids [T, k], topk_weights [T, k] float32)`` for ``x`` ``[T, H]``."""
        logits = F.linear(x.float(), self.gate.weight.float())
        if self.router == "softmax":
            probs = torch.softmax(logits, dim=-1)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return ids, weights
        scores = logits.sigmoid()
        ids = group_limited_topk(
            scores, self.gate.e_score_correction_bias, self.top_k, self.n_group, self.topk_group
        )
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` ``[T, hidden]``."""
        ids, weights = self.route(x)
        h = self.fc1_latent_proj(x) if self.latent else x
        routed = moe_experts(
            h, ids, weights, self.experts_gate, self.experts_up, self.experts_down, self.act_name
        )
        if self.latent:
            routed = self.fc2_latent_proj(routed)
        if self.shared_name is None:
            return routed
        shared = getattr(self, self.shared_name)(x)
        if self.shared_gate:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return routed + shared


# -- cached mixers -------------------------------------------------------------


class CachedMixer(nn.Module):
    """A mixer that owns per-layer cache tensors handed to an op family.

    Subclasses set ``families`` and implement :meth:`cache_specs`; the model
    binds the allocated tensors with :meth:`bind_caches`.
    """

    families: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.caches: dict[str, torch.Tensor] = {}

    def cache_specs(
        self, *, num_pages: int, page_size: int, num_slots: int, dtype: torch.dtype
    ) -> dict[str, TensorSpec]:
        """Return this layer's cache tensors ``{name: spec}``."""
        raise NotImplementedError

    def bind_caches(self, caches: dict[str, torch.Tensor]) -> None:
        """Use ``caches`` (allocated from :meth:`cache_specs`) from now on."""
        self.caches = dict(caches)

    def cache(self, name: str) -> torch.Tensor:
        """Return the bound cache ``name``.

        :raises RuntimeError: when caches were never bound.
        """
        try:
            return self.caches[name]
        except KeyError:
            raise RuntimeError(
                f"cache {name!r} of {type(self).__name__} is not bound; call "
                "model.bind_caches(...) with tensors allocated from model.cache_specs(...)"
            ) from None


class AttentionMixer(CachedMixer):
    """Multi-head attention with GQA, optional q/k norm, RoPE and output gate.

    :param layer_id: index of the layer (passed to the backend).
    :param backend: the ``attention`` backend.
    :param qk_norm: ``None``, ``"rms"`` (Qwen3) or ``"rms_zero_centered"`` (Qwen3-Next).
    :param rotary: the rotary embedding, or ``None`` (Nemotron-H has none).
    :param output_gate: ``q_proj`` also produces a per-channel gate and the
        output is multiplied by ``sigmoid(gate)`` (Qwen3-Next, Qwen3.5).
    """

    families = ("attention",)

    def __init__(
        self,
        layer_id: int,
        backend: Any,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool = False,
        o_bias: bool | None = None,
        qk_norm: str | None = None,
        norm_eps: float = 1e-6,
        rotary: RotaryEmbedding | None = None,
        output_gate: bool = False,
        sliding_window: int = 0,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate = output_gate
        self.spec = AttentionLayerSpec(
            layer_id=layer_id,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            sliding_window=sliding_window or 0,
        )
        q_out = num_heads * head_dim * (2 if output_gate else 1)
        self.q_proj = nn.Linear(hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(
            num_heads * head_dim, hidden_size, bias=bias if o_bias is None else o_bias
        )
        self.qk_norm = qk_norm
        if qk_norm:
            zc = qk_norm == "rms_zero_centered"
            self.q_norm = RMSNorm(head_dim, norm_eps, zero_centered=zc)
            self.k_norm = RMSNorm(head_dim, norm_eps, zero_centered=zc)
        # Not a registered submodule: several layers share one rotary embedding.
        self.__dict__["rotary"] = rotary

    def cache_specs(self, *, num_pages, page_size, num_slots, dtype):
        """The backend's paged KV cache for this layer."""
        return self.backend.cache_spec(
            self.spec, num_pages=num_pages, page_size=page_size, dtype=dtype
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` ``[T, hidden]`` at ``positions`` ``[T]``."""
        t = x.shape[0]
        q = self.q_proj(x)
        if self.output_gate:
            q, gate = q.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(t, self.num_heads * self.head_dim)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        o = self.backend.forward(
            q.contiguous(), k.contiguous(), v.contiguous(), self.cache("kv_cache"), self.spec
        )
        o = o.reshape(t, self.num_heads * self.head_dim)
        if self.output_gate:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)


class MLAMixer(CachedMixer):
    """DeepSeek multi-head latent attention.

    The query comes from ``q_proj`` or the low-rank ``q_a_proj -> q_a_layernorm
    -> q_b_proj``; ``kv_a_proj_with_mqa`` produces the latent and the shared
    rotary key; ``kv_b_proj`` holds the per-head up-projections the backend
    applies (``w_uk``, ``w_uv``), prepared once after loading by
    :meth:`finalize_weights`.
    """

    families = ("mla",)

    def __init__(
        self,
        layer_id: int,
        backend: Any,
        hidden_size: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        rotary: RotaryEmbedding,
        bias: bool = False,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads = num_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps)
        self.kv_b_proj = nn.Linear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)
        self.spec = MLALayerSpec(
            layer_id=layer_id,
            num_heads=num_heads,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            scale=scale,
        )
        self.register_buffer(
            "w_uk", torch.empty(num_heads, qk_nope_head_dim, kv_lora_rank), persistent=False
        )
        self.register_buffer(
            "w_uv", torch.empty(num_heads, v_head_dim, kv_lora_rank), persistent=False
        )
        self.__dict__["rotary"] = rotary

    def finalize_weights(self) -> None:
        """Split ``kv_b_proj`` into the contiguous per-head ``w_uk`` / ``w_uv`` the backend takes."""
        w = self.kv_b_proj.weight.detach().view(
            self.num_heads, self.nope + self.v_dim, self.kv_lora_rank
        )
        with torch.no_grad():
            self.w_uk.copy_(w[:, : self.nope])
            self.w_uv.copy_(w[:, self.nope :])

    def cache_specs(self, *, num_pages, page_size, num_slots, dtype):
        """The backend's latent cache for this layer."""
        return self.backend.cache_spec(
            self.spec, num_pages=num_pages, page_size=page_size, dtype=dtype
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` ``[T, hidden]`` at ``positions`` ``[T]``."""
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        kv = self.kv_a_proj_with_mqa(x)
        kv_c, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.reshape(t, 1, self.rope_dim))
        o = self.backend.forward(
            q_nope.contiguous(),
            q_pe.contiguous(),
            kv_c.contiguous(),
            k_pe.reshape(t, self.rope_dim).contiguous(),
            self.cache("latent_cache"),
            self.w_uk,
            self.w_uv,
            self.spec,
        )
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))


class Mamba2Mixer(CachedMixer):
    """Mamba2 mixer (Nemotron-H): in_proj -> causal conv -> selective scan -> gated norm -> out_proj.

    Uses the ``ssm`` family's ``conv`` and ``scan``.
    """

    families = ("ssm",)

    def __init__(
        self,
        layer_id: int,
        backend: Any,
        hidden_size: int,
        *,
        num_heads: int,
        head_dim: int,
        d_state: int,
        n_groups: int,
        conv_kernel: int,
        conv_bias: bool = True,
        proj_bias: bool = False,
        norm_eps: float = 1e-5,
        chunk_size: int = 256,
        act: str = "silu",
    ) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads, self.head_dim, self.d_state, self.n_groups = (
            num_heads,
            head_dim,
            d_state,
            n_groups,
        )
        self.inner = num_heads * head_dim
        self.conv_dim = self.inner + 2 * n_groups * d_state
        if act not in ("silu", "swish"):
            raise ConfigError(f"Mamba2 conv activation {act!r} is not supported (only silu)")
        self.in_proj = nn.Linear(
            hidden_size, self.inner + self.conv_dim + num_heads, bias=proj_bias
        )
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel))
        self.conv1d.bias = nn.Parameter(torch.empty(self.conv_dim)) if conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.D = nn.Parameter(torch.empty(num_heads))
        self.norm = GatedRMSNorm(
            self.inner, norm_eps, group_size=self.inner // n_groups, norm_before_gate=False
        )
        self.out_proj = nn.Linear(self.inner, hidden_size, bias=proj_bias)
        self.conv_spec = ConvLayerSpec(
            layer_id=layer_id, conv_dim=self.conv_dim, kernel_size=conv_kernel, activation="silu"
        )
        self.ssm_spec = SSMLayerSpec(
            layer_id=layer_id,
            nheads=num_heads,
            head_dim=head_dim,
            d_state=d_state,
            n_groups=n_groups,
            dt_softplus=True,
            chunk_size=chunk_size,
        )

    def cache_specs(self, *, num_pages, page_size, num_slots, dtype):
        """Conv state and SSM state from the ``ssm`` backend."""
        specs = dict(self.backend.conv_cache_spec(self.conv_spec, num_slots=num_slots, dtype=dtype))
        specs.update(self.backend.cache_spec(self.ssm_spec, num_slots=num_slots, dtype=dtype))
        return specs

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Mix ``x`` ``[T, hidden]``."""
        t = x.shape[0]
        proj = self.in_proj(x)
        gate, xbc, dt = proj.split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        xbc = self.backend.conv(
            xbc.contiguous(),
            self.conv1d.weight.view(self.conv_dim, -1),
            self.conv1d.bias,
            self.cache("conv_state"),
            self.conv_spec,
        )
        gs = self.n_groups * self.d_state
        xs, B, C = xbc.split([self.inner, gs, gs], dim=-1)
        y = self.backend.scan(
            xs.reshape(t, self.num_heads, self.head_dim).contiguous(),
            dt.contiguous(),
            -torch.exp(self.A_log.float()),
            B.reshape(t, self.n_groups, self.d_state).contiguous(),
            C.reshape(t, self.n_groups, self.d_state).contiguous(),
            self.D,
            self.dt_bias,
            None,
            self.cache("ssm_state"),
            self.ssm_spec,
        )
        y = self.norm(y.reshape(t, self.inner), gate)
        return self.out_proj(y.to(x.dtype))


class GatedDeltaNetMixer(CachedMixer):
    """Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5).

    Projections -> causal conv over ``[q, k, v]`` (``ssm`` family ``conv``) ->
    gated delta rule (``delta`` family) -> gated RMS norm with ``z`` -> out_proj.

    :param fused_qkvz: Qwen3-Next layout: one ``in_proj_qkvz`` and one
        ``in_proj_ba`` whose outputs are grouped per key head; ``False`` is the
        Qwen3.5 layout (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).
    """

    families = ("ssm", "delta")

    def __init__(
        self,
        layer_id: int,
        conv_backend: Any,
        delta_backend: Any,
        hidden_size: int,
        *,
        num_k_heads: int,
        num_v_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        conv_kernel: int,
        fused_qkvz: bool,
        norm_eps: float = 1e-6,
        act: str = "silu",
    ) -> None:
        super().__init__()
        self.conv_backend, self.delta_backend = conv_backend, delta_backend
        self.nk, self.nv, self.dk, self.dv = num_k_heads, num_v_heads, k_head_dim, v_head_dim
        self.key_dim, self.value_dim = num_k_heads * k_head_dim, num_v_heads * v_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.fused_qkvz = fused_qkvz
        if act not in ("silu", "swish"):
            raise ConfigError(
                f"gated delta net conv activation {act!r} is not supported (only silu)"
            )
        if fused_qkvz:
            self.in_proj_qkvz = nn.Linear(
                hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False
            )
            self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel))
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads))
        self.norm = GatedRMSNorm(v_head_dim, norm_eps, norm_before_gate=True)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.conv_spec = ConvLayerSpec(
            layer_id=layer_id, conv_dim=self.conv_dim, kernel_size=conv_kernel, activation="silu"
        )
        self.delta_spec = DeltaLayerSpec(
            layer_id=layer_id,
            num_k_heads=num_k_heads,
            num_v_heads=num_v_heads,
            k_head_dim=k_head_dim,
            v_head_dim=v_head_dim,
            use_qk_l2norm=True,
        )

    def cache_specs(self, *, num_pages, page_size, num_slots, dtype):
        """Conv state from the ``ssm`` backend and recurrent state from the ``delta`` backend."""
        specs = dict(
            self.conv_backend.conv_cache_spec(self.conv_spec, num_slots=num_slots, dtype=dtype)
        )
        specs.update(
            self.delta_backend.cache_spec(self.delta_spec, num_slots=num_slots, dtype=dtype)
        )
        return specs

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = x.shape[0]
        if not self.fused_qkvz:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        # Qwen3-Next groups the projections per key head: [q, k, v-group, z-group] per head.
        r = self.nv // self.nk
        qkvz = self.in_proj_qkvz(x).view(t, self.nk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        ba = self.in_proj_ba(x).view(t, self.nk, 2 * r)
        b, a = ba.split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, -1), b.reshape(t, self.nv), a.reshape(t, self.nv)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Mix ``x`` ``[T, hidden]``."""
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        mixed = self.conv_backend.conv(
            mixed.contiguous(),
            self.conv1d.weight.view(self.conv_dim, -1),
            None,
            self.cache("conv_state"),
            self.conv_spec,
        )
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = torch.sigmoid(b.float())
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        o = self.delta_backend.forward(
            q.reshape(t, self.nk, self.dk).contiguous(),
            k.reshape(t, self.nk, self.dk).contiguous(),
            v.reshape(t, self.nv, self.dv).contiguous(),
            g.contiguous(),
            beta.contiguous(),
            self.cache("delta_state"),
            self.delta_spec,
        )
        o = self.norm(o.reshape(t, self.nv, self.dv), z.reshape(t, self.nv, self.dv))
        return self.out_proj(o.reshape(t, self.value_dim).to(x.dtype))
