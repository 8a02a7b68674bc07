"""Inter-token gaps are never negative: offline, through ``RequestOutput.metrics``, and on /metrics.

A request's gaps come from the commit time of each generated token. With
asynchronous scheduling the next token's place is reserved before the current
token's output is read, so a request that a stop string ends has a placeholder
that was never committed; its gaps must not count it.
"""

from __future__ import annotations

import pytest
import torch

from backplane.engine.request import Request
from backplane.engine.sampling import SamplingParams

CONFIG = dict(device="cpu", max_num_seqs=4, max_num_tokens=32, page_size=4, num_kv_pages=128)
PROMPT = "xyz 123"


def _a_stop_string(text: str) -> str:
    """Two printable ASCII characters from the middle of ``text`` (the random model writes
    mostly bytes that are not text), so a stop string matches before the length limit."""
    for i in range(3, len(text) - 1):
        if text[i : i + 2].isprintable() and text[i : i + 2].isascii():
            return text[i : i + 2]
    raise AssertionError(f"no printable pair in {text!r}")


def _greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    from backplane import LLM

    yield LLM("tiny-llama", **CONFIG)
    torch.set_num_threads(prev)


def test_a_pending_placeholder_has_no_commit_time():
    r = Request("a", [1, 2, 3], _greedy(8))
    r.append_token(7, now=10.0)
    r.append_token(8, now=10.5)
    r.append_placeholder()  # the next token is being sampled
    assert r.output_token_times.tolist() == [10.0, 10.5]
    r.resolve_placeholder(9, now=11.25)
    assert r.output_token_times.tolist() == [10.0, 10.5, 11.25]
    r.append_placeholder()
    r.drop_placeholder()
    assert r.output_token_times.tolist() == [10.0, 10.5, 11.25]


def _check_gaps(out) -> None:
    """The gaps of a finished output agree with its token count and its own clock readings."""
    m = out.metrics
    gaps = m.inter_token_latencies
    assert len(gaps) == len(out.outputs[0].token_ids) - 1
    assert all(g >= 0.0 for g in gaps), gaps
    # first token + every gap = the last commit, which comes before the request finished
    assert m.time_to_first_token is not None and m.finished_time is not None
    assert m.time_to_first_token + sum(gaps) <= m.finished_time - m.arrival_time + 1e-9


def test_a_stop_string_end_leaves_no_negative_gap(llm):
    full = llm.generate([PROMPT], _greedy(24))[0]
    _check_gaps(full)
    stop = _a_stop_string(full.text)
    out = llm.generate([PROMPT], _greedy(24, stop=stop))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.outputs[0].token_ids) < 24
    _check_gaps(out)


def _metric_samples(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_endpoint_sums_only_real_gaps():
    for module in ("fastapi", "httpx", "prometheus_client"):
        pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[dev]')")
    from fastapi.testclient import TestClient

    from backplane import LLM
    from backplane.api import AsyncLLM
    from backplane.server.app import build_app

    engine = AsyncLLM(llm=LLM("tiny-llama", **CONFIG))
    try:
        with TestClient(build_app(engine, model_name="tiny")) as client:
            body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
            full = client.post("/v1/completions", json=body)
            assert full.status_code == 200, full.text
            stop = _a_stop_string(full.json()["choices"][0]["text"])
            stopped = client.post("/v1/completions", json={**body, "stop": [stop]})
            assert stopped.status_code == 200, stopped.text
            choice = stopped.json()["choices"][0]
            assert choice["finish_reason"] == "stop"
            m = _metric_samples(client.get("/metrics").text)
    finally:
        engine.shutdown()
    generated = full.json()["usage"]["completion_tokens"]
    generated += stopped.json()["usage"]["completion_tokens"]
    assert generated < 48  # the stop string cut the second request short
    # one gap per generated token after each request's first
    assert m["backplane_inter_token_latency_seconds_count"] == generated - 2
    itl = m["backplane_inter_token_latency_seconds_sum"]
    # the gaps lie inside the requests' lifetimes
    assert 0.0 <= itl <= m["backplane_e2e_request_latency_seconds_sum"]
