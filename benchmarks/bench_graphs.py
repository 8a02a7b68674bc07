"""CUDA graphs vs eager on a ~1B-parameter Llama-shaped model (random bf16 weights).

Measures, for batch sizes 1..64:

* decode step latency: eager vs the monolithic decode graph (every sequence
  decodes one token on ``--ctx`` tokens of context);
* mixed step latency: eager vs piecewise graphs (one ``--prefill``-token
  prefill chunk plus ``batch - 1`` decodes);

each time is one step's input preparation + backend planning + forward, on the
device clock, median of ``--iters`` runs. Also prints the graph pool memory per
bucket and in total. Needs CUDA.

    python benchmarks/bench_graphs.py --json graphs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from backplane.core.forward_context import forward_context, plan_step
from backplane.models import presets

LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass
class _Req:
    token_buffer: np.ndarray


@dataclass
class _Seq:
    request: _Req
    num_new_tokens: int
    num_cached_tokens: int
    page_ids: np.ndarray
    state_slot: int
    is_prefill_chunk_final: bool = True


def make_seqs(engine, rng, prefill: list[int], ctx: list[int]) -> list[_Seq]:
    """Prefill sequences first, then decode sequences with ``ctx`` tokens of context."""
    lens = [(q, 0) for q in prefill] + [(1, c) for c in ctx]
    free = rng.permutation(np.arange(1, engine.num_pages))
    seqs, used = [], 0
    for i, (q, c) in enumerate(lens):
        need = -(-(q + c) // engine.page_size)
        seqs.append(
            _Seq(
                _Req(rng.integers(0, engine.vocab_size, q + c + 1).astype(np.int32)),
                q,
                c,
                free[used : used + need].astype(np.int32),
                i + 1,
            )
        )
        used += need
    return seqs


def time_step(engine, prepare, run, seqs, iters: int) -> float:
    """Median milliseconds of prepare + plan + forward, synchronised per step."""
    times = []
    for i in range(iters + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        inputs = prepare(seqs)
        with forward_context(inputs.metadata, plan_step(engine.backends, inputs.metadata)):
            run(inputs)
        torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a markdown table (and JSON with ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,2,4,8,16,32,64")
    ap.add_argument("--ctx", type=int, default=1024, help="context tokens of each decode sequence")
    ap.add_argument("--prefill", type=int, default=256, help="prefill chunk of the mixed step")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--max-model-len", type=int, default=2048, help="decode graphs are sized for it"
    )
    ap.add_argument("--backend", action="append", default=[], help="family=name (default auto)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_graphs needs CUDA")
    from backplane.engine.engine import Engine

    presets.PRESETS["bench-llama-1b"] = LLAMA_1B  # random weights from the preset seed
    backends = dict(kv.split("=", 1) for kv in args.backend)
    batches = [int(b) for b in args.batch.split(",")]
    t0 = time.perf_counter()
    engine = Engine(
        model="bench-llama-1b",
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=max(batches),
        max_num_tokens=2048,
        max_model_len=args.max_model_len,
        kv_memory="16GiB",
        cuda_graphs="full_and_piecewise",
        **({"backends": backends} if backends else {}),
    )
    startup = time.perf_counter() - t0
    runner = engine.runner
    n_params = sum(p.numel() for p in engine.model.parameters())
    mem = runner.memory_report()
    rng = np.random.default_rng(0)
    eager_prepare = engine.input_batch.prepare

    def eager_run(inputs):
        return engine.model(inputs.input_ids, inputs.positions)

    rows = []
    with torch.inference_mode():
        for b in batches:
            dec = make_seqs(engine, rng, [], [args.ctx] * b)
            mix = make_seqs(engine, rng, [args.prefill], [args.ctx] * (b - 1))
            row = {
                "batch": b,
                "decode_eager_ms": time_step(engine, eager_prepare, eager_run, dec, args.iters),
                "decode_graph_ms": time_step(
                    engine, runner.prepare_inputs, runner.run, dec, args.iters
                ),
                "mixed_eager_ms": time_step(engine, eager_prepare, eager_run, mix, args.iters),
                "mixed_piecewise_ms": time_step(
                    engine, runner.prepare_inputs, runner.run, mix, args.iters
                ),
            }
            rows.append(row)
    device = torch.cuda.get_device_name(0)
    print(
        f"device: {device}; model: Llama-shaped, {n_params / 1e9:.2f}B params, bf16, random weights"
    )
    print(
        f"backends: { {f: b.name for f, b in engine.backends.items()} }; startup incl. capture {startup:.1f}s"
    )
    print(
        f"decode context {args.ctx} tokens; mixed = {args.prefill}-token prefill + (batch-1) decodes"
    )
    print()
    print(
        "| batch | decode eager ms | decode graph ms | speedup | mixed eager ms | mixed piecewise ms | speedup |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['decode_eager_ms']:.2f} | {r['decode_graph_ms']:.2f} | "
            f"{r['decode_eager_ms'] / r['decode_graph_ms']:.2f}x | {r['mixed_eager_ms']:.2f} | "
            f"{r['mixed_piecewise_ms']:.2f} | {r['mixed_eager_ms'] / r['mixed_piecewise_ms']:.2f}x |"
        )
    largest = max(mem["piecewise"].values(), default=0)
    print()
    print(
        f"graph pool total {mem['total'] / 2**20:.1f} MiB; largest piecewise bucket "
        f"{largest / 2**20:.1f} MiB (ratio {mem['total'] / max(largest, 1):.2f})"
    )
    print(
        "piecewise pool growth per bucket (MiB):",
        {k: round(v / 2**20, 1) for k, v in sorted(mem["piecewise"].items())},
    )
    print(
        "decode pool growth per bucket (MiB):",
        {k: round(v / 2**20, 1) for k, v in sorted(mem["decode"].items())},
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": device,
                    "params": n_params,
                    "rows": rows,
                    "memory": mem,
                    "startup_s": startup,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
