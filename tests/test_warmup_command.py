"""``backplane warmup`` takes the engine's flags and the engine's backend selection.

Device, dtype and page size come from the shared engine options (``--config``
included), so a bad value is refused as the engine refuses it; the backends
warmed are the ones :func:`backplane.engine.selection.select_backends_for`
chooses, and the shapes of a preset are those of the model built from it.
"""

from __future__ import annotations

import json

import pytest

from backplane.cli import main
from backplane.engine.selection import select_backends_for
from backplane.models import presets


def _warm(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[dict], str]:
    """Run ``backplane warmup ... --json``; return the exit code, the results and stderr."""
    rc = main(["warmup", *argv, "--json"])
    captured = capsys.readouterr()
    return rc, (json.loads(captured.out) if captured.out.strip() else []), captured.err


def test_config_file_sets_device_dtype_and_page_size(tmp_path, capsys) -> None:
    """The engine's ``--config`` file is read (the command had no such flag before)."""
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("device: cpu\ndtype: float32\npage_size: 8\n", encoding="utf-8")
    rc, results, err = _warm(["--config", str(cfg), "--attention", "4:2:16"], capsys)
    assert rc == 0, err
    chosen = select_backends_for({}, ["attention"], prefer="flashinfer", device="cpu")
    assert [(r["family"], r["backend"], r["error"]) for r in results] == [
        ("attention", chosen["attention"].name, None)
    ]
    assert "num_heads=4" in results[0]["shape"] and "head_dim=16" in results[0]["shape"]


def test_bad_page_size_is_refused_as_the_engine_refuses_it(capsys) -> None:
    """``--page-size 0`` is a user error naming the flag, not a failed shape."""
    rc, results, err = _warm(
        ["--device", "cpu", "--page-size", "0", "--attention", "4:2:16"], capsys
    )
    assert rc == 2 and results == []
    assert "--page-size" in err


def test_unknown_backend_family_is_refused(capsys) -> None:
    rc, _, err = _warm(
        ["--device", "cpu", "--backend", "nope=torch", "--attention", "4:2:16"], capsys
    )
    assert rc == 2 and "nope" in err


def test_named_backend_is_warmed_and_preset_shapes_come_from_the_model(capsys) -> None:
    """``--model`` (the engine flag) works like the positional model; the named backend is used."""
    config = presets.preset_config("tiny-llama")
    rc, results, err = _warm(
        ["--model", "tiny-llama", "--device", "cpu", "--backend", "attention=torch"], capsys
    )
    assert rc == 0, err
    assert [(r["family"], r["backend"], r["error"]) for r in results] == [
        ("attention", "torch", None)
    ]
    shape = results[0]["shape"]
    assert f"num_heads={config['num_attention_heads']}" in shape
    assert f"num_kv_heads={config['num_key_value_heads']}" in shape
    rc, positional, err = _warm(
        ["tiny-llama", "--device", "cpu", "--backend", "attention=torch"], capsys
    )
    assert rc == 0, err
    assert [r["shape"] for r in positional] == [shape]


def test_without_model_or_shape_nothing_is_warmed(capsys) -> None:
    """The engine's default model is not warmed unless it was asked for."""
    rc, results, err = _warm(["--device", "cpu"], capsys)
    assert rc == 2 and results == [] and "nothing to warm" in err
