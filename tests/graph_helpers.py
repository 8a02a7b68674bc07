"""Shared by the tests of the CUDA-graph runner: building one over an engine, and
comparing an engine with and without graphs."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from backplane.engine.worker.graph.mode import GraphMode
from backplane.engine.worker.graph.runner import GraphModelRunner


def graph_runner_for(
    engine: Any,
    *,
    max_num_tokens: int,
    max_num_seqs: int,
    mode: GraphMode = GraphMode.FULL_AND_PIECEWISE,
    **kwargs: Any,
) -> GraphModelRunner:
    """A graph runner over an existing engine's model, backends and input batch (not captured).

    :param engine: the :class:`~backplane.engine.engine.Engine` whose model it runs.
    :param max_num_tokens: the runner's token budget.
    :param max_num_seqs: its sequence budget.
    :param mode: the CUDA-graph mode (on a CPU engine the graphs are eager stand-ins).
    :param kwargs: further ``GraphModelRunner`` arguments (buckets, ``sampler``).
    :return: the runner.
    """
    return GraphModelRunner(
        engine.model,
        engine.backends,
        engine.input_batch,
        mode=mode,
        max_num_tokens=max_num_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=engine.max_model_len,
        page_size=engine.page_size,
        **kwargs,
    )


def generate_eager_and_graphed(
    model: str,
    backends: dict[str, str],
    *,
    dtype: str,
    prompt_lens: tuple[int, ...],
    max_tokens: int,
    params: Any = None,
    **engine_kwargs: Any,
) -> dict[str, list[list[int]]]:
    """Tokens of the same prompts with ``cuda_graphs`` off and ``full_and_piecewise``.

    Asserts that no bucket's capture failed (a failed bucket would quietly run
    eagerly), sampling graphs included.

    :param model: a preset name or model directory.
    :param backends: family -> backend name.
    :param dtype: the model dtype.
    :param prompt_lens: one random prompt of each length.
    :param max_tokens: tokens generated per prompt (greedy unless ``params`` is given).
    :param params: ``SamplingParams`` for every prompt, or one per prompt.
    :param engine_kwargs: further engine options (``quantization``, ``kv_cache_dtype`` ...).
    :return: ``{"off": ..., "full_and_piecewise": ...}``, the token ids per prompt.
    """
    from backplane import LLM, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, size=int(n)).tolist() for n in prompt_lens]
    if params is None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results = {}
    for mode in ("off", "full_and_piecewise"):
        llm = LLM(
            model,
            device="cuda",
            dtype=dtype,
            max_num_seqs=4,
            max_num_tokens=64,
            max_model_len=128,
            # a few pages suffice; sizing from free memory would meet the
            # memory another engine of the test module still holds
            kv_memory="256MiB",
            cuda_graphs=mode,
            backends=backends,
            **engine_kwargs,
        )
        if mode != "off":
            runner = llm.engine.runner
            assert runner.piecewise.failed == {} and runner.decode.failed == {}
            assert all(runner.head.has(b) for b in runner.decode.graphs)
        results[mode] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    return results
