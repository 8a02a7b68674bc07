"""The server's app in process (FastAPI's TestClient over a tiny model): 503s, health, the CLI."""

from __future__ import annotations

import pytest

for _module in ("fastapi", "uvicorn", "prometheus_client", "httpx"):
    pytest.importorskip(_module, reason=f"{_module} is not installed (pip install -e '.[dev]')")

from fastapi.testclient import TestClient  # noqa: E402

CONFIG = dict(device="cpu", max_num_seqs=4, max_num_tokens=32, page_size=4, num_kv_pages=128)


def _app(**engine_kw):
    from backplane import LLM
    from backplane.api import AsyncLLM
    from backplane.server.app import build_app

    engine = AsyncLLM(llm=LLM("tiny-llama", **CONFIG), **engine_kw)
    return engine, build_app(engine, model_name="tiny")


def test_full_waiting_queue_is_503_overloaded():
    engine, app = _app(max_waiting_requests=0)
    try:
        with TestClient(app) as client:
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503
            err = r.json()["error"]
            assert err["code"] == "overloaded" and "max_waiting_requests" in err["message"]
            assert set(err) == {"message", "type", "param", "code"}
    finally:
        engine.shutdown()


def test_stopped_engine_is_503_and_unhealthy():
    engine, app = _app()
    with TestClient(app) as client:
        ok = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        engine.shutdown()
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_serve_help_lists_server_and_engine_flags(capsys):
    from backplane.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--host",
        "--port",
        "--api-key",
        "--max-request-body-bytes",
        "--max-waiting-requests",
        "--max-num-seqs",
        "--kv-memory",
        "--backend",
        "--config",
    ):
        assert flag in text, flag


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["serve", "tiny-llama", "--port", "70000"], "--port"),
        (["serve", "tiny-llama", "--model", "smollm2"], "given twice"),
        (["serve", "tiny-llama", "--max-waiting-requests", "-1"], "--max-waiting-requests"),
    ],
)
def test_serve_refuses_bad_flags(argv, says, capsys):
    from backplane.cli import main

    assert main(argv) == 2
    assert says in capsys.readouterr().err
