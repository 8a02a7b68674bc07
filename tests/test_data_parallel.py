"""Data-parallel replicas: the balancer, the replicas' devices, and DP=2 through AsyncLLM and the server.

The engine tests run two replicas of ``tiny-llama`` on the CPU in this
process; their greedy outputs are compared with one offline :class:`LLM` of
the same configuration (DP=1).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from backplane.api.balancing import LoadBalancer
from backplane.api.data_parallel import replica_configs
from backplane.core.errors import ConfigError, InvalidFieldError
from backplane.engine.config import EngineConfig

CONFIG = dict(
    device="cpu",
    max_num_seqs=4,
    max_num_tokens=32,
    page_size=4,
    num_kv_pages=128,
    threads=1,
    seed=0,
)
PROMPTS = [f"replica prompt {i}" for i in range(8)]


def greedy(n: int = 6, **kw):
    from backplane import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


# -- the balancer ----------------------------------------------------------------------------


class _ReferenceBalancer:
    """The rule written out plainly: scan the replicas from the one after the last
    choice, keep the first with the strictly smallest load."""

    def __init__(self, n: int) -> None:
        self.loads = [0] * n
        self.owner: dict[str, int] = {}
        self.last = -1

    def assign(self, rid: str) -> int:
        n = len(self.loads)
        best = None
        for step in range(1, n + 1):
            i = (self.last + step) % n
            if best is None or self.loads[i] < self.loads[best]:
                best = i
        self.loads[best] += 1
        self.owner[rid] = best
        self.last = best
        return best

    def release(self, rid: str) -> None:
        if rid in self.owner:
            self.loads[self.owner.pop(rid)] -= 1


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_balancer_follows_the_rule_over_random_traffic(n):
    rng = random.Random(n)
    got, ref = LoadBalancer(n), _ReferenceBalancer(n)
    live: list[str] = []
    for k in range(400):
        if live and rng.random() < 0.45:
            rid = live.pop(rng.randrange(len(live)))
            got.release(rid)
            ref.release(rid)
        else:
            rid = f"r{k}"
            live.append(rid)
            assert got.assign(rid) == ref.assign(rid)
        assert got.loads() == ref.loads
    for rid in live:
        assert got.owner(rid) == ref.owner[rid]


def test_balancer_prefers_the_least_loaded_then_goes_round_robin():
    bal = LoadBalancer(3)
    first = [bal.assign(f"a{i}") for i in range(3)]
    assert sorted(first) == [0, 1, 2]  # an equal start: each replica once
    for rid in ("a0", "a1"):
        bal.release(rid)
    # the two replicas just emptied are the least loaded, whatever the rotation says
    emptied = {first[0], first[1]}
    assert {bal.assign("b0"), bal.assign("b1")} == emptied
    assert sorted(bal.loads()) == [1, 1, 1]


def test_balancer_refuses_a_live_id_and_frees_it_on_release():
    bal = LoadBalancer(2)
    bal.assign("same")
    with pytest.raises(InvalidFieldError, match="already in use") as exc:
        bal.assign("same")
    assert exc.value.field == "request_id"
    bal.release("same")
    bal.release("same")  # a second end of the same request changes nothing
    assert bal.loads() == [0, 0] and bal.owner("same") is None
    bal.assign("same")


def test_balancer_is_exact_under_concurrent_callers():
    bal = LoadBalancer(4)

    def worker(t: int) -> None:
        for i in range(500):
            rid = f"{t}-{i}"
            bal.assign(rid)
            if i % 2:
                bal.release(rid)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loads = bal.loads()
    assert sum(loads) == 4 * 250  # the even-numbered ones stay live
    assert max(loads) - min(loads) <= 1


# -- the replicas' configurations --------------------------------------------------------------


def test_one_replica_keeps_the_configuration():
    config = EngineConfig(**CONFIG)
    assert replica_configs(config) == [config]


def test_cpu_replicas_share_the_cores(monkeypatch):
    import backplane.api.data_parallel as dp

    monkeypatch.setattr(dp, "available_cores", lambda: 7)
    cpu = {k: v for k, v in CONFIG.items() if k != "threads"}
    configs = replica_configs(EngineConfig(**cpu, data_parallel_size=3))
    assert [c.device for c in configs] == ["cpu"] * 3
    assert [c.threads for c in configs] == [7 // 3] * 3
    assert all(c.data_parallel_size == 1 for c in configs)
    # threads set by the user are kept
    configs = replica_configs(EngineConfig(**CONFIG, data_parallel_size=2))
    assert [c.threads for c in configs] == [CONFIG["threads"]] * 2


@pytest.mark.parametrize(("device", "dp"), [("cuda", 4), ("cuda:1", 2), ("cuda:3", 5)])
def test_cuda_replicas_take_consecutive_devices(monkeypatch, device, dp):
    import backplane.api.data_parallel as dpm

    monkeypatch.setattr(dpm, "_cuda_device_count", lambda: 8)
    config = EngineConfig(device=device, data_parallel_size=dp)
    base = int(device.partition(":")[2] or 0)
    expected = [f"cuda:{base + i}" for i in range(dp)]
    configs = replica_configs(config)
    assert [c.device for c in configs] == expected
    assert all(c.data_parallel_size == 1 for c in configs)


@pytest.mark.parametrize(("device", "dp", "tp"), [("cuda", 2, 2), ("cuda:2", 3, 2), ("cuda", 2, 4)])
def test_cuda_replicas_with_tensor_parallel_ranks_take_a_block_of_devices(
    monkeypatch, device, dp, tp
):
    import backplane.api.data_parallel as dpm

    monkeypatch.setattr(dpm, "_cuda_device_count", lambda: 8)
    config = EngineConfig(device=device, data_parallel_size=dp, tensor_parallel_size=tp)
    base = int(device.partition(":")[2] or 0)
    configs = replica_configs(config)
    # replica i's ranks take cuda:base + i*tp .. base + i*tp + tp - 1
    assert [c.device for c in configs] == [f"cuda:{base + i * tp}" for i in range(dp)]
    assert all(c.tensor_parallel_size == tp for c in configs)
    with pytest.raises(ConfigError, match="need GPUs up to cuda:9"):
        replica_configs(EngineConfig(device="cuda:2", data_parallel_size=2, tensor_parallel_size=4))


def test_cpu_replicas_with_ranks_share_the_cores_among_all_ranks(monkeypatch):
    import backplane.api.data_parallel as dp

    monkeypatch.setattr(dp, "available_cores", lambda: 16)
    cpu = {k: v for k, v in CONFIG.items() if k != "threads"}
    configs = replica_configs(EngineConfig(**cpu, data_parallel_size=2, tensor_parallel_size=2))
    assert [c.threads for c in configs] == [16 // 4] * 2


def test_too_few_gpus_is_a_clear_error(monkeypatch):
    import backplane.api.data_parallel as dpm

    monkeypatch.setattr(dpm, "_cuda_device_count", lambda: 2)
    config = EngineConfig(device="cuda:1", data_parallel_size=2)
    with pytest.raises(ConfigError, match="data_parallel_size") as exc:
        replica_configs(config)
    assert "this machine has 2" in str(exc.value) and "cuda:2" in str(exc.value)


def test_data_parallel_size_from_flags_and_yaml(tmp_path):
    import argparse

    from backplane.cli.options import add_engine_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert config_from_args(parser.parse_args(["-dp", "3"])).data_parallel_size == 3
    args = parser.parse_args(["--data-parallel-size", "2"])
    assert config_from_args(args).data_parallel_size == 2
    path = tmp_path / "e.yaml"
    path.write_text("data_parallel_size: 4\n")
    assert EngineConfig.from_yaml(path).data_parallel_size == 4
    with pytest.raises(ConfigError, match="option --data-parallel-size"):
        config_from_args(parser.parse_args(["-dp", "0"]))


def test_an_llm_runs_one_engine_and_says_so(caplog):
    from backplane import LLM

    with caplog.at_level("WARNING", logger="backplane.api.llm"):
        llm = LLM("tiny-llama", data_parallel_size=2, **CONFIG)
    assert any("an LLM runs one engine" in r.getMessage() for r in caplog.records)
    assert len(llm.generate(["one engine"], greedy(2))[0].token_ids) == 2


# -- two replicas behind one AsyncLLM ----------------------------------------------------------


@pytest.fixture(scope="module")
def offline():
    from backplane import LLM

    return LLM("tiny-llama", **CONFIG)


@pytest.fixture(scope="module")
def engine():
    from backplane.api import AsyncLLM

    eng = AsyncLLM("tiny-llama", data_parallel_size=2, **CONFIG)
    yield eng
    eng.shutdown()


def wait_idle(engine, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snaps = engine.replica_snapshots()
        if all(s.running == 0 and s.waiting == 0 and s.kv_pages_used == 0 for s in snaps):
            return snaps
        time.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.replica_snapshots()}")


def test_a_replica_that_fails_to_start_releases_the_ones_built(monkeypatch):
    import backplane.api.async_llm as mod

    built = []
    real = mod.LLM

    class FailingSecond(real):
        def __init__(self, *args, **kw):
            if built:
                raise RuntimeError("injected start-up failure of replica 1")
            super().__init__(*args, **kw)
            built.append(self)

    monkeypatch.setattr(mod, "LLM", FailingSecond)
    with pytest.raises(RuntimeError, match="replica 1"):
        mod.AsyncLLM("tiny-llama", data_parallel_size=2, **CONFIG)
    (first,) = built
    with pytest.raises(Exception, match="shut down"):
        first.generate(["x"], greedy(1))


def test_two_replicas_are_two_engines(engine):
    assert engine.data_parallel_size == 2
    a, b = (r.llm.engine for r in engine._replicas)
    assert a is not b and a.kv_manager is not b.kv_manager


def test_concurrent_requests_use_both_replicas_and_match_one_engine(engine, offline):
    expected = [o.token_ids for o in offline.generate(PROMPTS, greedy(6))]
    before = [s.steps for s in engine.replica_snapshots()]

    async def main():
        async def one(prompt):
            return [o async for o in engine.generate(prompt, greedy(6))][-1]

        return await asyncio.gather(*(one(p) for p in PROMPTS))

    outs = asyncio.run(main())
    assert [o.token_ids for o in outs] == expected
    after = [s.steps for s in wait_idle(engine)]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    assert engine.snapshot().steps == sum(after)


def test_threads_and_coroutines_share_the_replicas(engine, offline):
    expected = [o.token_ids for o in offline.generate(PROMPTS[:4], greedy(5))]
    outs = engine.generate_sync(PROMPTS[:4], greedy(5))
    assert [o.token_ids for o in outs] == expected
    assert engine._balancer.loads() == [0, 0]


def test_abort_reaches_the_replica_holding_the_request(engine):
    finished: dict[str, str] = {}
    engine.add_finished_callback(lambda out: finished.setdefault(out.request_id, out.finish_reason))
    # two long requests land on different replicas (equal loads go round-robin)
    a = engine.submit([3, 4, 5, 6], greedy(400), request_id="dp-long-a")
    b = engine.submit([7, 8, 9, 10], greedy(400), request_id="dp-long-b")
    owners = {engine._balancer.owner("dp-long-a"), engine._balancer.owner("dp-long-b")}
    assert owners == {0, 1}
    next(a)
    next(b)
    held_by_b = engine._balancer.owner("dp-long-b")
    engine.abort("dp-long-a")
    deadline = time.monotonic() + 10
    while "dp-long-a" not in finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert finished.get("dp-long-a") == "abort"
    # the other replica's request still runs
    assert "dp-long-b" not in finished
    assert engine.replica_snapshots()[held_by_b].running == 1
    b.close()
    wait_idle(engine)
    assert finished.get("dp-long-b") == "abort"
    assert engine._balancer.loads() == [0, 0]


def test_a_live_id_is_refused_across_replicas(engine):
    with engine.submit([3, 4], greedy(300), request_id="dp-dup") as first:
        next(first)
        with pytest.raises(InvalidFieldError, match="already in use"):
            engine.submit([5, 6], greedy(2), request_id="dp-dup")
    wait_idle(engine)


# -- through the server ------------------------------------------------------------------------


def test_server_spreads_concurrent_requests_and_aggregates_metrics(engine, offline):
    pytest.importorskip("fastapi", reason="fastapi is not installed (pip install -e '.[dev]')")
    pytest.importorskip("prometheus_client", reason="prometheus_client is not installed")
    from fastapi.testclient import TestClient

    from backplane.server.app import build_app

    ids = [[5 + i, 6 + i, 7 + i] for i in range(6)]
    expected = [o.token_ids for o in offline.generate(ids, greedy(4))]
    before = [s.steps for s in engine.replica_snapshots()]
    app = build_app(engine, model_name="tiny")
    with TestClient(app) as client:

        def post(prompt):
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            return client.post("/v1/completions", json=body)

        results: list = [None] * len(ids)

        def run(i: int) -> None:
            results[i] = post(ids[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ids))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r.status_code == 200 for r in results), [r.text for r in results]
        texts = [r.json()["choices"][0]["text"] for r in results]
        assert texts == [offline.decode(list(e)) for e in expected]
        after = [s.steps for s in wait_idle(engine)]
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
        assert client.get("/health").status_code == 200
        metrics = client.get("/metrics").text
    per_replica = engine.replica_snapshots()[0].kv_pages_total
    line = next(
        ln for ln in metrics.splitlines() if ln.startswith("backplane_kv_cache_pages_total{")
    )
    assert float(line.rsplit(" ", 1)[1]) == 2 * per_replica


def test_serve_runs_two_replicas_from_the_command_line():
    pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install -e '.[dev]')")
    httpx = pytest.importorskip("httpx", reason="httpx is not installed")
    from server_helpers import running_server

    args = ["tiny-llama", "-dp", "2", "--device", "cpu", "--num-kv-pages", "64", "--threads", "1"]
    with running_server(args) as url:
        body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    line = next(
        ln for ln in metrics.splitlines() if ln.startswith("backplane_kv_cache_pages_total{")
    )
    from backplane import LLM

    one = LLM("tiny-llama", device="cpu", num_kv_pages=64, threads=1)
    assert float(line.rsplit(" ", 1)[1]) == 2 * one.engine.kv_manager.pool.num_usable
