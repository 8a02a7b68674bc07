"""Tensor-parallel faults and exit on the CPU: the watchdog, and a process that never shut down.

A NCCL collective whose peer died waits for it forever; the executor's
watchdog sees the worker process end and aborts the group so the driver's
step returns and names the rank. On the CPU (gloo notices a dead peer by
itself) the collective that would hang is simulated: the driver's step
blocks until the group is aborted. Then the exit: a process that used a
two-rank :class:`~backplane.AsyncLLM` and never shut it down exits with
status 0, its process group destroyed before torch's own teardown and its
worker process gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from process_helpers import alive as _alive

from backplane import LLM, SamplingParams
from backplane.engine.distributed import WorkerFailedError, multiproc

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: what the simulated collective waits at most without the watchdog (the test fails sooner)
HANG_S = 120.0


def _tp_llm(**kw: Any) -> LLM:
    return LLM("tiny-llama", device="cpu", threads=1, tensor_parallel_size=2, **kw)


def _kill_once(entered: threading.Event, pid: int) -> None:
    """Kill process ``pid`` from another thread once ``entered`` is set."""
    threading.Thread(
        target=lambda: entered.wait(HANG_S) and os.kill(pid, signal.SIGKILL), daemon=True
    ).start()


def test_watchdog_ends_a_collective_waiting_for_a_dead_rank(monkeypatch):
    aborted = threading.Event()
    monkeypatch.setattr(multiproc, "abort_group", aborted.set)
    llm = _tp_llm()
    executor = llm.engine.executor
    (pid,) = executor.worker_pids
    entered = threading.Event()
    real_execute = executor.driver.execute_model

    def hanging_execute(inputs: Any) -> Any:
        # a collective whose peer died: it returns only when the group is aborted
        entered.set()
        if aborted.wait(HANG_S):
            raise RuntimeError("the communicator was aborted")
        return real_execute(inputs)

    monkeypatch.setattr(executor.driver, "execute_model", hanging_execute)
    _kill_once(entered, pid)
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerFailedError, match=r"rank 1 died \(exit code -9\)") as info:
            llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3))
        waited = time.monotonic() - t0
        assert aborted.is_set(), "the watchdog did not abort the group"
        assert waited < 30, f"the step waited {waited:.0f} s for the dead rank"
        assert info.value.rank == 1
        assert not _alive(pid)
    finally:
        llm.shutdown()
        import leaks

        leaks.forget_all()


class _AbortableAllReduce:
    """The host side of a small all-reduce that waits on the device (the one-shot
    kernel): it takes no message here (gloo sums them all), only the abort."""

    def __init__(self) -> None:
        self.stop = threading.Event()

    def fits(self, x: Any) -> bool:
        return False

    def __call__(self, x: Any) -> None:
        raise AssertionError("no message fits")

    def abort(self) -> None:
        self.stop.set()

    @property
    def aborted(self) -> bool:
        return self.stop.is_set()


def test_a_step_whose_all_reduce_was_aborted_is_refused_naming_the_dead_rank(monkeypatch):
    """A one-shot all-reduce waiting for a dead peer is aborted by the watchdog and returns
    without raising (the device goes on with a sum that is not one); the step's token must
    not reach the request: the engine ends naming the rank instead."""
    from backplane.core import parallel

    small = _AbortableAllReduce()
    llm = _tp_llm(async_scheduling=False)
    executor = llm.engine.executor
    (pid,) = executor.worker_pids
    driver = executor.driver
    real_sample = driver.sample_tokens
    first: list[Any] = []
    entered = threading.Event()

    def sample(hidden: Any, inputs: Any, rows: Any) -> Any:
        if not first:
            first.append(real_sample(hidden, inputs, rows))
            return first[0]
        # the decode step: its all-reduce waits on the device for the dead peer while
        # the host has gone on (launches return at once); aborted, the device finishes
        # the step with what is in the buffers: here, the prefill's tokens
        entered.set()
        small.stop.wait(HANG_S)
        return first[0]

    monkeypatch.setattr(driver, "sample_tokens", sample)
    parallel.set_small_all_reduce(small)
    _kill_once(entered, pid)
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerFailedError, match=r"rank 1 died \(exit code -9\)") as info:
            llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert small.aborted, "the watchdog did not abort the small all-reduce"
        assert time.monotonic() - t0 < 30
        assert info.value.rank == 1
        assert not _alive(pid)
    finally:
        parallel.set_small_all_reduce(None)
        llm.shutdown()
        import leaks

        leaks.forget_all()


def test_watchdog_leaves_a_clean_shutdown_alone(monkeypatch):
    aborted = threading.Event()
    monkeypatch.setattr(multiproc, "abort_group", aborted.set)
    llm = _tp_llm()
    try:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out[0].token_ids) == 2
    finally:
        llm.shutdown()
    time.sleep(2 * multiproc.WATCH_INTERVAL)
    assert not aborted.is_set()


def test_async_engine_never_shut_down_exits_cleanly(tmp_path):
    script = tmp_path / "use_and_leave.py"
    script.write_text(
        "import asyncio, atexit\n"
        "import torch.distributed as dist\n"
        "from backplane import AsyncLLM, SamplingParams\n"
        "\n"
        "def report():\n"
        "    # registered before the engine: runs after the engine's exit hook\n"
        "    print('group alive at exit:', dist.is_initialized(), flush=True)\n"
        "\n"
        "async def use(engine):\n"
        "    last = None\n"
        "    params = SamplingParams(max_tokens=3, ignore_eos=True)\n"
        "    async for out in engine.generate([1, 2, 3], params, request_id='r'):\n"
        "        last = out\n"
        "    print('tokens:', len(last.outputs[0].token_ids), flush=True)\n"
        "\n"
        "if __name__ == '__main__':\n"
        "    atexit.register(report)\n"
        "    engine = AsyncLLM('tiny-llama', device='cpu', threads=1, tensor_parallel_size=2)\n"
        "    print('worker:', engine.llm.engine.executor.worker_pids[0], flush=True)\n"
        "    asyncio.run(use(engine))\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert lines["tokens"] == "3"
    assert lines["group alive at exit"] == "False", proc.stdout
    worker = int(lines["worker"])
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


def test_a_worker_that_loaded_weights_leaves_no_semaphore_behind(tmp_path):
    """A worker's progress bars lock with a thread lock: a multiprocessing one, made when the
    weight loader's bar starts, would outlive the worker's ``os._exit`` and the resource
    tracker would warn of a leaked semaphore when the driver exits."""
    import torch

    from backplane.cli.bench.latency.shapes import shape_config
    from backplane.cli.bench.latency.weights import save_random_weights

    folder = tmp_path / "tiny-llama"
    save_random_weights("tiny-llama", shape_config("tiny-llama"), folder, torch.float32)
    script = tmp_path / "load_and_leave.py"
    script.write_text(
        "import sys\n"
        "from backplane import LLM, SamplingParams\n"
        "\n"
        "if __name__ == '__main__':\n"
        "    llm = LLM(sys.argv[1], device='cpu', threads=1, tensor_parallel_size=2)\n"
        "    params = SamplingParams(max_tokens=2, ignore_eos=True)\n"
        "    out = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0]\n"
        "    print('tokens:', len(out.token_ids), flush=True)\n"
        "    llm.shutdown()\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script), str(folder)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens: 2" in proc.stdout
    assert "leaked semaphore" not in proc.stderr, proc.stderr[-3000:]
