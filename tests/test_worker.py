"""The engine reaches its device only through an executor and the worker interface."""

from __future__ import annotations

import numpy as np
import torch

from backplane.engine.config import EngineConfig
from backplane.engine.engine import Engine
from backplane.engine.executor import Executor, InProcessExecutor
from backplane.engine.sampling import SamplingParams, SamplingRows
from backplane.engine.worker import Worker
from backplane.engine.worker.device_worker import DeviceWorker
from backplane.engine.worker.graph.mode import GraphMode
from backplane.engine.worker.inputs import scratch_seq

SMALL = dict(
    model="tiny-llama",
    device="cpu",
    dtype="float32",
    max_num_seqs=4,
    max_num_tokens=32,
    max_model_len=64,
    page_size=4,
    num_kv_pages=40,
)


def test_engine_holds_an_executor_not_the_model_or_caches():
    engine = Engine(**SMALL)
    try:
        assert isinstance(engine.executor, Executor)
        assert isinstance(engine.executor.driver, Worker)
        held = vars(engine)
        for name in ("model", "caches", "runner", "input_batch", "sampler", "backends"):
            assert name not in held, name
        worker = engine.executor.driver
        assert engine.model is worker.model and engine.caches is worker.caches
        assert engine.num_pages == worker.num_pages == 40
    finally:
        engine.shutdown()
    assert engine.model is None and engine.caches is None


def test_worker_start_up_and_one_step_through_its_methods():
    """The calls a multi-process executor would make, in order, give a step whose token is
    the argmax of the model's own logits for the prompt's last position."""
    config = EngineConfig.from_dict(SMALL)
    worker = DeviceWorker(config)
    worker.load_model()
    assert worker.graph_mode is GraphMode.OFF  # CPU
    pages = worker.determine_num_kv_pages()
    assert pages == 40
    worker.initialize_cache(pages)
    paged = worker.paged_cache_tensors()
    assert paged and all(t.shape[0] == pages for t in paged)
    worker.compile_or_warm_up_model()
    seq = scratch_seq(6, 0, worker.page_size)
    seq.is_prefill_chunk_final = True  # the step samples its last position
    seq.request.token_buffer[:] = np.arange(3, 3 + len(seq.request.token_buffer))
    inputs = worker.prepare_inputs([seq])
    hidden = worker.execute_model(inputs)
    greedy = SamplingParams(temperature=0.0)
    rows = SamplingRows([greedy], np.zeros(1, np.int64), np.zeros(1, np.int64))
    out = worker.sample_tokens(hidden, inputs, rows)
    # greedy: the argmax of the LM head's logits at the prompt's last position
    with torch.inference_mode():
        logits = worker.model.compute_logits(hidden[5:6])
    assert out.tokens.tolist() == [int(logits.argmax())]
    worker.shutdown()
    assert worker.model is None and worker.runner is None


def test_in_process_executor_runs_the_start_up_sequence():
    executor = InProcessExecutor(EngineConfig.from_dict(SMALL))
    try:
        worker = executor.driver
        assert executor.num_pages == worker.num_pages == 40
        assert worker.runner is not None and worker.caches
    finally:
        executor.shutdown()
