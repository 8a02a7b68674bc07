"""Tensor parallelism on the CPU: two ranks (two processes over gloo) against independent references.

Greedy output of ``tensor_parallel_size=2`` is checked against transformers
(the same tiny random checkpoints as the end-to-end tests, recomputing each
sequence from scratch) for every architecture, with prefix caching,
preemption (a KV cache too small for the batch) and the host tier where the
model has one; then the configuration plumbing and the fault handling
(a worker process that dies or raises ends the engine naming its rank, and
no process is left behind).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import threading
import time
from typing import Any

import pytest

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
import numpy as np  # noqa: E402
import test_e2e  # noqa: E402
from process_helpers import alive as _alive
from test_batch import PAGE as BATCH_PAGE  # noqa: E402
from test_batch import random_batch  # noqa: E402
from test_e2e import ARCHS, assert_matches, hf_greedy, make_requests  # noqa: E402

from backplane import LLM, SamplingParams  # noqa: E402
from backplane.core.errors import ConfigError, EngineFailedError  # noqa: E402
from backplane.core.metadata import HostBatch  # noqa: E402
from backplane.core.packing import build_batch_metadata  # noqa: E402
from backplane.engine.config import EngineConfig  # noqa: E402
from backplane.engine.distributed import WorkerFailedError  # noqa: E402
from backplane.engine.distributed.multiproc import MultiprocExecutor  # noqa: E402
from backplane.engine.worker.inputs import InputBatch  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: the end-to-end tests' checkpoints: one tiny random transformers model per architecture
hf_model = test_e2e.hf_model

PAGE = 4
VOCAB = hf_tiny.VOCAB


def _tp_llm(path: str, **kw: Any) -> LLM:
    """A two-rank engine on the CPU with the end-to-end tests' small limits."""
    settings: dict[str, Any] = dict(
        device="cpu",
        dtype="float32",
        page_size=PAGE,
        max_num_seqs=3,
        max_num_tokens=16,
        threads=1,
        tensor_parallel_size=2,
    )
    settings.update(kw)
    return LLM(path, **settings)


CASES = [
    pytest.param("llama", "0", id="llama"),
    pytest.param("llama", "64KiB", id="llama-host_tier"),
    pytest.param("qwen3", "0", id="qwen3"),
    pytest.param("deepseek_v3", "64KiB", id="deepseek_v3-host_tier"),
    # recurrent models: prefix reuse (and so the host tier) is off by design
    pytest.param("nemotron_h", "0", id="nemotron_h"),
    pytest.param("qwen3_next", "0", id="qwen3_next"),
    pytest.param("qwen3_5", "0", id="qwen3_5"),
]


@pytest.mark.parametrize("arch,host_kv", CASES)
def test_two_ranks_greedy_equals_transformers(hf_model, arch, host_kv):
    model, path = hf_model(arch)
    prompts, max_tokens = make_requests(seed=len(arch))
    llm = _tp_llm(path, num_kv_pages=11, host_kv_memory=host_kv)
    try:
        assert isinstance(llm.engine.executor, MultiprocExecutor)
        params = [
            SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens
        ]
        results = llm.generate(prompts, params)
        kv = llm.engine.kv_manager
        assert llm.engine.scheduler.stats.preemptions > 0, "the KV cache was meant to preempt"
        if not ARCHS[arch][3]:
            assert sum(o.metrics.prompt_tokens_reused for o in results) > 0
            if host_kv != "0":
                assert kv.stats.offloaded_pages > 0
                assert kv.stats.onboarded_pages > 0, "no host page came back: the tier untested"
        ties = 0
        for i, (p, m, out) in enumerate(zip(prompts, max_tokens, results, strict=True)):
            want, margins = hf_greedy(arch, model, p, m)
            ties += assert_matches(out.token_ids, want, margins, f"{arch} TP=2 request {i}")
        assert ties <= 1, f"{ties} requests ended in near-ties: the comparison is too weak"
    finally:
        llm.shutdown()


def test_two_ranks_sampling_equals_one_rank(hf_model):
    """Seeded sampling (temperature, top-k) gives the same tokens on two ranks as on one."""
    _, path = hf_model("llama")
    prompts, _ = make_requests(seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    one = LLM(path, device="cpu", dtype="float32", page_size=PAGE, max_num_seqs=3, threads=1)
    try:
        want = [o.token_ids for o in one.generate(prompts[:4], params)]
    finally:
        one.shutdown()
    llm = _tp_llm(path)
    try:
        got = [o.token_ids for o in llm.generate(prompts[:4], params)]
    finally:
        llm.shutdown()
    assert got == want


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.mark.parametrize(
    "arch,method,pages",
    [
        ("llama", "ngram", None),
        # a cache too small for the batch: requests are preempted and recompute
        ("llama", "ngram", 14),
        ("nemotron_h", "ngram", None),
        ("nemotron_h", "draft_model", None),
    ],
)
def test_two_ranks_speculating_give_the_greedy_tokens_of_one_rank(hf_model, arch, method, pages):
    """Speculation on two ranks: every rank verifies (the LM head over the draft rows, and
    for a recurrent model the state kept at the last accepted token), a draft model runs
    whole on the driver, and the greedy tokens are those of one rank decoding without
    speculation, with preemption too."""
    _, path = hf_model(arch)
    rng = np.random.default_rng(11)
    base = rng.integers(1, VOCAB, size=7).tolist()
    # repeated text, so prompt lookup finds drafts and some are accepted
    prompts = [base * 3, (base[2:] + base) * 2, rng.integers(1, VOCAB, size=6).tolist()]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    one = LLM(path, device="cpu", dtype="float32", page_size=PAGE, max_num_seqs=3, threads=1)
    try:
        want = [o.token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    finally:
        one.shutdown()
    # the draft model is the target itself: it proposes what the target will accept
    spec = NGRAM if method == "ngram" else {"method": method, "model": path}
    kw = {} if pages is None else {"num_kv_pages": pages, "enable_prefix_caching": True}
    llm = _tp_llm(path, speculative_config={**spec, "num_speculative_tokens": 3}, **kw)
    try:
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.spec.stats
        preemptions = llm.engine.scheduler.stats.preemptions
    finally:
        llm.shutdown()
    assert stats.verified_seqs > 0 and stats.draft_tokens > 0, "nothing was verified"
    if pages is not None:
        assert preemptions > 0, "the small cache preempted nothing"
    if method == "draft_model":
        assert stats.accepted_tokens > 0, "the target's own drafts were all rejected"
    assert got == want


def test_mtp_is_refused_on_two_ranks_before_any_worker_starts(hf_model):
    _, path = hf_model("deepseek_v3")
    with pytest.raises(ConfigError, match="method='mtp' is not supported with tensor_parallel"):
        _tp_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_worker_killed_mid_run_ends_the_engine_naming_its_rank(hf_model):
    _, path = hf_model("llama")
    llm = _tp_llm(path)
    executor = llm.engine.executor
    (pid,) = executor.worker_pids
    try:
        stream = llm.stream([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=40, ignore_eos=True))
        next(stream)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerFailedError, match=r"rank 1 died \(exit code -9\)") as info:
            for _ in stream:
                pass
        assert info.value.rank == 1
        assert isinstance(info.value, EngineFailedError)
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)
        # the engine stays ended: the next step says why again, it does not hang
        with pytest.raises(WorkerFailedError, match="rank 1"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()
        _forget_unfinished()


def test_worker_that_raises_ends_the_engine_and_no_process_is_left(hf_model):
    _, path = hf_model("llama")
    llm = _tp_llm(path)
    executor = llm.engine.executor
    (pid,) = executor.worker_pids
    try:
        # a command the worker does not know makes it raise, as a failing kernel would
        executor._send_all("no-such-command")
        with pytest.raises(WorkerFailedError, match="rank 1 raised ValueError: unknown worker"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)
    finally:
        llm.shutdown()
        _forget_unfinished()


def test_shutdown_ends_every_worker_process(hf_model):
    _, path = hf_model("llama")
    llm = _tp_llm(path)
    pids = llm.engine.executor.worker_pids
    assert pids and all(_alive(p) for p in pids)
    llm.shutdown()
    assert not any(_alive(p) for p in pids)


def _forget_unfinished() -> None:
    """Forget the requests an ended engine could not finish (they can never run now)."""
    import leaks

    leaks.forget_all()


def test_tensor_parallel_size_from_yaml_and_flags(tmp_path):
    from backplane.cli.options import add_engine_arguments, config_from_args

    f = tmp_path / "engine.yaml"
    f.write_text("model: tiny-llama\ntensor_parallel_size: 4\ndistributed_executor_backend: mp\n")
    assert EngineConfig.from_yaml(str(f)).tensor_parallel_size == 4
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert config_from_args(parser.parse_args(["-tp", "2"])).tensor_parallel_size == 2
    args = parser.parse_args(["--config", str(f), "--tensor-parallel-size", "8"])
    assert config_from_args(args).tensor_parallel_size == 8
    assert EngineConfig().tensor_parallel_size == 1


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:2"])
def test_each_rank_takes_its_device_and_an_even_share_of_the_cores(monkeypatch, device):
    import backplane.engine.distributed.group as group

    monkeypatch.setattr(group.torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(group, "available_cores", lambda: 32)
    config = EngineConfig(device=device, tensor_parallel_size=4)
    ranks = [group.rank_config(config, r) for r in range(4)]
    base = int(device.partition(":")[2] or 0)
    want = ["cpu"] * 4 if device == "cpu" else [f"cuda:{base + r}" for r in range(4)]
    assert [c.device for c in ranks] == want
    # four ranks' intra-op threads on 32 cores: eight each, on a GPU too
    assert [c.threads for c in ranks] == [8] * 4
    # a count the user set is kept
    assert group.rank_config(config.merge(threads=3), 1).threads == 3


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("tensor_parallel_size", 0, "expected an integer >= 1"),
        ("distributed_executor_backend", "threads", "expected one of mp"),
    ],
)
def test_bad_parallel_settings_are_refused(key, value, message):
    with pytest.raises(ConfigError, match=f"{key}.*{message}"):
        EngineConfig.from_dict({key: value})


def test_server_answers_503_and_exits_with_an_error_when_a_worker_dies(hf_model):
    for module in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(module)
    import httpx
    from server_helpers import free_port

    from backplane.api.async_llm import AsyncLLM
    from backplane.server.run import run_server

    _, path = hf_model("llama")
    engine = AsyncLLM(
        path, device="cpu", dtype="float32", page_size=PAGE, threads=1, tensor_parallel_size=2
    )
    (pid,) = engine.llm.engine.executor.worker_pids
    port = free_port()
    ended: list[BaseException | None] = []

    def serve() -> None:
        try:
            run_server(engine, model_name="tiny", port=port)
            ended.append(None)
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 30, "ignore_eos": True}
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    os.kill(pid, signal.SIGKILL)
    # the request that meets the dead worker ends the engine loop; later ones get 503
    statuses = [httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code]
    statuses.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code)
    assert statuses[-1] == 503, statuses
    assert httpx.get(f"{url}/health", timeout=5).status_code == 503
    thread.join(30)
    assert not thread.is_alive(), "the server kept running with a dead engine"
    assert len(ended) == 1 and isinstance(ended[0], EngineFailedError), ended
    assert not _alive(pid)
    _forget_unfinished()


@pytest.mark.parametrize("shape", [(0, 5), (3, 6), (4, 0)], ids=["decode", "mixed", "prefill"])
@pytest.mark.parametrize("padded", [None, 96])
def test_adopted_step_equals_the_batch_metadata_reference(shape, padded):
    """A rank that adopts the driver's packed step gets the step the packer's reference builds,
    in its own buffers (the driver's are overwritten by the next step)."""
    rng = np.random.default_rng(sum(shape))
    seqs = random_batch(rng, n_prefill=shape[0], n_decode=shape[1], extra_pages=True)
    limits = dict(max_num_tokens=128, max_num_seqs=16, max_pages_per_seq=32, page_size=BATCH_PAGE)
    driver, other = InputBatch(**limits), InputBatch(**limits)
    # the adopting batch held another step before: nothing of it may leak into this one
    other.prepare(random_batch(rng, n_prefill=2, n_decode=3, extra_pages=False))
    driver.prepare(seqs, padded_num_tokens=padded)
    step = driver.last_step
    got = other.adopt(step, driver.step_bytes(step, device=False).numpy().copy())
    driver.prepare(random_batch(rng, n_prefill=1, n_decode=7, extra_pages=False))

    ref = build_batch_metadata(
        [s.num_new_tokens for s in seqs],
        [s.num_cached_tokens for s in seqs],
        [s.page_ids for s in seqs],
        BATCH_PAGE,
        state_slots=[s.state_slot for s in seqs],
        padded_num_tokens=padded,
    )
    md = got.metadata
    for name in ("num_prefill_seqs", "num_prefill_tokens", "num_decode_seqs", "padded_num_tokens"):
        assert getattr(md, name) == getattr(ref, name), name
    assert (md.max_query_len, md.max_seq_len) == (ref.max_query_len, ref.max_seq_len)
    for f in dataclasses.fields(HostBatch):
        want = getattr(ref.host, f.name)
        np.testing.assert_array_equal(getattr(md.host, f.name), want, err_msg=f.name)
        np.testing.assert_array_equal(getattr(md, f.name).numpy(), want, err_msg=f"dev {f.name}")
    expect_ids = np.concatenate(
        [
            s.request.token_buffer[s.num_cached_tokens : s.num_cached_tokens + s.num_new_tokens]
            for s in seqs
        ]
        + [np.zeros(md.padded_num_tokens - md.num_tokens, np.int32)]
    )
    np.testing.assert_array_equal(got.input_ids.numpy(), expect_ids)
    rows = [i for i, s in enumerate(seqs) if s.is_prefill_chunk_final]
    np.testing.assert_array_equal(got.sample_seqs, rows)
    np.testing.assert_array_equal(got.logits_indices.numpy(), ref.host.last_token_indices[rows])
    own = other.step_bytes(step, device=True)
    assert own.data_ptr() <= got.input_ids.data_ptr() < own.data_ptr() + own.numel()


def test_adopting_a_step_too_large_for_the_buffers_is_refused():
    rng = np.random.default_rng(0)
    big = InputBatch(
        max_num_tokens=128, max_num_seqs=16, max_pages_per_seq=32, page_size=BATCH_PAGE
    )
    small = InputBatch(max_num_tokens=8, max_num_seqs=2, max_pages_per_seq=4, page_size=BATCH_PAGE)
    big.prepare(random_batch(rng, n_prefill=3, n_decode=6, extra_pages=False))
    step = big.last_step
    with pytest.raises(ValueError, match="every rank must use the same limits"):
        small.adopt(step, big.step_bytes(step, device=False).numpy().copy())


def _child_ends_with_its_killed_parent(script, ready: bool = False) -> bool:
    """Run ``script`` (it prints its child's pid, then, with ``ready``, the child prints
    ``ready``, then it waits on stdin), kill it, and say whether the child ended within 20 s."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        pid = int(proc.stdout.readline())
        if ready:
            assert proc.stdout.readline().strip() == "ready"
        assert _alive(pid)
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 20
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        return not _alive(pid)
    finally:
        proc.kill()


def test_worker_ends_when_the_engine_process_is_killed(tmp_path):
    """A worker outlives no engine: killed with its driver's process, it exits on its own."""

    script = tmp_path / "driver.py"
    script.write_text(
        "import sys\n"
        "from backplane import LLM\n"
        "if __name__ == '__main__':\n"
        "    llm = LLM('tiny-llama', device='cpu', threads=1, tensor_parallel_size=2)\n"
        "    print(llm.engine.executor.worker_pids[0], flush=True)\n"
        "    sys.stdin.read()\n"
    )
    assert _child_ends_with_its_killed_parent(script), (
        "the worker kept running after its engine's process was killed"
    )


class _LiveProcess:
    """Stands in for a worker process that stays alive."""

    pid = 0
    exitcode = None

    def is_alive(self) -> bool:
        return True


def test_start_up_answers_that_arrive_out_of_rank_order_are_all_read(monkeypatch):
    """Rank 2 answers before rank 1: looking for failures while waiting for rank 1
    must keep rank 2's answer for its reader, not drop it (the driver then waited
    for it until the start-up timeout)."""
    import multiprocessing

    import backplane.engine.distributed.multiproc as mpx
    from backplane.engine.distributed.multiproc import RankProcess

    monkeypatch.setattr(mpx, "START_TIMEOUT", 5.0)
    links = [multiprocessing.Pipe() for _ in range(3)]
    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor._procs = [RankProcess(r + 1, _LiveProcess(), links[r][0]) for r in range(3)]
    links[2][1].send(("ok", 30))
    links[1][1].send(("ok", 20))
    threading.Timer(0.5, links[0][1].send, args=(("ok", 10),)).start()
    assert executor._answers() == [10, 20, 30]


def test_a_worker_blocked_in_a_collective_ends_when_its_driver_is_killed(tmp_path):
    """A worker stuck in a collective never reads its pipe again; the orphan watch ends it."""

    script = tmp_path / "driver.py"
    script.write_text(
        "import os, sys, time\n"
        "import torch.multiprocessing as mp\n"
        "from backplane.engine.distributed.worker_proc import _exit_when_orphaned\n"
        "def child(driver):\n"
        "    import threading\n"
        "    threading.Thread(target=_exit_when_orphaned, args=(1, driver), daemon=True).start()\n"
        "    print('ready', flush=True)\n"
        "    while True:\n"
        "        time.sleep(0.01)  # stands in for a collective that never returns\n"
        "if __name__ == '__main__':\n"
        "    p = mp.get_context('spawn').Process(target=child, args=(os.getpid(),))\n"
        "    p.start()\n"
        "    print(p.pid, flush=True)\n"
        "    sys.stdin.read()\n"
    )
    assert _child_ends_with_its_killed_parent(script, ready=True), (
        "the blocked worker kept running after its driver was killed"
    )
