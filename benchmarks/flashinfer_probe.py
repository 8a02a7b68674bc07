"""Probe what the installed FlashInfer kernels accept and how they read their inputs.

Prints one line per probe (GPU only); used to set the shape limits of the
FlashInfer backends (``supports``) and to check input conventions against a
float64 reference:

* ``gdn``: ``chunk_gated_delta_rule`` forget gate as ``exp(g)`` vs ``g`` (sm90 only);
* ``ssu``: ``selective_state_update`` head_dim / d_state combinations;
* ``mla``: ``BatchMLAPagedAttentionWrapper`` head counts.

Run: ``python benchmarks/flashinfer_probe.py [gdn] [ssu] [mla]``.
"""

from __future__ import annotations

import sys
import time
import traceback

import torch
import torch.nn.functional as F


def _line(name: str, fn) -> None:
    t0 = time.time()
    try:
        res = fn()
        print(f"{name}: ok {res} ({time.time() - t0:.1f}s)", flush=True)
    except Exception as exc:
        msg = str(exc).strip().splitlines()
        print(
            f"{name}: FAILED {type(exc).__name__}: {msg[0] if msg else ''} ({time.time() - t0:.1f}s)",
            flush=True,
        )
        traceback.print_exc(limit=2, file=sys.stdout)


def probe_gdn() -> None:
    """Which forget-gate convention matches the float64 delta rule."""
    from flashinfer import chunk_gated_delta_rule

    torch.manual_seed(0)
    T, H, D = 20, 2, 128
    q = F.normalize(torch.randn(T, H, D), dim=-1)
    k = F.normalize(torch.randn(T, H, D), dim=-1)
    v = torch.randn(T, H, D)
    g = -torch.rand(T, H) * 0.5
    beta = torch.rand(T, H)
    s = torch.zeros(H, D, D, dtype=torch.float64)
    ref = torch.zeros(T, H, D, dtype=torch.float64)
    for t in range(T):
        s = s * torch.exp(g[t].double())[:, None, None]
        kv = torch.einsum("hk,hkv->hv", k[t].double(), s)
        s = s + torch.einsum(
            "hk,hv->hkv", k[t].double(), (v[t].double() - kv) * beta[t].double()[:, None]
        )
        ref[t] = torch.einsum("hk,hkv->hv", q[t].double() * D**-0.5, s)
    cu = torch.tensor([0, T], dtype=torch.int64, device="cuda")
    dev = lambda x: x.to("cuda", torch.bfloat16).contiguous()  # noqa: E731
    for name, alpha in (("exp(g)", g.exp()), ("g", g)):

        def run(alpha=alpha):
            o, st = chunk_gated_delta_rule(
                dev(q),
                dev(k),
                dev(v),
                g=alpha.float().cuda().contiguous(),
                beta=beta.float().cuda().contiguous(),
                scale=D**-0.5,
                initial_state=None,
                output_final_state=True,
                cu_seqlens=cu,
            )
            err = (o.double().cpu() - ref).abs().max().item()
            st_err_kv = (st[0].double().cpu() - s).abs().max().item()
            st_err_vk = (st[0].double().cpu().transpose(-1, -2) - s).abs().max().item()
            return (
                f"out err {err:.3g}; state err as [K,V] {st_err_kv:.3g}, as [V,K] {st_err_vk:.3g}"
            )

        _line(f"gdn alpha={name}", run)


def probe_ssu() -> None:
    """selective_state_update on (head_dim, d_state) pairs."""
    from flashinfer.mamba import selective_state_update

    for dim, dstate in ((64, 128), (16, 16), (4, 6)):

        def run(dim=dim, dstate=dstate):
            h, n = 4, 3
            state = torch.zeros(5, h, dim, dstate, device="cuda")
            x = torch.randn(n, h, dim, device="cuda", dtype=torch.bfloat16)
            dt = torch.rand(n, h, device="cuda").unsqueeze(-1).expand(-1, h, dim)
            A = (-torch.rand(h, device="cuda"))[:, None, None].expand(h, dim, dstate)
            B = torch.randn(n, 2, dstate, device="cuda", dtype=torch.bfloat16)
            D = torch.ones(h, device="cuda")[:, None].expand(h, dim)
            out = torch.empty_like(x)
            selective_state_update(
                state,
                x,
                dt,
                A,
                B,
                B.clone(),
                D,
                dt_bias=torch.zeros(h, device="cuda")[:, None].expand(h, dim),
                dt_softplus=True,
                state_batch_indices=torch.tensor([1, 3, 4], dtype=torch.int32, device="cuda"),
                out=out,
            )
            torch.cuda.synchronize()
            return f"finite={bool(torch.isfinite(out).all())}"

        _line(f"ssu dim={dim} dstate={dstate}", run)


def probe_mla() -> None:
    """BatchMLAPagedAttentionWrapper planning and running with several head counts."""
    import flashinfer

    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    for heads in (1, 4, 16, 128):

        def run(heads=heads):
            w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws)
            i32 = dict(dtype=torch.int32)
            w.plan(
                torch.tensor([0, 1, 2], **i32),
                torch.tensor([0, 2, 3], **i32),
                torch.tensor([1, 2, 3], **i32),
                torch.tensor([20, 5], **i32),
                heads,
                512,
                64,
                16,
                True,
                0.1,
                torch.bfloat16,
                torch.bfloat16,
            )
            cache = torch.randn(4, 16, 576, device="cuda", dtype=torch.bfloat16)
            qn = torch.randn(2, heads, 512, device="cuda", dtype=torch.bfloat16)
            qp = torch.randn(2, heads, 64, device="cuda", dtype=torch.bfloat16)
            o = w.run(qn, qp, cache[..., :512], cache[..., 512:])
            torch.cuda.synchronize()
            return f"finite={bool(torch.isfinite(o).all())}"

        _line(f"mla heads={heads}", run)


if __name__ == "__main__":
    which = sys.argv[1:] or ["gdn", "ssu", "mla"]
    for name in which:
        {"gdn": probe_gdn, "ssu": probe_ssu, "mla": probe_mla}[name]()
