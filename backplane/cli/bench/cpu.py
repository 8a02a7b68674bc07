"""``backplane bench cpu``: benchmarks of the engine's host side.

``backplane bench cpu`` measures the CPU cost of the engine's host side, without a model.

Two measurements:

* **Per decode step**: scheduling (``Scheduler.schedule`` + ``Scheduler.update``)
  and input preparation (``InputBatch.prepare``: metadata, input ids, one
  host-to-device copy) for a batch of ``B`` requests that all decode, at
  ``B`` in 1, 64, 256, 1024. The goal is under 5 us per request plus 100 us
  per step.
* **Request construction** for prompts of 128 .. 16k tokens given as a Python
  list versus an int32 numpy array (one memcpy).

Run ``backplane bench cpu`` or ``python benchmarks/bench_cpu_step.py``
(``--json`` for machine-readable output, ``--device cuda`` to include the
pinned host-to-device copy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from backplane.cli.bench.machine import machine_info
from backplane.cli.bench.options import add_json_print
from backplane.engine.sizes import pages_per_seq as seq_pages

BATCHES = (1, 64, 256, 1024)
PROMPT_LENS = (128, 1024, 4096, 16384)


def _time(fn: Callable[[], Any], *, repeat: int, number: int) -> float:
    """Median seconds per call over ``repeat`` runs of ``number`` calls."""
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - t0) / number)
    return statistics.median(runs)


def bench_request_construction(lens=PROMPT_LENS, repeat: int = 7) -> list[dict[str, Any]]:
    """Time ``Request(...)`` from a list and from an int32 array per prompt length."""
    from backplane.engine.request import Request
    from backplane.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=16)
    rng = np.random.default_rng(0)
    rows = []
    for n in lens:
        arr = rng.integers(0, 32000, size=n).astype(np.int32)
        lst = arr.tolist()
        number = max(10, 20000 // n)
        t_list = _time(
            lambda lst=lst: Request("r", lst, params, vocab_size=32000),
            repeat=repeat,
            number=number,
        )
        t_arr = _time(
            lambda arr=arr: Request("r", arr, params, vocab_size=32000),
            repeat=repeat,
            number=number,
        )
        rows.append(
            {
                "prompt_tokens": n,
                "list_us": t_list * 1e6,
                "int32_array_us": t_arr * 1e6,
                "speedup": t_list / t_arr,
            }
        )
    return rows


class _Seqs:
    """Scheduler + KV manager + input buffers for a synthetic decode workload."""

    def __init__(self, batch: int, *, prompt_len: int, page_size: int, device: str) -> None:
        from backplane.engine.kv_cache.manager import KVCacheManager
        from backplane.engine.request import Request
        from backplane.engine.sampling import SamplingParams
        from backplane.engine.sched import Scheduler
        from backplane.engine.worker.inputs import InputBatch

        max_tokens = 4096  # far more than the steps timed: nobody finishes
        max_len = prompt_len + max_tokens
        pages_per_seq = seq_pages(max_len, page_size)
        num_pages = batch * pages_per_seq + 2  # page bookkeeping only: no cache tensors
        self.manager = KVCacheManager(num_pages, page_size, enable_prefix_caching=True)
        self.scheduler = Scheduler(
            self.manager, max_num_seqs=batch, max_num_tokens=max(batch, 8192)
        )
        self.inputs = InputBatch(
            max_num_tokens=max(batch, 8192),
            max_num_seqs=batch,
            max_pages_per_seq=pages_per_seq,
            page_size=page_size,
            device=device,
        )
        rng = np.random.default_rng(batch)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        for i in range(batch):
            prompt = rng.integers(0, 32000, size=prompt_len).astype(np.int32)
            self.scheduler.add_request(Request(str(i), prompt, params, vocab_size=32000))
        self.rng = rng
        # run the prefills (no model: tokens are made up) until every request decodes
        for _ in range(10_000):
            out = self.scheduler.schedule()
            if (
                all(s.num_new_tokens == 1 and s.num_cached_tokens > 0 for s in out.scheduled)
                and len(out.scheduled) == batch
            ):
                self.scheduler.update(out, self._tokens(out))
                break
            self.scheduler.update(out, self._tokens(out))
        else:  # pragma: no cover - a scheduler that never reaches decode
            raise RuntimeError("the synthetic workload never reached pure decode")

    def _tokens(self, out: Any) -> dict[str, int]:
        return {s.request.request_id: 7 for s in out.scheduled if s.is_prefill_chunk_final}

    def step(self, timings: dict[str, list[float]]) -> None:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        self.inputs.prepare(out.scheduled)
        t2 = time.perf_counter()
        sampled = {s.request.request_id: 7 for s in out.scheduled}
        self.scheduler.update(out, sampled)
        t3 = time.perf_counter()
        timings["schedule"].append(t1 - t0)
        timings["prepare"].append(t2 - t1)
        timings["update"].append(t3 - t2)


def bench_decode_step(
    batches=BATCHES,
    *,
    steps: int = 50,
    prompt_len: int = 256,
    page_size: int = 16,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Median per-step CPU time of schedule + prepare + update at each batch size."""
    rows = []
    for b in batches:
        w = _Seqs(b, prompt_len=prompt_len, page_size=page_size, device=device)
        timings: dict[str, list[float]] = {"schedule": [], "prepare": [], "update": []}
        for _ in range(5):  # warm up
            w.step({k: [] for k in timings})
        for _ in range(steps):
            w.step(timings)
        med = {k: statistics.median(v) * 1e6 for k, v in timings.items()}
        total = sum(med.values())
        budget = 5.0 * b + 100.0
        rows.append(
            {
                "batch": b,
                "schedule_us": med["schedule"],
                "prepare_us": med["prepare"],
                "update_us": med["update"],
                "total_us": total,
                "per_request_us": total / b,
                "goal_us": budget,
                "meets_goal": total <= budget,
            }
        )
    return rows


def run_cpu(
    *, device: str = "cpu", steps: int = 50, as_json: bool = False, quick: bool = False
) -> dict:
    """Run both benchmarks and print a report.

    :param device: ``cpu`` or ``cuda`` (includes the pinned host-to-device copy).
    :param steps: decode steps timed per batch size.
    :param as_json: print JSON instead of tables.
    :param quick: smaller sizes (for tests).
    :return: the results.
    """
    import torch

    batches = (1, 64) if quick else BATCHES
    lens = (128, 1024) if quick else PROMPT_LENS
    result = {
        "machine": machine_info(torch.device(device)),
        "device": device,
        "decode_step": bench_decode_step(batches, steps=steps, device=device),
        "request_construction": bench_request_construction(lens),
    }
    if as_json:
        print(json.dumps(result, indent=2))
        return result
    m = result["machine"]
    print(
        f"machine: {m['cpu']} ({m['cores']} cores), python {m['python']}, numpy {m['numpy']}, "
        f"torch {m['torch']}, device {device}"
        + (f" ({m['gpu']})" if m["gpu"] and device != "cpu" else "")
    )
    print("\nper decode step (median; schedule + prepare inputs + update):")
    print(
        f"{'batch':>6} {'schedule':>10} {'prepare':>10} {'update':>10} {'total':>10} {'per req':>9} {'goal':>9}"
    )
    for r in result["decode_step"]:
        print(
            f"{r['batch']:>6} {r['schedule_us']:>8.1f}us {r['prepare_us']:>8.1f}us {r['update_us']:>8.1f}us "
            f"{r['total_us']:>8.1f}us {r['per_request_us']:>7.2f}us {r['goal_us']:>7.0f}us"
            + ("" if r["meets_goal"] else "  (over goal)")
        )
    print("\nRequest construction (median):")
    print(f"{'tokens':>7} {'list':>11} {'int32 array':>12} {'speedup':>8}")
    for r in result["request_construction"]:
        print(
            f"{r['prompt_tokens']:>7} {r['list_us']:>9.1f}us {r['int32_array_us']:>10.2f}us {r['speedup']:>7.1f}x"
        )
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``backplane bench cpu``.

    :param parser: the sub-command's parser.
    """
    parser.add_argument("--device", default="cpu", help="cpu or cuda (adds the pinned copy)")
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed per batch size")
    add_json_print(parser)
    parser.add_argument("--quick", action="store_true", help="small sizes only")


def run_cli(args: argparse.Namespace) -> int:
    """Run ``backplane bench cpu``: print the report (or its JSON).

    :param args: the parsed flags (:func:`add_arguments`).
    :return: the exit code (0).
    """
    run_cpu(device=args.device, steps=args.steps, as_json=args.json, quick=args.quick)
    return 0
