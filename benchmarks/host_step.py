"""Host cost of a throughput step, everything but the model forward, on CPU.

Serves many requests at once through the real engine (tiny-llama on CPU,
``max_num_seqs`` 256 by default) and times each host component of every step
with clock accumulators (the thread's CPU time by default, ``--clock``) around the real
functions (nothing is stubbed):

- ``schedule``: :meth:`Scheduler.schedule`;
- ``prepare_inputs``: the worker's input preparation (``InputBatch.prepare`` and
  the runner's mode choice);
- ``step_rows``: the sampling rows and prompt-logprob rows of the step;
- ``commit``: advancing the scheduler, reading the sampled tokens, committing them
  and keeping their logprobs;
- ``collect``: building the engine's per-request outputs;
- ``outputs_llm``: the ``LLM.step`` output processing (detokenising, stop strings,
  :class:`RequestOutput`) around ``Engine.step``;
- ``outputs_async``: what ``AsyncLLM``'s loop adds per step (delivery to the
  callers' streams and the engine snapshot), with ``--path async``;
- ``readers`` (``--path async``): the CPU time of the event loop's thread from the
  end of one step to the end of the next, where one coroutine per request reads its
  stream the way ``backplane bench throughput`` does (the clock of every token, the
  gaps between them) and a running request's :class:`RequestOutput` is built. It
  runs beside the engine thread and holds the same GIL, so it is host work of the
  step too (measured on the thread's CPU clock whatever ``--clock`` says);
- ``forward+sample`` (not host work of the step): the model forward and the sampler.

The cyclic garbage collector's pauses (every thread, wall clock) are counted apart, as
a mean per step over every step of the run: a full pass comes every few dozen steps, so
the medians above leave it out (a young pass lands in whatever component allocated).

Steps are classed by what they run: ``decode`` (only decodes, at least
``--min-seqs`` sequences) and ``mixed`` (prefill tokens plus at least
``--min-seqs`` - 1 decodes). The figures are milliseconds per step (median over
the steps of the class); ``host`` is the sum of the host components.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

HOST_PARTS = (
    "schedule",
    "prepare_inputs",
    "step_rows",
    "commit",
    "collect",
    "outputs",
    "readers",
)
EXCLUDED = "forward+sample"


class StepTimers:
    """Per-step accumulators of the time spent in each component, classed by step kind.

    :param min_seqs: a step counts as a 256-sequence step from this many scheduled sequences.
    """

    def __init__(self, min_seqs: int) -> None:
        self.min_seqs = min_seqs
        self.current: dict[str, float] = defaultdict(float)
        self.kind: str | None = None
        self.steps: dict[str, list[dict[str, float]]] = defaultdict(list)
        #: every step closed, classed or not
        self.num_steps = 0

    def add(self, part: str, seconds: float) -> None:
        """Add ``seconds`` to ``part`` of the step being run.

        :param part: the component.
        :param seconds: time spent.
        """
        self.current[part] += seconds

    def classify(self, num_seqs: int, num_prefill_seqs: int) -> None:
        """Record what the step being run schedules.

        :param num_seqs: sequences scheduled.
        :param num_prefill_seqs: of which prefill/extend ones.
        """
        if num_seqs < self.min_seqs:
            self.kind = None
        else:
            self.kind = "mixed" if num_prefill_seqs else "decode"

    def end_step(self) -> None:
        """Close the step being run: keep its figures under its kind, start the next."""
        self.num_steps += 1
        if self.kind is not None:
            self.steps[self.kind].append(dict(self.current))
        self.current = defaultdict(float)
        self.kind = None

    def summary(self) -> dict[str, dict[str, float]]:
        """Median milliseconds per step of each component, by step kind (the median, because
        a shared machine's other work lands on a few steps).

        :return: ``{kind: {part: ms, "host": ms, "steps": count}}``.
        """
        out: dict[str, dict[str, float]] = {}
        for kind, steps in sorted(self.steps.items()):
            parts = sorted({p for s in steps for p in s})
            row = {p: 1e3 * float(np.median([s.get(p, 0.0) for s in steps])) for p in parts}
            row["host"] = sum(v for p, v in row.items() if p != EXCLUDED)
            row["steps"] = len(steps)
            out[kind] = row
        return out


class GCPauses:
    """The cyclic garbage collector's pauses, in every thread, while :attr:`on` (a ``gc``
    callback: ``gc.callbacks.append(pauses)``)."""

    def __init__(self) -> None:
        self.on = False
        self.young = 0.0
        self.full = 0.0
        self.num_full = 0
        self._started: dict[int, float] = {}

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if not self.on:
            return
        now = time.perf_counter()
        thread = threading.get_ident()
        if phase == "start":
            self._started[thread] = now
            return
        began = self._started.pop(thread, None)
        if began is None:
            return
        if info["generation"] == 2:
            self.full += now - began
            self.num_full += 1
        else:
            self.young += now - began

    def summary(self, num_steps: int) -> dict[str, float]:
        """Milliseconds of pauses per step (mean over ``num_steps``) and the full passes.

        :param num_steps: the steps of the run.
        :return: ``{"young": ms, "full": ms, "full_passes": count, "steps": num_steps}``.
        """
        n = max(num_steps, 1)
        return {
            "young": 1e3 * self.young / n,
            "full": 1e3 * self.full / n,
            "full_passes": self.num_full,
            "steps": num_steps,
        }


#: the collector's pauses during the timed run
GC_PAUSES = GCPauses()

#: the clock of the accumulators (see ``--clock``)
_clock: Callable[[], float] = time.thread_time


def _wrap(owner: Any, name: str, part: str, timers: StepTimers) -> Callable[[], None]:
    """Time every call of ``owner.name`` into ``part``; return what undoes it."""
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = _clock()
        try:
            return original(*args, **kwargs)
        finally:
            timers.add(part, _clock() - t0)

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, original)


def instrument(
    llm: Any, timers: StepTimers, readers_clock: int | None = None
) -> list[Callable[[], None]]:
    """Put the timers around the components of ``llm``'s engine.

    :param llm: a :class:`backplane.LLM`.
    :param timers: where the times go.
    :param readers_clock: the CPU clock of the thread that reads the streams
        (``time.pthread_getcpuclockid``); its time since the previous step's end
        goes to ``readers`` at each step's end.
    :return: the undo callables.
    """
    import backplane.engine.engine as engine_mod

    engine = llm.engine
    sched = engine.scheduler
    undo = []
    original_schedule = sched.schedule

    def schedule() -> Any:
        t0 = _clock()
        out = original_schedule()
        timers.add("schedule", _clock() - t0)
        timers.classify(len(out.scheduled), out.num_prefill_seqs)
        return out

    sched.schedule = schedule
    undo.append(lambda: setattr(sched, "schedule", original_schedule))
    undo.append(_wrap(engine.executor, "prepare_inputs", "prepare_inputs", timers))
    undo.append(_wrap(engine_mod, "sampling_rows", "step_rows", timers))
    undo.append(_wrap(engine_mod, "prompt_rows", "step_rows", timers))
    for name in ("advance", "commit"):
        undo.append(_wrap(sched, name, "commit", timers))
    for name in ("_wait", "_keep"):
        undo.append(_wrap(engine, name, "commit", timers))
    # the grammars' part of _commit (none here) stays out: scheduler.commit is timed above
    undo.append(_wrap(engine, "_collect", "collect", timers))
    undo.append(_wrap(engine.executor, "execute_model", EXCLUDED, timers))
    undo.append(_wrap(engine.executor, "sample_tokens", EXCLUDED, timers))
    original_step = engine.step
    inner: dict[str, float] = {}

    def engine_step() -> Any:
        t0 = _clock()
        try:
            return original_step()
        finally:
            inner["t"] = _clock() - t0

    engine.step = engine_step
    undo.append(lambda: setattr(engine, "step", original_step))
    original_llm_step = llm._step
    readers_at = [0.0 if readers_clock is None else time.clock_gettime(readers_clock)]

    def llm_step(*args: Any, **kwargs: Any) -> Any:
        t0 = _clock()
        try:
            return original_llm_step(*args, **kwargs)
        finally:
            # the output processing is LLM.step less the engine step it wraps
            timers.add("outputs", _clock() - t0 - inner.get("t", 0.0))
            if readers_clock is not None:
                now = time.clock_gettime(readers_clock)
                timers.add("readers", now - readers_at[0])
                readers_at[0] = now
            timers.end_step()

    llm._step = llm_step
    undo.append(lambda: setattr(llm, "_step", original_llm_step))
    return undo


def workload(
    num_requests: int, seed: int, mean_prompt: int, mean_output: int
) -> tuple[list[list[int]], list[int]]:
    """ShareGPT-like prompts and output lengths (log-normal around the means).

    :param num_requests: how many requests.
    :param seed: the generator's seed.
    :param mean_prompt: about the mean prompt length in tokens.
    :param mean_output: about the mean output length in tokens.
    :return: prompt token ids (byte values of the tiny presets) and ``max_tokens`` per request.
    """
    rng = np.random.default_rng(seed)
    plens = np.clip(rng.lognormal(np.log(mean_prompt), 0.5, num_requests), 8, 1500).astype(int)
    olens = np.clip(rng.lognormal(np.log(mean_output), 0.5, num_requests), 4, 500).astype(int)
    prompts = [rng.integers(1, 255, int(p)).tolist() for p in plens]
    return prompts, [int(o) for o in olens]


def run_llm(args: argparse.Namespace, timers: StepTimers) -> float:
    """Serve the workload through ``LLM.generate``; return the wall time in seconds."""
    from backplane import LLM, SamplingParams

    llm = LLM(**_engine_kwargs(args))
    prompts, olens = workload(args.requests, args.seed, args.prompt_len, args.output_len)
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=1.0) for o in olens]
    instrument(llm, timers)
    GC_PAUSES.on = True
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    GC_PAUSES.on = False
    assert [len(o.outputs[0].token_ids) for o in outs] == olens
    llm.shutdown()
    return wall


def run_async(args: argparse.Namespace, timers: StepTimers) -> float:
    """Serve the workload through ``AsyncLLM`` (every request at once); return the wall time."""
    from backplane import AsyncLLM, SamplingParams

    prompts, olens = workload(args.requests, args.seed, args.prompt_len, args.output_len)
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=1.0) for o in olens]

    async def main() -> float:
        engine = AsyncLLM(**_engine_kwargs(args))
        try:
            loop_obj = engine._replicas[0] if hasattr(engine, "_replicas") else engine._loop
            llm = loop_obj.llm
            # this thread runs the event loop, hence every reader
            instrument(llm, timers, time.pthread_getcpuclockid(threading.get_ident()))
            _wrap(loop_obj, "_deliver", "outputs", timers)
            _wrap(loop_obj, "_take_snapshot", "outputs", timers)

            async def one(i: int) -> int:
                # per output, what backplane bench throughput's readers do
                n = 0
                last: float | None = None
                gaps: list[float] = []
                async for out in engine.generate(prompts[i], params[i], request_id=f"r{i}"):
                    now = time.perf_counter()
                    k = len(out.new_token_ids)
                    if k:
                        if last is not None:
                            gaps.extend([(now - last) / k] * k)
                        last = now
                        n += k
                return n

            GC_PAUSES.on = True
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            wall = time.perf_counter() - t0
            GC_PAUSES.on = False
            assert list(counts) == olens
            return wall
        finally:
            engine.shutdown()

    return asyncio.run(main())


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "device": "cpu",
        "max_num_seqs": args.max_num_seqs,
        "max_num_tokens": args.max_num_tokens,
        "kv_memory": args.kv_memory,
        "seed": args.seed,
    }


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, run the workload, print ms per step per component.

    :param argv: command-line arguments (default: ``sys.argv``).
    :return: the exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--path", choices=("llm", "async"), default="llm")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--kv-memory", default="2GiB")
    parser.add_argument("--min-seqs", type=int, default=None, help="default: max-num-seqs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: the engine thread's CPU time (steady on a machine shared with other "
        "work, where wall time also counts the time other processes hold the core); "
        "wall: perf_counter",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    global _clock, GC_PAUSES
    _clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    GC_PAUSES = GCPauses()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    timers = StepTimers(args.min_seqs or args.max_num_seqs)
    import gc

    gc.callbacks.append(GC_PAUSES)
    try:
        wall = (run_llm if args.path == "llm" else run_async)(args, timers)
    finally:
        gc.callbacks.remove(GC_PAUSES)
    summary = timers.summary()
    pauses = GC_PAUSES.summary(timers.num_steps)
    if args.json:
        record = {"path": args.path, "wall_s": wall, "per_step_ms": summary, "gc_ms": pauses}
        logger.info(json.dumps(record, indent=1))
        return 0
    cols = (*HOST_PARTS, "host", EXCLUDED)
    lines = [f"path={args.path} wall={wall:.1f}s  (ms per step, {args.clock} clock)"]
    lines.append(f"{'kind':8s}{'steps':>7s}" + "".join(f"{c:>16s}" for c in cols))
    for kind, row in summary.items():
        vals = "".join(f"{row.get(c, 0.0):16.3f}" for c in cols)
        lines.append(f"{kind:8s}{int(row['steps']):7d}{vals}")
    lines.append(
        f"gc pauses, every thread (ms per step, mean over {timers.num_steps} steps): young "
        f"{pauses['young']:.3f}, full {pauses['full']:.3f} ({pauses['full_passes']} full passes)"
    )
    logger.info("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
