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
    killer = threading.Thread(
        target=lambda: entered.wait(HANG_S) and os.kill(pid, signal.SIGKILL), daemon=True
    )
    killer.start()
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
