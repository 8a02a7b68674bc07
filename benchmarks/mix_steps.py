"""Where the time of a many-request run goes, step by step: the ShareGPT-like mix through ``LLM``.

Gives an engine the ``bench throughput`` mix (``--num-prompts`` requests with
ShareGPT-like prompt and output lengths, all at once, greedy, exact output
lengths) through ``LLM.generate`` and reports:

* output tokens per second over the whole run and the number of steps;
* the steps by regime: decode-only or mixed (prefill tokens in the step), and
  the step's decode sequences in classes of 128; per class the count, the
  median and mean milliseconds between consecutive schedules (a step's whole
  cost, host and device) and the mean tokens per step;
* the preemptions;
* with ``--profile-steps A:B``, a ``torch.profiler`` summary of steps ``A`` to
  ``B`` (kernels per step, device time by kind, top kernels), classified as
  ``profile_decode.py`` does.

Unlike ``backplane bench throughput`` (which serves the requests through
``AsyncLLM``), nothing but the engine and ``LLM``'s output processing runs, so
the step costs are the engine's own::

    python benchmarks/mix_steps.py --model llama-3.1-8b --weights-dir /tmp/w \\
        --max-num-seqs 1024 --max-num-tokens 8192 --profile-steps 800:804 --json steps.json
    python benchmarks/mix_steps.py --model tiny-llama --device cpu --num-prompts 20 --max-len 64

``--model`` takes a shape of ``bench latency`` (saved once with random
weights under ``--weights-dir``), a preset or a model folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode import STEP_RANGE, summarize  # noqa: E402

from backplane import LLM, SamplingParams  # noqa: E402
from backplane.cli.bench.latency.shapes import SHAPES, shape_config  # noqa: E402
from backplane.cli.bench.latency.weights import save_random_weights  # noqa: E402
from backplane.cli.bench.workload import sharegpt_like_requests  # noqa: E402
from backplane.engine.engine import Engine  # noqa: E402

logger = logging.getLogger("mix_steps")

#: decode sequences per regime class
CLASS_WIDTH = 128


def _model_path(name: str, weights_dir: str | None) -> str:
    """A folder for ``name``: a saved random-weight shape, or ``name`` itself."""
    if name not in SHAPES:
        return name
    root = weights_dir or tempfile.mkdtemp(prefix="mix-steps-")
    folder = os.path.join(root, f"{name}-bfloat16")
    save_random_weights(name, shape_config(name), folder, torch.bfloat16)
    return folder


def regimes(log: list[tuple[float, int, int, int]]) -> list[dict[str, Any]]:
    """Group consecutive schedules into regimes and time each step.

    :param log: per schedule ``(time, tokens, prefill sequences, decode sequences)``;
        a step lasts until the next schedule (the last one is left out).
    :return: one row per ``(kind, class)``: ``kind`` ``decode-only`` or ``mixed``,
        ``seqs_from`` / ``seqs_to`` (decode sequences), ``steps``, ``ms_p50``,
        ``ms_mean`` and ``tokens_mean``.
    """
    groups: dict[tuple[str, int], list[tuple[float, int]]] = defaultdict(list)
    for (t, tokens, prefill, decode), (t_next, *_) in zip(log, log[1:], strict=False):
        kind = "mixed" if prefill else "decode-only"
        groups[(kind, decode // CLASS_WIDTH)].append(((t_next - t) * 1e3, tokens))
    rows = []
    for (kind, cls), steps in sorted(groups.items()):
        ms = [s[0] for s in steps]
        rows.append(
            {
                "kind": kind,
                "seqs_from": cls * CLASS_WIDTH,
                "seqs_to": (cls + 1) * CLASS_WIDTH - 1,
                "steps": len(steps),
                "ms_p50": statistics.median(ms),
                "ms_mean": statistics.fmean(ms),
                "tokens_mean": statistics.fmean(s[1] for s in steps),
            }
        )
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the engine, serve the mix, and collect the figures the module describes."""
    backends = dict(b.split("=", 1) for b in args.backend)
    llm = LLM(
        _model_path(args.model, args.weights_dir),
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_tokens=args.max_num_tokens,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=False,
        backends=backends or None,
    )
    engine = llm.engine
    vocab = int(engine.vocab_size)
    requests = sharegpt_like_requests(
        args.num_prompts,
        seed=args.seed,
        max_input_len=args.max_len,
        max_output_len=args.max_len,
        max_total_len=2 * args.max_len,
        token_id_range=(min(10, vocab - 1), min(1000, vocab)),
    )
    log: list[tuple[float, int, int, int]] = []
    schedule = engine.scheduler.schedule

    def logged_schedule() -> Any:
        out = schedule()
        log.append(
            (
                time.perf_counter(),
                out.num_scheduled_tokens,
                out.num_prefill_seqs,
                out.num_decode_seqs,
            )
        )
        return out

    engine.scheduler.schedule = logged_schedule  # type: ignore[method-assign]
    first, last = args.profile_steps or (-1, -1)
    cuda = engine.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    step = Engine.step
    count = {"n": 0}

    def profiled_step(self: Engine) -> Any:
        n = count["n"]
        count["n"] += 1
        if n == first:
            prof.start()
        if first <= n <= last:
            with torch.profiler.record_function(STEP_RANGE):
                out = step(self)
        else:
            out = step(self)
        if n == last:
            if cuda:
                torch.cuda.synchronize(engine.device)
            prof.stop()
        return out

    Engine.step = profiled_step  # type: ignore[method-assign]
    params = [
        SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0) for r in requests
    ]
    try:
        t0 = time.perf_counter()
        outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    finally:
        Engine.step = step  # type: ignore[method-assign]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "device": torch.cuda.get_device_name(engine.device) if cuda else "cpu",
        "max_num_seqs": engine.max_num_seqs,
        "max_num_tokens": engine.max_num_tokens,
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tok_s": tokens / seconds,
        "steps": len(log),
        "preemptions": engine.scheduler.stats.preemptions,
        "regimes": regimes(log),
    }
    if args.profile_steps and count["n"] > last:
        result["profiled_steps"] = [
            {"tokens": t, "prefill_seqs": p, "decode_seqs": d}
            for _, t, p, d in log[first : last + 1]
        ]
        result["profile"] = summarize(
            prof.events(), steps=last - first + 1, on_cuda=cuda, top=args.top
        )
    llm.shutdown()
    return result


def format_report(result: dict[str, Any]) -> str:
    """The result as text: the run, the regimes, the profile's kinds and top kernels."""
    lines = [
        f"{result['device']}: {result['output_tokens']} output tokens in "
        f"{result['seconds']:.2f} s = {result['output_tok_s']:.0f} tok/s; {result['steps']} steps, "
        f"max_num_seqs {result['max_num_seqs']}, max_num_tokens {result['max_num_tokens']}, "
        f"preemptions {result['preemptions']}",
        "  kind          decode seqs   steps   ms p50   ms mean   tokens",
    ]
    for r in result["regimes"]:
        lines.append(
            f"  {r['kind']:<12}  {r['seqs_from']:>4}-{r['seqs_to']:<5}  {r['steps']:>6}  "
            f"{r['ms_p50']:7.2f}  {r['ms_mean']:8.2f}  {r['tokens_mean']:7.0f}"
        )
    prof = result.get("profile")
    if prof:
        lines.append(
            f"profiled steps {result['profiled_steps'][0]} ..: {prof['kernels_per_step']:.0f} "
            f"kernels, {prof['device_us_per_step'] / 1e3:.2f} ms of device time per step"
        )
        for kind, v in prof["by_kind"].items():
            if v["us_per_step"]:
                lines.append(f"  {kind:<24} {v['us_per_step'] / 1e3:7.2f} ms  {v['share']:6.1%}")
        for k in prof["top_kernels"]:
            lines.append(
                f"  {k['us_per_step'] / 1e3:7.2f} ms x{k['calls_per_step']:5.0f}  {k['name'][:90]}"
            )
    return "\n".join(lines)


def _range(value: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in value.split(":"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected FIRST:LAST such as 800:804, got {value!r}"
        ) from exc
    if not 0 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected 0 <= FIRST <= LAST, got {value!r}")
    return a, b


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module's documentation)."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default="llama-3.1-8b", help="a bench latency shape, preset or folder"
    )
    ap.add_argument("--weights-dir", help="where a shape's random weights are kept")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0, help="seed of the mix")
    ap.add_argument(
        "--max-len", type=int, default=1024, help="longest prompt and longest output (1024)"
    )
    ap.add_argument("--max-num-seqs", type=int, help="the engine's (default: its own)")
    ap.add_argument("--max-num-tokens", type=int, help="the engine's (default: its own)")
    ap.add_argument("--quantization", choices=("fp8",), help="quantise the projections on load")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="FAMILY=NAME",
        help="e.g. attention=triton",
    )
    ap.add_argument("--profile-steps", type=_range, metavar="FIRST:LAST", help="steps to profile")
    ap.add_argument("--top", type=int, default=12, help="kernels listed in the profile")
    ap.add_argument("--json", help="write the result here")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the mix and print (and optionally write) the report."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = run(args)
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
