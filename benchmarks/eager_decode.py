"""Graphs-off decode at batch 1: milliseconds per step, best of a few runs, and the tokens.

Eager decode is bound by the host, and a shared host's speed wanders from run
to run by tens of percent; the best of several runs is the figure that two
trees can be compared by. Run it once per tree, alternating, in one session on
one machine (the tokens must agree)::

    PYTHONPATH=/path/to/before python benchmarks/eager_decode.py llama-1b --label before
    PYTHONPATH=/path/to/after  python benchmarks/eager_decode.py llama-1b --label after

The figure is one ``generate`` of ``--new`` tokens after a ``--prompt``-token
prompt (prefill included) divided by ``--new``. Random weights of the shape are
saved under ``--weights-dir`` on first use and reused.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

from backplane import LLM, SamplingParams
from backplane.cli.bench.latency.shapes import shape_config
from backplane.cli.bench.latency.weights import save_random_weights

logger = logging.getLogger("eager_decode")


def main(argv: list[str] | None = None) -> int:
    """Time eager decode of one shape and print the best run and the first tokens."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", help="llama-1b, nemotron-h-0.85b or a preset")
    ap.add_argument("--label", default="", help="printed before the figures")
    ap.add_argument("--attention", default="triton", help="attention backend (triton)")
    ap.add_argument("--prompt", type=int, default=300, help="prompt tokens (300)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per run (64)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs (3)")
    ap.add_argument("--weights-dir", default=None, help="default: /tmp/backplane-eager-<shape>")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        logger.error("eager_decode needs a CUDA device")
        return 2
    folder = Path(args.weights_dir or f"/tmp/backplane-eager-{args.shape}")
    if not (folder / "config.json").exists():
        save_random_weights(args.shape, shape_config(args.shape), folder, torch.bfloat16)
    llm = LLM(
        str(folder),
        device="cuda",
        dtype="bfloat16",
        max_model_len=args.prompt + args.new + 16,
        max_num_seqs=8,
        cuda_graphs="off",
        backends={"attention": args.attention},
    )
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    prompt = [[5 + i % 3 for i in range(args.prompt)]]
    first = llm.generate(prompt, params)
    runs = []
    for _ in range(args.runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompt, params)
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t) / args.new * 1e3)
    logger.info(
        "%s %s eager ms per step: best %.3f, runs %s",
        args.label,
        args.shape,
        min(runs),
        ", ".join(f"{r:.3f}" for r in runs),
    )
    logger.info("%s tokens %s", args.label, list(first[0].outputs[0].token_ids[:12]))
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
