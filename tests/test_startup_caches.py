"""Start-up caches: compiled artefacts persist in one backplane directory; every step size
has a piecewise token bucket.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from backplane.engine.worker.graph.compile_cache import (
    CACHE_DIR_ENV,
    cache_root,
    configure_compile_caches,
)


def test_cache_root_prefers_backplane_then_xdg_then_home(tmp_path):
    assert cache_root({CACHE_DIR_ENV: str(tmp_path / "bp"), "XDG_CACHE_HOME": "/x"}) == (
        tmp_path / "bp"
    )
    assert cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "backplane"
    assert cache_root({}) == Path.home() / ".cache" / "backplane"


def test_compilers_point_into_the_backplane_directory(tmp_path):
    env = {CACHE_DIR_ENV: str(tmp_path)}
    caches = configure_compile_caches(env)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    assert (tmp_path / "inductor").is_dir() and (tmp_path / "triton").is_dir()
    assert caches.root == tmp_path and not caches.chosen_by_user
    assert env["TRITON_CACHE_AUTOTUNING"] == "1"
    # a second call changes nothing
    assert configure_compile_caches(env).dirs == caches.dirs


def test_a_users_choice_is_kept(tmp_path):
    env = {CACHE_DIR_ENV: str(tmp_path), "TRITON_CACHE_DIR": "/somewhere/else"}
    caches = configure_compile_caches(env)
    assert env["TRITON_CACHE_DIR"] == "/somewhere/else"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert caches.chosen_by_user == {"TRITON_CACHE_DIR"}
    assert not (tmp_path / "triton").exists()
    env = {CACHE_DIR_ENV: str(tmp_path), "TRITON_CACHE_AUTOTUNING": "0"}
    caches = configure_compile_caches(env)
    assert env["TRITON_CACHE_AUTOTUNING"] == "0"
    assert "TRITON_CACHE_AUTOTUNING" in caches.chosen_by_user


def test_an_unwritable_directory_warns_and_leaves_the_default(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    env = {CACHE_DIR_ENV: str(blocker / "cache")}
    with caplog.at_level("WARNING"):
        caches = configure_compile_caches(env)
    assert "TRITON_CACHE_DIR" not in env and "TORCHINDUCTOR_CACHE_DIR" not in env
    assert "TRITON_CACHE_AUTOTUNING" not in env  # no directory of ours to keep them in
    assert not caches.dirs
    assert CACHE_DIR_ENV in caplog.text and "writable" in caplog.text


def test_triton_reads_the_directory_set_at_start_up(tmp_path):
    pytest.importorskip("triton")
    code = (
        "import os, triton.knobs as k\n"
        "from backplane.engine.worker.graph.compile_cache import configure_compile_caches\n"
        "configure_compile_caches()\n"
        "print(k.cache.dir)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR",)}
    env[CACHE_DIR_ENV] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str(tmp_path / "triton")


def test_warmup_command_fills_the_engines_cache_directory(tmp_path, monkeypatch):
    from backplane.cli import warmup

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)

    class Stop(Exception):
        pass

    def stop(args):
        raise Stop

    monkeypatch.setattr(warmup, "_warmup_config", stop)
    with pytest.raises(Stop):
        warmup.run(None)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")


@pytest.mark.parametrize(("limit", "sizes"), [(8, None), (100, [1, 3, 16])])
def test_every_step_size_has_a_token_bucket(limit, sizes):
    from backplane.engine.worker.graph.buckets import pick_bucket, token_buckets

    buckets = token_buckets(limit, sizes)
    assert all(pick_bucket(n, buckets) is not None for n in range(1, limit + 1))
    # one token pads to the smallest larger bucket
    assert pick_bucket(1, buckets) == buckets[0] > 1


def test_an_engine_sets_the_caches_before_its_worker_starts(tmp_path, monkeypatch):
    from backplane.engine import executor as executor_mod

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    seen = {}

    class Started(Exception):
        pass

    def worker_starts(config, registry=None):
        seen.update({k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")})
        raise Started

    monkeypatch.setattr(executor_mod, "InProcessExecutor", worker_starts)
    from backplane.engine.config import EngineConfig

    with pytest.raises(Started):
        executor_mod.create_executor(
            EngineConfig.from_dict({"model": "tiny-llama", "device": "cpu"})
        )
    assert seen == {
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }
