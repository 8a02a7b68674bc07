"""Model building blocks against naive references: MoE experts and routing, rotary, norms."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from backplane.models.moe import group_limited_topk, moe_experts
from backplane.models.norm import GatedRMSNorm
from backplane.models.rotary import RotaryEmbedding


def _naive_experts(x, ids, weights, w_gate, w_up, w_down, act):
    """One token, one expert at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            xt = x[t].double()
            h = w_up[e].double() @ xt
            if w_gate is not None:
                h = act(w_gate[e].double() @ xt) * h
            else:
                h = act(h)
            out[t] += float(weights[t, j]) * (w_down[e].double() @ h)
    return out


@pytest.mark.parametrize("gated", [True, False])
def test_moe_experts_match_a_per_token_loop(gated):
    g = torch.Generator().manual_seed(0)
    num_tokens, hidden, inter, experts, k = 13, 8, 6, 5, 2
    x = torch.randn(num_tokens, hidden, generator=g)
    # Expert 4 receives no token: the grouped loop must skip it cleanly.
    ids = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, k, generator=g)
    w_gate = torch.randn(experts, inter, hidden, generator=g) if gated else None
    w_up = torch.randn(experts, inter, hidden, generator=g)
    w_down = torch.randn(experts, hidden, inter, generator=g)
    act = "silu" if gated else "relu2"
    # The op takes each expert's gate rows stacked on its up rows.
    w_in = torch.cat([w_gate, w_up], dim=1) if gated else w_up
    got = moe_experts(x, ids, weights, w_in, w_down, act, gated)
    ref_act = F.silu if gated else (lambda t: F.relu(t) ** 2)
    want = _naive_experts(x, ids, weights, w_gate, w_up, w_down, ref_act)
    assert got.dtype == x.dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_moe_experts_opcheck():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, generator=g)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]])
    weights = torch.rand(4, 2, generator=g)
    w_in = torch.randn(3, 12, 8, generator=g)
    w_down = torch.randn(3, 8, 6, generator=g)
    torch.library.opcheck(moe_experts, (x, ids, weights, w_in, w_down, "silu", True))


def test_group_limited_topk_matches_brute_force():
    g = torch.Generator().manual_seed(2)
    tokens, experts, n_group, topk_group, top_k = 20, 12, 4, 2, 3
    scores = torch.rand(tokens, experts, generator=g)
    bias = torch.rand(experts, generator=g) * 0.1
    got = group_limited_topk(scores, bias, top_k, n_group, topk_group)
    size = experts // n_group
    for t in range(tokens):
        s = (scores[t] + bias).tolist()
        group_score = [sum(sorted(s[i * size : (i + 1) * size])[-2:]) for i in range(n_group)]
        best_groups = sorted(range(n_group), key=lambda i: -group_score[i])[:topk_group]
        allowed = [e for e in range(experts) if e // size in best_groups]
        want = sorted(sorted(allowed, key=lambda e: -s[e])[:top_k])
        assert sorted(got[t].tolist()) == want


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_rotates_pairs_and_keeps_the_rest(interleaved):
    dim, rot = 8, 4
    rope = RotaryEmbedding(rot, {"rope_type": "default", "rope_theta": 100.0}, 64, interleaved)
    rope.reset_buffers_()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 2, dim, generator=g)
    k = torch.randn(5, 1, dim, generator=g)
    pos = torch.tensor([0, 1, 7, 30, 2])
    rq, rk = rope(pos, q, k)
    inv = 1.0 / (100.0 ** (torch.arange(0, rot, 2).double() / rot))
    pairs = (
        [(2 * i, 2 * i + 1) for i in range(rot // 2)]
        if interleaved
        else [(i, i + rot // 2) for i in range(rot // 2)]
    )
    for t, i in itertools.product(range(5), range(rot // 2)):
        a, b = pairs[i]
        ang = float(pos[t]) * inv[i]
        c, s = torch.cos(ang), torch.sin(ang)
        # Output layout: first half = rotated "x1", second half = rotated "x2".
        want1 = q[t, :, a].double() * c - q[t, :, b].double() * s
        want2 = q[t, :, b].double() * c + q[t, :, a].double() * s
        torch.testing.assert_close(rq[t, :, i].double(), want1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rq[t, :, i + rot // 2].double(), want2, rtol=1e-5, atol=1e-6)
    assert torch.equal(rq[..., rot:], q[..., rot:])
    assert torch.equal(rk[..., rot:], k[..., rot:])
    # Relative position property: q.k depends only on the position difference.
    q1, k1 = rope(torch.tensor([3]), q[:1], k[:1])
    q2, k2 = rope(torch.tensor([10]), q[:1], k[:1])
    d1 = (q1[0, 0, :rot] * k1[0, 0, :rot]).sum()
    d2 = (q2[0, 0, :rot] * k2[0, 0, :rot]).sum()
    torch.testing.assert_close(d1, d2, rtol=1e-4, atol=1e-5)


def test_grouped_gated_norm_normalises_each_group_after_gating():
    g = torch.Generator().manual_seed(4)
    norm = GatedRMSNorm(8, eps=1e-6, group_size=4, norm_before_gate=False)
    norm.weight.data = torch.randn(8, generator=g)
    x, z = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    h = x.double() * F.silu(z.double())
    groups = h.view(3, 2, 4)
    want = (groups / torch.sqrt(groups.pow(2).mean(-1, keepdim=True) + 1e-6)).view(3, 8)
    want = want * norm.weight.double()
    torch.testing.assert_close(norm(x, z).double(), want, rtol=1e-5, atol=1e-6)
