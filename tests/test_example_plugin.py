"""The example third-party plugin, installed the way a user would install a plugin package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import backplane
from backplane.core.registry import BackendRegistry
from backplane.engine.config import EngineConfig
from backplane.engine.selection import BackendSelection, select_backends

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "backplane-example-plugin"
#: Where the backplane under test is imported from: subprocesses that run from another
#: directory must see the same tree, whether or not it is installed.
BACKPLANE_ROOT = Path(backplane.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:
    """Install the example package into a fresh target directory (no network, no deps)."""
    work = tmp_path_factory.mktemp("example-plugin")
    source = work / "src"
    # Build from a copy, so that build/ and *.egg-info never land in the checkout.
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = work / "site"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"pip install failed:\n{result.stdout}\n{result.stderr}"
    assert (target / "backplane_example_plugin" / "plugin.py").is_file()
    return target


def _env(site: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("BACKPLANE_DISABLE_PLUGINS", None)
    paths = (str(site), str(BACKPLANE_ROOT), env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.update(extra)
    return env


def _cli(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "backplane.cli", *args],
        capture_output=True,
        text=True,
        env=_env(site, **env),
        timeout=300,
    )


def test_installed_example_is_listed_by_backplane_backends(example_site):
    result = _cli(example_site, "backends", "--json")
    assert result.returncode == 0, result.stderr
    rows = [r for r in json.loads(result.stdout) if r["name"] == "example"]
    assert len(rows) == 1
    row = rows[0]
    assert (row["family"], row["plugin"], row["priority"]) == ("attention", "example", -10)
    assert row["available"] is True and row["reason"] == ""
    assert row["load"] == "backplane_example_plugin.attention:ExampleAttentionBackend"


def test_installed_example_is_listed_by_backplane_plugins(example_site):
    result = _cli(example_site, "plugins", "--json")
    assert result.returncode == 0, result.stderr
    info = next(i for i in json.loads(result.stdout) if i["name"] == "example")
    assert info == {
        "name": "example",
        "module": "backplane_example_plugin.plugin",
        "distribution": "backplane-example-plugin",
        "version": "0.1.0",
        "hooks": ["backplane_attention_backends"],
        "error": None,
        "disabled": False,
    }


def test_example_can_be_disabled(example_site):
    result = _cli(example_site, "backends", "--json", BACKPLANE_DISABLE_PLUGINS="example")
    assert result.returncode == 0, result.stderr
    assert all(r["name"] != "example" for r in json.loads(result.stdout))


def test_plugin_modules_import_no_kernel_library(example_site):
    """Discovery of every plugin, the example included, leaves torch/triton/flashinfer alone."""
    code = textwrap.dedent(
        """
        import json, sys
        from backplane.core.registry import BackendRegistry
        reg = BackendRegistry()
        names = [s.name for s in reg.backends("attention")]
        print(json.dumps({
            "heavy": sorted(m for m in ("torch", "triton", "flashinfer") if m in sys.modules),
            "backend_module_loaded": "backplane_example_plugin.attention" in sys.modules,
            "example_listed": "example" in names,
            "plugins": {n: i.error for n, i in reg.plugins.items()},
        }))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env(example_site),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["example_listed"], report["plugins"]
    assert report["heavy"] == [], f"imported during plugin discovery: {report['heavy']}"
    assert report["backend_module_loaded"] is False


def test_example_backend_resolves_through_the_config(example_site, monkeypatch):
    pytest.importorskip("backplane.backends.torch.attention")
    monkeypatch.syspath_prepend(str(example_site))
    from backplane.core.families import AttentionBackend

    registry = BackendRegistry()
    cfg = EngineConfig(device="cpu", backends={"attention": "example"})
    backends = BackendSelection(cfg, ["attention"], registry=registry).backends
    backend = backends["attention"]
    assert type(backend).__name__ == "ExampleAttentionBackend"
    assert isinstance(backend, AttentionBackend) and backend.name == "example"
    # Below the in-tree backends: auto never prefers the example.
    auto = select_backends(EngineConfig(device="cpu"), ["attention"], registry=registry)
    assert auto["attention"].name != "example"


def test_example_passes_the_conformance_kit(example_site):
    """The example's own test file (a subclass of the kit's mixin) runs and passes."""
    pytest.importorskip("backplane.testing.attention")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-k",
            "cpu and float32",
            str(EXAMPLE / "tests"),
        ],
        capture_output=True,
        text=True,
        env=_env(example_site),
        cwd=str(example_site),
        timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-2000:]}"
    assert " passed" in summary, summary
