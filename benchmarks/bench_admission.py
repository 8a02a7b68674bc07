"""Admission of a batch whose prompts share prefixes, with and without the host KV tier.

Scenario: ``--docs`` shared prefixes ("documents") of ``--doc-pages`` pages are
prefilled once, then a filler workload evicts them from the device. A batch of
``--batch`` requests (each a document + a unique suffix) is then admitted in one
scheduler step. Three cases:

* ``device-hit``: no filler; the documents are still on the device.
* ``host-tier``: filler ran; the documents were offloaded to the host tier and
  are onboarded back during admission (two-phase).
* ``no-tier``: filler ran without a host tier; the documents are recomputed.

Reported per case: CPU time of ``Scheduler.schedule()`` for the admitting step
(claims, reservations, allocations, evictions, copy issue), the time until the
queued host-tier copies completed (CUDA: after a synchronize), tokens reused
from the device / onboarded from the host, and tokens the step must compute.

Usage::

    python benchmarks/bench_admission.py                   # CPU, small caches
    python benchmarks/bench_admission.py --device cuda --layers 32 --markdown
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from backplane.engine.kv_cache import HostTier, KVCacheManager
from backplane.engine.request import Request
from backplane.engine.sched import Scheduler

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _params(max_tokens: int = 1) -> SimpleNamespace:
    return SimpleNamespace(max_tokens=max_tokens, stop_token_ids=(), ignore_eos=True)


def _drain(sched: Scheduler) -> None:
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(
            out, {s.request.request_id: 1 for s in out.scheduled if s.is_prefill_chunk_final}
        )


def run_case(args: argparse.Namespace, case: str, seed: int) -> dict[str, float]:
    """Build a fresh engine core, warm it up for ``case`` and time the admitting step."""
    ps = args.page_size
    dev = torch.device(args.device)
    shape = (args.num_pages, 2, ps, args.kv_heads, args.head_dim)
    caches = [torch.zeros(shape, dtype=DTYPES[args.dtype], device=dev) for _ in range(args.layers)]
    host = HostTier(caches, args.host_pages) if case == "host-tier" else None
    kv = KVCacheManager(args.num_pages, ps, host_tier=host)
    sched = Scheduler(kv, max_num_seqs=max(args.batch, 64), max_num_tokens=args.max_num_tokens)
    rng = np.random.default_rng(seed)
    vocab = 32000
    docs = [rng.integers(0, vocab, args.doc_pages * ps).astype(np.int32) for _ in range(args.docs)]
    for i, d in enumerate(docs):
        sched.add_request(Request(f"doc{i}", np.append(d, 1), _params()))
    _drain(sched)
    if case != "device-hit":
        # unique prompts covering 1.5x the pool evict every document page
        per = 64 * ps
        for i in range(-(-3 * args.num_pages * ps // (2 * per))):
            sched.add_request(
                Request(f"fill{i}", rng.integers(0, vocab, per - 1).astype(np.int32), _params())
            )
        _drain(sched)
    if host is not None:
        host.synchronize()
    reqs = []
    for i in range(args.batch):
        suffix = rng.integers(0, vocab, args.suffix).astype(np.int32)
        r = Request(f"q{i}", np.concatenate([docs[i % args.docs], suffix]), _params())
        sched.add_request(r)
        reqs.append(r)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    out = sched.schedule()
    t1 = time.perf_counter()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t2 = time.perf_counter()
    assert len(out.scheduled) == args.batch, (
        "raise --max-num-tokens/--num-pages: batch not admitted"
    )
    st = kv.stats
    return {
        "admit_ms": (t1 - t0) * 1e3,
        "copies_done_ms": (t2 - t0) * 1e3,
        "reused_tokens": sum(r.stats.reused_tokens for r in reqs),
        "onboarded_tokens": sum(r.stats.onboarded_tokens for r in reqs),
        "onboarded_pages": st.onboarded_pages,
        "compute_tokens": out.num_scheduled_tokens,
        "estimate_ok": float(st.estimated_reused_tokens == st.realised_reused_tokens),
    }


def main() -> None:
    """Run the three cases and print a table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=2048)
    p.add_argument("--host-pages", type=int, default=4096)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--doc-pages", type=int, default=32)
    p.add_argument("--suffix", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-num-tokens", type=int, default=65536)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = p.parse_args()

    page_bytes = 2 * args.page_size * args.kv_heads * args.head_dim * DTYPES[args.dtype].itemsize
    page_mib = page_bytes * args.layers / 2**20
    dev_name = (
        torch.cuda.get_device_name(torch.device(args.device))
        if args.device.startswith("cuda")
        else platform.processor() or platform.machine()
    )
    print(
        f"# device {args.device} ({dev_name}); {args.layers} layers x [pages, 2, {args.page_size}, "
        f"{args.kv_heads}, {args.head_dim}] {args.dtype} = {page_mib:.2f} MiB per page; "
        f"batch {args.batch} = {args.docs} docs x {args.doc_pages * args.page_size} shared "
        f"tokens + {args.suffix} unique; median of {args.repeats}"
    )
    cols = ["admit_ms", "copies_done_ms", "reused_tokens", "onboarded_tokens", "compute_tokens"]
    rows = []
    for case in ("device-hit", "host-tier", "no-tier"):
        runs = [run_case(args, case, seed) for seed in range(args.repeats)]
        assert all(r["estimate_ok"] for r in runs)
        rows.append((case, {k: statistics.median(r[k] for r in runs) for k in cols}))
    if args.markdown:
        print("| case | " + " | ".join(cols) + " |")
        print("|---" * (len(cols) + 1) + "|")
        for case, m in rows:
            vals = [f"{m[k]:.2f}" if k.endswith("_ms") else f"{int(m[k])}" for k in cols]
            print(f"| {case} | " + " | ".join(vals) + " |")
    else:
        print(f"{'case':<12}" + "".join(f"{c:>18}" for c in cols))
        for case, m in rows:
            print(f"{case:<12}" + "".join(f"{m[k]:>18.2f}" for k in cols))


if __name__ == "__main__":
    main()
