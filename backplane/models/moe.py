"""Mixture of experts.

* :func:`moe_experts` — the routed experts as one custom op,
  ``backplane_models::moe_experts``;
* :func:`group_limited_topk` — DeepSeek-V3 expert selection;
* :class:`MoE` — the block: router, stacked ``[num_experts, ...]`` expert
  weights (gate and up merged), optional shared experts.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from types import ModuleType

import torch
from torch import nn

from backplane.core.errors import ConfigError
from backplane.core.parallel import tensor_parallel
from backplane.kernels import load_moe_gemv, unavailable_reason
from backplane.models.linear import Linear, dense
from backplane.models.mlp import MLP, activation, gated_activation
from backplane.models.parallel import ParamShard, ShardSlice, head_shard

#: the most token-expert pairs (``T * k``) run by the gathered kernels of
#: :mod:`backplane.kernels.moe_gemv` on CUDA. They read each pair's expert
#: separately on CUDA cores; beyond a few dozen pairs the grouped path, one
#: tensor-core matmul per expert reading each expert once, costs less. Decode
#: and speculative verification of a few tokens (up to 16 at k = 4, 8 at
#: k = 8) stay within it, eagerly and in CUDA graphs alike.
FUSED_MAX_PAIRS = 64


@functools.cache
def _fused_kernels(device: torch.device) -> ModuleType | None:
    """The few-token expert kernels when they run on CUDA ``device``, else ``None``."""
    if unavailable_reason(device) is not None:
        return None
    try:
        return load_moe_gemv()
    except ImportError:
        return None


@torch.library.custom_op("backplane_models::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_in: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    gated: bool,
) -> torch.Tensor:
    """Run the routed experts of a mixture-of-experts block.

    Token-expert pairs are sorted by expert so that each expert runs one
    matmul over all its tokens; results are scaled by the routing weights and
    summed back per token with ``index_add_``. The per-expert loop needs the
    per-expert counts on the host; while a CUDA graph is being captured (where
    that sync is illegal) every expert runs densely over all tokens instead,
    weighted by a routing weight of zero for tokens not routed to it.

    On CUDA, up to :data:`FUSED_MAX_PAIRS` token-expert pairs run in the two
    launches of :func:`backplane.kernels.moe_gemv.moe_gemv` instead, eagerly
    and while capturing alike: they read only the routed experts' weights,
    without a host sync, and keep the inner activations in float32.

    :param x: ``[T, H]``.
    :param topk_ids: ``[T, k]`` expert ids.
    :param topk_weights: ``[T, k]`` routing weights (float32).
    :param w_in: ``[E, 2I, H]``, each expert's gate rows then its up rows, when
        ``gated``; else ``[E, I, H]``, the up projections.
    :param w_down: ``[E, H, I]``.
    :param act: activation name.
    :param gated: ``act(gate) * up`` (else ``act(up)``).
    :return: ``[T, H]`` in ``x.dtype``.
    """
    num_tokens, top_k = topk_ids.shape
    pairs = num_tokens * top_k
    if x.is_cuda and 0 < pairs <= FUSED_MAX_PAIRS:
        kernels = _fused_kernels(x.device)
        if (
            kernels is not None
            and kernels.supports(x, pairs, w_in, w_down, act)
            and topk_ids.dtype in kernels.ID_DTYPES
            and topk_weights.is_floating_point()
        ):
            return kernels.moe_gemv(x, topk_ids, topk_weights, w_in, w_down, act, gated)
    fn = gated_activation(act) if gated else activation(act)
    num_experts = w_in.shape[0]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out.to(x.dtype)

    def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
        return dense(fn(dense(xs, w_in[e])), w_down[e])

    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing:
        per_expert = torch.zeros(num_tokens, num_experts, dtype=torch.float32, device=x.device)
        per_expert.scatter_add_(1, topk_ids.long(), topk_weights.float())
        for e in range(num_experts):
            out += expert(e, x).float() * per_expert[:, e : e + 1]
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
def _moe_experts_fake(x, topk_ids, topk_weights, w_in, w_down, act, gated):
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

    Expert weights are stacked ``[E, out, in]`` parameters:
    ``experts_gate_up`` (``[E, 2I, in]``, gate rows then up rows; gated
    experts) or ``experts_up`` (non-gated), and ``experts_down``. Checkpoints
    store them per expert and per projection; :meth:`expert_slices` says which
    slice each checkpoint tensor fills.

    On a tensor-parallel rank every expert's inner channels are split (its
    gate/up rows and its down columns, like a dense MLP's); the router is
    replicated, so every rank picks the same experts, and the routed and
    shared experts' partial sums are all-reduced once, after they are added.

    :param shared_name: attribute name of the shared MLP (HF naming differs:
        ``shared_experts`` or ``shared_expert``).
    """

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
            self.fc1_latent_proj = Linear(hidden_size, latent_size, bias=bias)
            self.fc2_latent_proj = Linear(latent_size, hidden_size, bias=bias)
        self.gated = gated
        self.tp = tensor_parallel()
        inter = head_shard(self.tp, moe_intermediate_size, 1, "MoE expert channels")
        # The experts hold this rank's channels from here on.
        moe_intermediate_size = inter.size
        self.intermediate_size = moe_intermediate_size
        if self.tp.enabled:
            in_parts = (inter, inter) if gated else (inter,)
            self.tp_shards = {
                "experts_gate_up" if gated else "experts_up": ParamShard(1, in_parts),
                "experts_down": ParamShard(2, (inter,)),
            }
        if gated:
            self.experts_gate_up = nn.Parameter(
                torch.empty(num_experts, 2 * moe_intermediate_size, inner_dim)
            )
        else:
            self.experts_up = nn.Parameter(
                torch.empty(num_experts, moe_intermediate_size, inner_dim)
            )
        self.experts_down = nn.Parameter(torch.empty(num_experts, inner_dim, moe_intermediate_size))
        if self.shared_name:
            setattr(
                self,
                self.shared_name,
                # With a latent, the routed sum is reduced before fc2_latent_proj,
                # so the shared experts reduce their own.
                MLP(
                    hidden_size,
                    shared_intermediate_size,
                    act=act,
                    gated=gated,
                    bias=bias,
                    reduce=self.latent,
                ),
            )
        self.shared_gate = shared_gate and bool(self.shared_name)
        if self.shared_gate:
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    @property
    def experts_in(self) -> torch.Tensor:
        """The stacked input projections: ``experts_gate_up`` or ``experts_up``."""
        return self.experts_gate_up if self.gated else self.experts_up

    def expert_slices(self) -> Iterator[tuple[str, str, torch.Tensor, int]]:
        """Yield where each per-expert checkpoint tensor goes.

        :return: ``(checkpoint name relative to this module, stacked parameter
            name, stacked view [E, rows, in], expert index)``, e.g.
            ``("experts.3.up_proj.weight", "experts_gate_up",
            experts_gate_up[:, I:], 3)``.
        """
        inter = self.intermediate_size
        views: list[tuple[str, str, torch.Tensor]] = []
        if self.gated:
            views.append(("gate_proj", "experts_gate_up", self.experts_gate_up[:, :inter]))
            views.append(("up_proj", "experts_gate_up", self.experts_gate_up[:, inter:]))
        else:
            views.append(("up_proj", "experts_up", self.experts_up))
        views.append(("down_proj", "experts_down", self.experts_down))
        for e in range(self.experts_down.shape[0]):
            for proj, stacked_name, view in views:
                yield f"experts.{e}.{proj}.weight", stacked_name, view, e

    def expert_shards(self) -> dict[str, ShardSlice]:
        """Say which slice of each per-expert checkpoint tensor this rank holds.

        :return: ``{checkpoint name relative to this module: slice}`` (names as
            :meth:`expert_slices` yields them; empty with one rank).
        """
        if not self.tp.enabled:
            return {}
        part = self.tp_shards["experts_down"].parts[0]
        # A checkpoint tensor is one expert's: the stacked dimension is gone.
        dims = {"gate_proj": 0, "up_proj": 0, "down_proj": 1}
        return {
            name: ShardSlice(dims[name.split(".")[2]], part)
            for name, _, _, _ in self.expert_slices()
        }

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(topk_ids [T, k], topk_weights [T, k] float32)`` for ``x`` ``[T, H]``."""
        logits = dense(x.float(), self.gate.weight.float())
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
            h, ids, weights, self.experts_in, self.experts_down, self.act_name, self.gated
        )
        if self.latent:
            routed = self.fc2_latent_proj(self.tp.all_reduce(routed))
        if self.shared_name is None:
            return routed if self.latent else self.tp.all_reduce(routed)
        shared = getattr(self, self.shared_name)(x)
        if self.shared_gate:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        out = routed + shared
        return out if self.latent else self.tp.all_reduce(out)
