"""Host time per kernel launch: Triton's own launch path against :class:`KernelLauncher`.

Eager (graphs-off) decode at batch 1 is bound by the host: every kernel costs
its launch. This measures, per call, the host time of

* a trivial Triton kernel with nine arguments launched as ``kernel[grid](...)``;
* the same kernel through :class:`backplane.core.launch.KernelLauncher`, with
  a caller key and with the key derived from the arguments (``launch``), and
  the derivation alone for 45 arguments (the attention decode launch's size);
* the package's one-row projections (``gemv``, ``norm_gemv``) as the models
  call them, and cuBLAS's ``F.linear`` on the same row;
* ``torch.empty`` and a one-row ``add``, for scale.

Each call is made a few thousand times without synchronising; the figure is the
loop's wall time per call, which the host sets (the kernels are tiny). Run on
the GPU machine::

    python benchmarks/launch_overhead.py [--calls 3000]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from backplane.core import launch
from backplane.kernels import gemv as G

logger = logging.getLogger("launch_overhead")


@triton.jit
def _copy(a, b, c, d, n, m, s, t, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    tl.store(a + i, tl.load(b + i))


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Microseconds of host time per call of ``fn`` (after 50 warm-up calls)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return us


def main(argv: list[str] | None = None) -> int:
    """Print the host time per call of each launch path."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000, help="calls timed per figure (3000)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        logger.error("launch_overhead needs a CUDA device")
        return 2
    launch.CHECK = False
    dev = "cuda"
    a = torch.zeros(1024, device=dev)
    b = torch.ones(1024, device=dev)
    launcher = launch.KernelLauncher(_copy)
    many = tuple([a] * 15 + [1024] * 30)
    x = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)
    r = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)
    g = torch.ones(2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    w_qkv = torch.randn(3072, 2048, device=dev, dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan_o, plan_qkv = G.plan(2048, 2048, sms), G.plan(3072, 2048, sms)
    cases: list[tuple[str, Callable[[], object]]] = [
        ("triton kernel[grid](...), 9 args", lambda: _copy[(1,)](a, b, a, b, 1024, 3, 4, 5, BLOCK=64)),
        ("KernelLauncher, caller key", lambda: launcher("k", (1,), (a, b, a, b, 1024, 3, 4, 5), 0, BLOCK=64)),
        ("KernelLauncher.launch (derived key)", lambda: launcher.launch((1,), (a, b, a, b, 1024, 3, 4, 5), 0, BLOCK=64)),
        ("arg_key, 45 arguments", lambda: launch.arg_key(many)),
        ("gemv 2048x2048", lambda: G.gemv(x, w, launch=plan_o)),
        ("norm_gemv 3072x2048", lambda: G.norm_gemv(x, r, g, 1e-5, False, w_qkv, launch=plan_qkv)),
        ("F.linear 2048x2048", lambda: F.linear(x, w)),
        ("torch.empty 2048", lambda: torch.empty(2048, device=dev, dtype=torch.bfloat16)),
        ("x.add(r), one row", lambda: x.add(r)),
    ]  # fmt: skip
    logger.info("%s, triton %s", torch.cuda.get_device_name(0), triton.__version__)
    for name, fn in cases:
        logger.info("%-40s %7.2f us per call", name, host_us(fn, args.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
