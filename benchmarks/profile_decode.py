"""Profile the decode steps of a backplane engine with ``torch.profiler``.

Builds an engine for a model shape (random weights) or a model folder, with a
chosen attention backend and CUDA graphs on or off, gives it one prompt per
sequence, runs the prefill and a few warm-up steps, then:

* times ``--steps`` decode steps without the profiler (wall clock per step);
* profiles ``--steps`` more and prints, per step: the kernels launched, the
  device time by kind (GEMM, attention, SSM / recurrent mixers,
  elementwise / norm / rope, copies, sampling, other; classified by kernel
  name), the host time (the step's wall time less the time the host waited
  for the device) and the device's idle time; then the top kernels.

On a CPU the "kernels" are the ``aten`` ops called from Python, timed on the
CPU, and the Python stack attributes each to attention, SSM or sampling when
it ran inside those parts of backplane.

    python benchmarks/profile_decode.py --shape llama-1b --attention triton --graphs on
    python benchmarks/profile_decode.py --shape nemotron-h-0.85b --batch-size 8 --json prof.json
    python benchmarks/profile_decode.py --shape tiny-llama --prompt-len 32 --steps 3   # CPU

The shapes are those of ``backplane bench latency`` (``llama-1b``,
``nemotron-h-0.85b``) and the built-in presets; ``--model DIR`` profiles a
model folder instead (for instance one kept with ``bench latency
--weights-dir``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from backplane import LLM, SamplingParams
from backplane.cli.bench.latency.shapes import SHAPES
from backplane.cli.bench.latency.speculation import parse_speculative_config
from backplane.models import presets

logger = logging.getLogger("profile_decode")

KINDS: tuple[str, ...] = (
    "gemm",
    "collectives",
    "attention",
    "ssm",
    "elementwise/norm/rope",
    "copies",
    "sampling",
    "other",
)
"""The kinds kernels are grouped into, in report order."""

# First match wins: the specific kinds come before the generic ones (an argmax
# is a reduction kernel, a Mamba chunk scan calls itself a bmm).
_NAME_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # tensor-parallel all-reduces / all-gathers (NCCL's kernels, or a custom all-reduce)
    ("collectives", ("nccl", "allreduce", "all_reduce", "allgather", "all_gather")),
    (
        "ssm",
        (
            "mamba",
            "ssm",
            "selective",
            "chunk_scan",
            "chunk_state",
            "chunk_cumsum",
            "state_passing",
            "bmm_chunk",
            "causal_conv",
            "conv1d",
            "_conv_kernel",
            "_conv_state_kernel",
            "delta_rule",
            "gated_delta",
            "fused_recurrent",
        ),
    ),
    (
        "attention",
        (
            "attention",
            "attn",
            "fmha",
            "flash_fwd",
            "flashattn",
            "paged",
            "kv_append",
            "batchdecode",
            "batchprefill",
            "decode_kernel",
            "prefill_kernel",
            "scaled_dot_product",
            "sdpa",
            "mla",
        ),
    ),
    (
        "sampling",
        (
            "argmax",
            "argmin",
            "topk",
            "top_k",
            "top_p",
            "sort",
            "radix",
            "multinomial",
            "exponential",
            "sampling",
            "sampler",
        ),
    ),
    (
        "gemm",
        (
            "gemm",
            "gemv",
            "cutlass",
            "cublas",
            "xmma",
            "nvjet",
            "matmul",
            "splitk",
            "aten::linear",
            "aten::matmul",
            "aten::einsum",
            "aten::mm",
            "mkldnn::_linear_pointwise",
            "aten::addmm",
            "aten::bmm",
            "aten::baddbmm",
            "aten::dot",
            "aten::mv",
        ),
    ),
    (
        "copies",
        (
            "memcpy",
            "memset",
            "copy",
            "aten::cat",
            "catarray",
            "index",
            "gather",
            "scatter",
            "fill",
            "embedding",
            "aten::clone",
            "aten::contiguous",
            "aten::zero_",
            "aten::stack",
            "aten::to",
        ),
    ),
    (
        "elementwise/norm/rope",
        (
            "elementwise",
            "vectorized",
            "unrolled",
            "rms",
            "norm",
            "rope",
            "rotary",
            "silu",
            "gelu",
            "relu",
            "act_and_mul",
            "triton_poi",
            "triton_per",
            "triton_red",
            "reduce_kernel",
            "softmax",
            "aten::mul",
            "aten::add",
            "aten::sub",
            "aten::div",
            "aten::exp",
            "aten::pow",
            "aten::rsqrt",
            "aten::sqrt",
            "aten::mean",
            "aten::sum",
            "aten::neg",
            "aten::sigmoid",
            "aten::tanh",
            "aten::where",
            "aten::clamp",
            "aten::cos",
            "aten::sin",
            "aten::square",
            "aten::maximum",
            "aten::minimum",
            "aten::max",
            "aten::amax",
            "aten::log",
            "aten::masked_fill",
            "aten::softplus",
            "aten::_softmax",
        ),
    ),
)

# Python files whose ops belong to one kind whatever the op (CPU profiles).
_STACK_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sampling", ("engine/sampling.py",)),
    ("attention", ("/attention.py", "/mla.py")),
    ("ssm", ("/ssm.py", "/delta.py", "mamba")),
)

#: Operator namespaces of the CPU ops counted (projections run ``mkldnn::`` ops on CPU).
_CPU_OP_PREFIXES = ("aten::", "mkldnn::")

#: The profiler range around each decode step.
STEP_RANGE = "decode_step"

# Host calls that wait for the device (their time is not host work).
_WAIT_CALLS = ("Synchronize", "cudaMemcpy", "cuMemcpyDtoH", "cudaStreamWaitEvent")


def classify(name: str, stack: Sequence[str] | None = None) -> str:
    """Say which kind of work a kernel (or, on a CPU, an ``aten`` op) is.

    :param name: the kernel or op name.
    :param stack: the Python stack of the op (CPU profiles), innermost first;
        an op called from backplane's attention, SSM or sampling code is
        counted as that kind.
    :return: one of :data:`KINDS`.
    """
    for frame in stack or ():
        if "backplane/backends/" not in frame and "backplane/engine/" not in frame:
            continue  # the model's own code (projections, norms) is judged by op name
        for kind, files in _STACK_RULES:
            if any(f in frame for f in files):
                return kind
    low = name.lower()
    if low.startswith("memcpy") or low.startswith("memset"):
        return "copies"
    for kind, keys in _NAME_RULES:
        if any(k in low for k in keys):
            return kind
    return "other"


@contextlib.contextmanager
def _as_preset(name: str, config: dict[str, Any]) -> Iterator[str]:
    """Make a shape buildable as a preset (random weights) while the engine loads."""
    key = f"profile-{name}"
    presets.PRESETS[key] = config
    try:
        yield key
    finally:
        presets.PRESETS.pop(key, None)


def _tokens_needed(args: argparse.Namespace) -> int:
    """Tokens each request generates: the first, warm-up, timed and profiled steps
    (the profiled ones twice, for a retry without Python stacks), and one spare."""
    return 1 + args.warmup + 3 * args.steps + 1


def build_llm(args: argparse.Namespace) -> LLM:
    """Build the engine ``args`` describe, sized for one batch of prompts.

    :return: the :class:`~backplane.LLM`.
    """
    p, b = args.prompt_len, args.batch_size
    total = _tokens_needed(args)
    page = 16
    overrides: dict[str, Any] = {
        "device": args.device,
        "dtype": args.dtype,
        "max_num_seqs": b,
        "max_num_tokens": max(b * p, b),
        "max_model_len": p + total,
        "page_size": page,
        "num_kv_pages": b * (-(-(p + total) // page) + 1) + 2,
        "enable_prefix_caching": False,
        "cuda_graphs": None if args.graphs == "on" else "off",
        "backends": {**dict(args.backend), "attention": args.attention},
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    if args.quantization:
        overrides["quantization"] = args.quantization
    if args.speculative_config:
        overrides["speculative_config"] = args.speculative_config
    if args.model:
        return LLM(args.model, **overrides)
    if args.shape in presets.PRESETS:
        return LLM(args.shape, **overrides)
    if args.shape not in SHAPES:
        known = [*SHAPES, *sorted(presets.PRESETS)]
        raise SystemExit(f"unknown shape {args.shape!r}; the shapes are: {', '.join(known)}")
    with _as_preset(args.shape, SHAPES[args.shape]) as key:
        return LLM(key, **overrides)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _python_stack(event: Any) -> list[str]:
    """The Python frames an op ran under, innermost first.

    Older profilers fill ``event.stack``; newer ones record each Python call
    as an event of its own, the op's ancestors.
    """
    if getattr(event, "stack", None):
        return list(event.stack)
    frames = []
    parent = event.cpu_parent
    while parent is not None:
        if ".py(" in parent.name:
            frames.append(parent.name)
        parent = parent.cpu_parent
    return frames


def _kernel_events(events: Any, on_cuda: bool) -> list[tuple[str, float, list[str] | None]]:
    """``(name, microseconds, stack)`` of every device kernel, or on a CPU of every
    operator (``aten::`` or ``mkldnn::``) called from Python (its time includes the ops
    it calls)."""
    from torch.autograd import DeviceType

    out: list[tuple[str, float, list[str] | None]] = []
    for e in events:
        if on_cuda:
            # the device-side copy of a record_function range is no kernel
            annotation = getattr(e, "is_user_annotation", False) or e.name == STEP_RANGE
            if e.device_type == DeviceType.CUDA and not annotation:
                out.append((e.name, float(e.time_range.elapsed_us()), None))
        elif (
            e.device_type == DeviceType.CPU
            and e.name.startswith(_CPU_OP_PREFIXES)
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith(_CPU_OP_PREFIXES))
        ):
            out.append((e.name, float(e.cpu_time_total), _python_stack(e)))
    return out


def summarize(events: Any, *, steps: int, on_cuda: bool, top: int = 15) -> dict[str, Any]:
    """Turn profiler events of ``steps`` decode steps into per-step figures.

    :param events: ``prof.events()``; each step is a ``decode_step`` range.
    :param steps: decode steps profiled.
    :param on_cuda: whether kernels ran on a CUDA device (else leaf aten ops are used).
    :param top: kernels to list.
    :return: ``kernels_per_step``, ``device_us_per_step``, ``by_kind`` (us per
        step and share per kind), ``host_us_per_step``, ``wall_us_per_step``
        (profiled), ``device_idle_us_per_step`` and ``top_kernels``.
    """
    from torch.autograd import DeviceType

    kernels = _kernel_events(events, on_cuda)
    step_ranges = [e for e in events if e.name == STEP_RANGE and e.device_type == DeviceType.CPU]
    wall = [e.time_range.elapsed_us() for e in step_ranges]
    wait = 0.0
    if on_cuda:
        for e in events:
            if e.device_type == DeviceType.CPU and any(w in e.name for w in _WAIT_CALLS):
                if not step_ranges or any(
                    s.time_range.start <= e.time_range.start <= s.time_range.end
                    for s in step_ranges
                ):
                    wait += e.time_range.elapsed_us()
    n = max(steps, 1)
    device_us = sum(k[1] for k in kernels)
    by_kind = dict.fromkeys(KINDS, 0.0)
    # by name and kind: on a CPU one op (einsum) serves several kinds
    agg: dict[tuple[str, str], dict[str, Any]] = defaultdict(lambda: {"calls": 0, "us": 0.0})
    for name, us, stack in kernels:
        kind = classify(name, stack)
        by_kind[kind] += us
        a = agg[(name, kind)]
        a["calls"] += 1
        a["us"] += us
    wall_per_step = statistics.fmean(wall) if wall else math.nan
    host = wall_per_step - wait / n if on_cuda else wall_per_step
    ranked = sorted(agg.items(), key=lambda kv: kv[1]["us"], reverse=True)[:top]
    return {
        "kernels_per_step": len(kernels) / n,
        "device_us_per_step": device_us / n,
        "by_kind": {
            k: {"us_per_step": v / n, "share": v / device_us if device_us else 0.0}
            for k, v in by_kind.items()
        },
        "host_us_per_step": max(host, 0.0),
        "wait_us_per_step": wait / n,
        "wall_us_per_step_profiled": wall_per_step,
        "device_idle_us_per_step": max(wall_per_step - device_us / n, 0.0),
        "top_kernels": [
            {
                "name": name,
                "kind": kind,
                "calls_per_step": a["calls"] / n,
                "us_per_step": a["us"] / n,
                "share": a["us"] / device_us if device_us else 0.0,
            }
            for (name, kind), a in ranked
        ],
    }


def profile(args: argparse.Namespace) -> dict[str, Any]:
    """Build the engine, run the prompts, time and profile the decode steps.

    :return: settings, machine, wall time per step without the profiler and
        the :func:`summarize` figures.
    """
    llm = build_llm(args)
    engine = llm.engine
    device = engine.device
    on_cuda = device.type == "cuda"
    rng = np.random.default_rng(args.seed)
    vocab = int(engine.vocab_size)
    total = _tokens_needed(args)
    params = SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True)
    rids = [
        llm.add_request(rng.integers(0, vocab, args.prompt_len).astype(np.int32), params)
        for _ in range(args.batch_size)
    ]
    got = dict.fromkeys(rids, 0)
    t0 = time.perf_counter()
    for _ in range(10_000):
        for out in llm.step():
            got[out.request_id] = len(out.token_ids)
        if all(v >= 1 for v in got.values()):
            break
    _sync(device)
    prefill_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        llm.step()
    _sync(device)
    wall = []
    for _ in range(args.steps):
        t = time.perf_counter()
        llm.step()
        _sync(device)
        wall.append((time.perf_counter() - t) * 1e6)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # Python stacks attribute CPU ops to backplane's parts; on CUDA kernel names do.
    with_stack = not on_cuda
    # An empty profile first: the first one imports profiler modules, and code
    # freed while profiling leaves the Python tracer's frame names dangling.
    with torch.profiler.profile(activities=activities, with_stack=with_stack):
        with torch.profiler.record_function(STEP_RANGE):
            pass
    while True:
        with torch.profiler.profile(activities=activities, with_stack=with_stack) as prof:
            for _ in range(args.steps):
                with torch.profiler.record_function(STEP_RANGE):
                    llm.step()
            _sync(device)
        try:
            summary = summarize(prof.events(), steps=args.steps, on_cuda=on_cuda, top=args.top)
            break
        except UnicodeDecodeError:
            if not with_stack:
                raise
            # a known torch profiler fault: frame names of code freed meanwhile
            logger.warning("the profiler's Python stacks were unreadable; profiling again without")
            with_stack = False
    if args.trace:
        prof.export_chrome_trace(args.trace)
    for rid in rids:
        llm.abort(rid)
    backends = {f: getattr(b, "name", type(b).__name__) for f, b in engine.backends.items()}
    return {
        "settings": {
            "model": args.model or args.shape,
            "attention": args.attention,
            "backends": backends,
            "cuda_graphs": getattr(engine.config, "cuda_graphs_resolved", args.graphs),
            "batch_size": args.batch_size,
            "tensor_parallel_size": args.tensor_parallel_size,
            "prompt_len": args.prompt_len,
            "steps": args.steps,
            "warmup": args.warmup,
            "device": str(device),
            "dtype": str(engine.dtype).replace("torch.", ""),
        },
        "machine": {
            "gpu": torch.cuda.get_device_name(device) if on_cuda else None,
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "prefill_ms": prefill_s * 1e3,
        "wall_us_per_step": statistics.median(wall),
        "wall_us_per_step_all": wall,
        **summary,
    }


def format_report(result: dict[str, Any]) -> str:
    """Render a :func:`profile` result as text."""
    s = result["settings"]
    on_gpu = bool(result["machine"]["gpu"])
    unit = "kernels" if on_gpu else "aten ops (CPU)"
    lines = [
        f"{s['model']} on {result['machine']['gpu'] or s['device']} ({s['dtype']}), "
        f"backends {s['backends']}, CUDA graphs {s['cuda_graphs']}, batch {s['batch_size']}, "
        f"prompt {s['prompt_len']}, {s['steps']} steps profiled",
        f"wall per step: {result['wall_us_per_step']:.1f} us (median, no profiler); "
        f"{result['wall_us_per_step_profiled']:.1f} us profiled",
    ]
    if on_gpu:
        lines.append(
            f"host per step: {result['host_us_per_step']:.1f} us (wall less waiting for the "
            f"device); device busy {result['device_us_per_step']:.1f} us, idle "
            f"{result['device_idle_us_per_step']:.1f} us"
        )
    else:
        lines.append(
            f"host per step: {result['host_us_per_step']:.1f} us, of which "
            f"{result['device_us_per_step']:.1f} us in aten ops and "
            f"{result['device_idle_us_per_step']:.1f} us outside them (Python)"
        )
    lines += [
        f"{unit} per step: {result['kernels_per_step']:.1f}",
        "",
        f"{'kind':<24}{'us/step':>10}{'share':>8}",
    ]
    for kind in KINDS:
        v = result["by_kind"][kind]
        lines.append(f"{kind:<24}{v['us_per_step']:>10.1f}{v['share'] * 100:>7.1f}%")
    lines += ["", f"top {unit}:", f"{'us/step':>9}{'share':>7}{'calls':>7}  {'kind':<22}name"]
    for k in result["top_kernels"]:
        name = k["name"] if len(k["name"]) <= 100 else k["name"][:97] + "..."
        lines.append(
            f"{k['us_per_step']:>9.1f}{k['share'] * 100:>6.1f}%{k['calls_per_step']:>7.1f}  "
            f"{k['kind']:<22}{name}"
        )
    return "\n".join(lines) + "\n"


def _family_backend(value: str) -> tuple[str, str]:
    family, sep, name = value.partition("=")
    if not sep or not family or not name:
        raise argparse.ArgumentTypeError(f"expected FAMILY=NAME such as ssm=triton, got {value!r}")
    return family.strip(), name.strip()


def build_parser() -> argparse.ArgumentParser:
    """The command line of this script."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--shape",
        default="llama-1b",
        help=f"{', '.join(SHAPES)} or a preset such as tiny-llama (default: llama-1b)",
    )
    ap.add_argument("--model", metavar="DIR", help="a model folder to profile instead of a shape")
    ap.add_argument("--attention", default="auto", help="attention backend (default: auto)")
    ap.add_argument(
        "--backend",
        type=_family_backend,
        action="append",
        default=[],
        metavar="FAMILY=NAME",
        help="backend of another op family, e.g. ssm=triton",
    )
    ap.add_argument("--graphs", choices=("on", "off"), default="on", help="CUDA graphs (on)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed, then profiled")
    ap.add_argument("--warmup", type=int, default=5, help="decode steps before them")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="ranks the model is split over; the profile is rank 0's (the driver's process)",
    )
    ap.add_argument(
        "--quantization",
        choices=("fp8",),
        help="quantise the projections on load (fp8: e4m3 weights, one scale per row)",
    )
    ap.add_argument(
        "--speculative-config",
        type=parse_speculative_config,
        metavar="JSON",
        help="profile steps with speculative decoding, spelled as for serve, e.g. "
        '\'{"method": "mtp", "num_speculative_tokens": 1}\'; a step then verifies drafts',
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--top", type=int, default=15, help="kernels listed (15)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures here")
    ap.add_argument("--trace", metavar="PATH", help="write the profiler's Chrome trace here")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Profile and print the report (and JSON with ``--json``)."""
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.prompt_len < 1 or args.warmup < 0:
        raise SystemExit("--steps, --batch-size and --prompt-len must be positive, --warmup >= 0")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    result = profile(args)
    sys.stdout.write(format_report(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
