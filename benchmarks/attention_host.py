"""Host (Python) cost per call of the Triton attention op on a mixed batch.

A mixed step of the Llama-3.1-8B shape (32 query and 8 key/value heads of
128): 256 decode sequences of about 300 tokens of context and one 300-token
prefill. In the piecewise CUDA graphs the attention op runs eagerly between
the captured segments, once per layer, so its host time is paid 32 times a
step. Two ways are timed, each as the engine calls the op (with an ``out``
buffer, q/k/v as head views of one projection, one cache per layer):

* ``no plan``: the step's context carries no attention plan (tests and
  callers that skip ``plan``): every call derives the step's facts itself;
* ``plan``: the backend's ``plan(batch)`` ran once for the step (its cost
  is reported separately, and per layer);
* ``plan, torch.ops``: as ``plan``, through the op's overload and the
  dispatcher, as the piecewise graphs call it.

On CUDA the kernels run: each burst of one call per layer is timed on the
host without waiting for the device (the queue holds far more launches than
a burst makes), and the outputs and caches of both ways must be identical.
Without CUDA the Python path is measured with every kernel launch replaced
by a no-op (the launch handles stand in for Triton's compiled kernels), so
the figure is the host work around the driver call.

Usage: ``python benchmarks/attention_host.py [--layers 32] [--steps 50]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backplane.core.forward_context import forward_context  # noqa: E402
from backplane.core.launch import KernelLauncher  # noqa: E402
from backplane.core.packing import build_batch_metadata  # noqa: E402

log = logging.getLogger("attention_host")


class _NoopKernel:
    """A compiled-kernel handle whose launch does nothing (host-only measurement)."""

    run = staticmethod(lambda *args: None)

    def launch(self, grid0: int, grid1: int, grid2: int, device: int, *args: Any) -> None:
        """Accept a launch like :meth:`backplane.core.launch._Compiled.launch` and drop it.

        :param grid0: programs along the first grid axis.
        :param grid1: along the second.
        :param grid2: along the third.
        :param device: the device index.
        :param args: the kernel's leading arguments.
        """


def _noop_launches() -> None:
    """Make every :class:`KernelLauncher` hand out no-op handles instead of compiling."""
    handle = _NoopKernel()

    def slow(self: KernelLauncher, key: Any, grid: Any, args: Any, meta: Any) -> _NoopKernel:
        # What the real slow path costs besides compiling: the constants' tail.
        self._tail(len(args), meta)
        self._cache[key] = handle
        return handle

    KernelLauncher._slow = slow  # type: ignore[method-assign]
    orig_init = KernelLauncher.__init__

    def init(self: KernelLauncher, kernel: Any) -> None:
        orig_init(self, kernel)
        self._always_slow = False

    KernelLauncher.__init__ = init  # type: ignore[method-assign]


def _mixed_batch(
    num_decode: int, context: int, prefill: int, page_size: int, device: torch.device
) -> Any:
    """One prefill of ``prefill`` tokens, then ``num_decode`` decodes of about ``context`` keys."""
    rng = np.random.default_rng(0)
    ctx = rng.integers(context - 50, context + 51, size=num_decode)
    query_lens = [prefill] + [1] * num_decode
    cached_lens = [0] + [int(c) for c in ctx]
    tables, at = [], 1  # page 0 is the scratch page
    for q, c in zip(query_lens, cached_lens, strict=True):
        n = -(-(q + c) // page_size)
        tables.append(np.arange(at, at + n))
        at += n
    return build_batch_metadata(query_lens, cached_lens, tables, page_size, device=device), at


def main(argv: list[str] | None = None) -> int:
    """Time the op's host path per call, without and with the step's plan.

    :param argv: command-line arguments (``None``: ``sys.argv``).
    :return: the exit status (1 when the two ways' outputs differ).
    """
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decode", type=int, default=256, help="decode sequences")
    p.add_argument("--context", type=int, default=300, help="mean context of a decode")
    p.add_argument("--prefill", type=int, default=300, help="prefill tokens (one sequence)")
    p.add_argument("--layers", type=int, default=32 if cuda else 4, help="layers per step")
    p.add_argument("--steps", type=int, default=50, help="timed steps per way")
    p.add_argument("--page-size", type=int, default=16)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        _noop_launches()
    # Imported after the launches are patched: the launchers are made at import.
    from backplane.backends.triton.attention import TritonAttentionBackend

    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    batch, num_pages = _mixed_batch(args.decode, args.context, args.prefill, args.page_size, device)
    T = batch.padded_num_tokens
    backend = TritonAttentionBackend()
    gen = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(T, hq + 2 * hkv, d, dtype=dtype, device=device, generator=gen)
    q, k, v = qkv.split((hq, hkv, hkv), dim=1)
    caches = [
        torch.zeros(num_pages, 2, args.page_size, hkv, d, dtype=dtype, device=device)
        if cuda
        else torch.empty(num_pages, 2, args.page_size, hkv, d, dtype=dtype, device=device)
        for _ in range(args.layers)
    ]
    ways = ("no plan", "plan", "plan, torch.ops")
    outs = {
        way: [torch.empty(T, hq, d, dtype=dtype, device=device) for _ in range(args.layers)]
        for way in ways
    }
    scale = d**-0.5
    spec = _layer_spec(hq, hkv, d, scale)
    # The piecewise graphs call the op's overload (through the dispatcher); the
    # eager model calls the backend, whose call skips the dispatcher.
    overload = torch.ops.backplane_triton.attention.default

    def step(way: str) -> float:
        plans = {"attention": backend.plan(batch)} if way != "no plan" else {}
        with forward_context(batch, plans):
            if way == "plan, torch.ops":
                t0 = time.perf_counter()
                for i in range(args.layers):
                    overload(q, k, v, caches[i], 0, scale, outs[way][i])
                t1 = time.perf_counter()
            else:
                t0 = time.perf_counter()
                for i in range(args.layers):
                    backend.forward(q, k, v, caches[i], spec, outs[way][i])
                t1 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        return (t1 - t0) / args.layers * 1e6

    def plan_cost() -> float:
        t0 = time.perf_counter()
        backend.plan(batch)
        return (time.perf_counter() - t0) * 1e6

    with torch.inference_mode():  # as the engine runs its steps
        for way in ways:
            for _ in range(3):  # compile, choose configs, fill the caches
                step(way)
        ok = True
        if cuda:
            for i in range(args.layers):
                for way in ways[1:]:
                    if not torch.equal(outs["no plan"][i], outs[way][i]):
                        ok = False
                        log.error("layer %d: outputs of %r and 'no plan' differ", i, way)
            err = _reference_error(batch, q, k, v, caches[0], spec, outs["no plan"][0])
            log.info("  max abs difference from the torch backend (layer 0): %.3g", err)
            if not err <= 2e-2:
                ok = False
                log.error("the outputs differ from the torch backend's by %.3g", err)
        results: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.steps):
            for way in ways:
                results[way].append(step(way))
        plan_us = statistics.median(plan_cost() for _ in range(args.steps))
    where = torch.cuda.get_device_name() if cuda else "CPU, kernel launches as no-ops"
    log.info(
        "attention op host time per call: %d decode x ~%d keys + %d-token prefill, "
        "%d/%d heads of %d, bf16, %d layers (%s)",
        args.decode, args.context, args.prefill, hq, hkv, d, args.layers, where,
    )  # fmt: skip
    for way, times in results.items():
        log.info("  %-8s median %7.1f us  (min %.1f)", way, statistics.median(times), min(times))
    log.info(
        "  plan(batch) once per step: %.1f us (%.1f us per layer at %d layers)",
        plan_us, plan_us / args.layers, args.layers,
    )  # fmt: skip
    if cuda:
        log.info(
            "  outputs identical with and without the plan, close to torch's: %s",
            "yes" if ok else "NO",
        )
    return 0 if ok else 1


def _reference_error(
    batch: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    spec: Any,
    got: torch.Tensor,
) -> float:
    """The largest difference of ``got`` from the torch backend's output for the same step.

    The cache already holds this step's keys and values (the timed calls
    appended them); the reference appends the same rows to a copy.
    """
    from backplane.backends.torch.attention import TorchAttentionBackend

    ref_backend = TorchAttentionBackend()
    with forward_context(batch, {"attention": ref_backend.plan(batch)}):
        ref = ref_backend.forward(q, k, v, cache.clone(), spec)
    n = batch.num_tokens
    return (got[:n].float() - ref[:n].float()).abs().max().item()


def _layer_spec(hq: int, hkv: int, d: int, scale: float) -> Any:
    """The attention layer's constants as the model hands them to the backend."""
    from backplane.core.families import AttentionLayerSpec

    return AttentionLayerSpec(layer_id=0, num_heads=hq, num_kv_heads=hkv, head_dim=d, scale=scale)


if __name__ == "__main__":
    sys.exit(main())
