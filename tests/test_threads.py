"""CPU threads: the ``threads`` key and ``--threads`` flag, start-up, OpenMP waiting, packed products."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys

import pytest
import torch

from backplane.cli.options import add_engine_arguments, config_from_args
from backplane.core import openmp
from backplane.core.errors import ConfigError
from backplane.engine import threads as threads_module
from backplane.engine.config import EngineConfig
from backplane.engine.threads import apply_threads, available_cores, resolve_threads
from backplane.models.linear import Linear, can_pack


@pytest.fixture
def restore_threads():
    """Put torch's thread count back after a test that changes it."""
    prev = torch.get_num_threads()
    yield
    torch.set_num_threads(prev)


def _affinity_size() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# -- the setting --------------------------------------------------------------------------------


def test_threads_defaults_to_auto_and_takes_positive_counts(tmp_path):
    assert EngineConfig().threads is None
    assert EngineConfig(threads=3).threads == 3
    assert EngineConfig.from_dict({"threads": "2"}).threads == 2
    assert EngineConfig.from_dict({"threads": "auto"}).threads is None
    path = tmp_path / "engine.yaml"
    path.write_text("threads: 4\n", encoding="utf-8")
    assert EngineConfig.from_yaml(path).threads == 4


@pytest.mark.parametrize("bad", [0, -1, "two", True, 1.5, ""])
def test_bad_threads_are_refused_naming_the_key_and_what_is_accepted(bad):
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_dict({"threads": bad})
    text = str(err.value)
    assert "threads" in text and "positive number of threads or auto" in text
    assert repr(bad) in text


def test_bad_threads_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("threads: 0\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"engine\.yaml.*threads"):
        EngineConfig.from_yaml(path)


def _parse(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_threads_flag_sets_the_key_and_overrides_the_file(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("threads: 4\n", encoding="utf-8")
    assert _parse(["--threads", "1"]).threads == 1
    assert _parse(["--config", str(path), "--threads", "2"]).threads == 2
    assert _parse(["--config", str(path)]).threads == 4
    assert _parse([]).threads is None


def test_bad_threads_flag_names_the_flag():
    with pytest.raises(ConfigError, match=r"--threads.*positive number of threads"):
        _parse(["--threads", "0"])


# -- applying it ------------------------------------------------------------------------------


def test_auto_is_the_cores_this_process_may_use(monkeypatch):
    assert available_cores() == _affinity_size()
    assert resolve_threads(None) == _affinity_size()
    assert resolve_threads(3) == 3
    if hasattr(os, "sched_getaffinity"):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 7, 9})
        assert available_cores() == 3


def test_apply_threads_sets_torch_threads(restore_threads):
    assert apply_threads(1) == 1 and torch.get_num_threads() == 1
    assert apply_threads(2) == 2 and torch.get_num_threads() == 2


def test_unset_threads_keep_a_count_the_application_chose(restore_threads):
    torch.set_num_threads(1)
    assert apply_threads(None) == 1 == torch.get_num_threads()


def test_unset_threads_lower_a_count_above_the_cores(restore_threads):
    torch.set_num_threads(_affinity_size() + 3)
    assert apply_threads(None) == _affinity_size() == torch.get_num_threads()


def test_more_threads_than_cores_warns(restore_threads, caplog):
    with caplog.at_level(logging.WARNING, logger="backplane.engine.threads"):
        apply_threads(_affinity_size() + 1)
    assert "set threads to at most" in caplog.text


def test_spinning_openmp_is_reported_once(restore_threads, monkeypatch, caplog):
    monkeypatch.setattr(openmp, "_policy_at_load", "unknown")
    monkeypatch.setattr(threads_module, "_warned_spinning", False)
    with caplog.at_level(logging.WARNING, logger="backplane.engine.threads"):
        apply_threads(2)
        apply_threads(2)
    assert caplog.text.count("OMP_WAIT_POLICY=PASSIVE") == 1
    caplog.clear()
    monkeypatch.setattr(threads_module, "_warned_spinning", False)
    monkeypatch.setattr(openmp, "_policy_at_load", "PASSIVE")
    with caplog.at_level(logging.WARNING, logger="backplane.engine.threads"):
        apply_threads(2)
    assert "OMP_WAIT_POLICY" not in caplog.text


def test_engine_start_up_applies_threads(restore_threads):
    from backplane.api import LLM

    want = 2 if torch.get_num_threads() == 1 else 1
    llm = LLM("tiny-llama", device="cpu", threads=want, max_num_seqs=2, max_model_len=64)
    try:
        assert torch.get_num_threads() == want
    finally:
        llm.shutdown()


# -- OpenMP's wait policy -----------------------------------------------------------------------


def _child(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != openmp.WAIT_POLICY_VAR}
    environ.update(env)
    out = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_import_sets_passive_waiting_before_torch_loads():
    code = "import os, sys, backplane; print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    assert _child(code) == "PASSIVE False"


def test_a_users_wait_policy_wins():
    code = "import os, backplane.core.openmp as o; print(os.environ['OMP_WAIT_POLICY'], o.wait_policy())"
    assert _child(code, OMP_WAIT_POLICY="active") == "active ACTIVE"


def test_torch_imported_first_is_unknown():
    code = "import torch, os, backplane.core.openmp as o; print(o.wait_policy(), 'OMP_WAIT_POLICY' in os.environ)"
    assert _child(code) == "unknown False"


# -- the projection path: packed oneDNN at every thread count -----------------------------------


@pytest.mark.skipif(
    not can_pack(torch.empty(2, 2)), reason="this torch build has no oneDNN packing"
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 8, 33])
@pytest.mark.parametrize("shape", [(960, 576), (49152, 576), (576, 1536)])
def test_packed_projection_matches_float64_at_each_thread_count(
    restore_threads, threads: int, rows: int, shape: tuple[int, int]
) -> None:
    out_features, in_features = shape
    g = torch.Generator().manual_seed(rows * 7 + out_features)
    lin = Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_features, in_features, generator=g) * 0.05)
    w64 = lin.weight.detach().double().clone()
    x = torch.randn(rows, in_features, generator=g)
    torch.set_num_threads(threads)
    with torch.inference_mode():
        assert lin.pack(8, release=True)
        y = lin(x)
    ref = x.double() @ w64.T
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4)


def _preset_logits(name: str, dtype: torch.dtype, pack: bool, tokens: list[int]) -> torch.Tensor:
    """Prefill ``tokens`` through preset ``name`` (torch backends) and return every token's logits."""
    from backplane.core.forward_context import forward_context, plan_step
    from backplane.core.packing import build_batch_metadata
    from backplane.core.registry import get_registry
    from backplane.models.presets import build_preset
    from backplane.testing.plugin import load_backend

    registry = get_registry()
    backends = {"attention": load_backend(registry.get("attention", "torch"))}
    lm = build_preset(name, dtype=dtype, backends=backends).model
    if pack:
        assert lm.pack_weights_for_cpu(rows=8) > 0
    page_size = 16
    pages = -(-len(tokens) // page_size)
    lm.allocate_caches(
        num_pages=pages + 1, page_size=page_size, num_slots=2, dtype=dtype, device="cpu"
    )
    batch = build_batch_metadata(
        [len(tokens)], [0], [list(range(1, pages + 1))], page_size, state_slots=[1], device="cpu"
    )
    ids = torch.tensor(tokens, dtype=torch.int64)
    with torch.inference_mode(), forward_context(batch, plan_step(backends, batch)):
        hidden = lm(ids, batch.positions)
        return lm.compute_logits(hidden[: batch.num_tokens]).double()


@pytest.mark.skipif(
    not can_pack(torch.empty(2, 2)), reason="this torch build has no oneDNN packing"
)
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_model_logits_match_float64_at_each_thread_count(restore_threads, threads):
    tokens = [256, *range(40, 77)]
    torch.set_num_threads(threads)
    got = _preset_logits("tiny-llama", torch.float32, True, tokens)
    ref = _preset_logits("tiny-llama", torch.float64, False, tokens)
    assert got.shape == (len(tokens), 320)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
