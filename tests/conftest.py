"""Test-suite configuration: the conformance kit plugin and the ``gpu`` marker."""

from __future__ import annotations

import importlib.util

import pytest

# The conformance kit's pytest plugin (``--backplane-backend``, backend
# parametrisation); loaded only when this checkout has it.
if importlib.util.find_spec("backplane.testing.plugin") is not None:
    pytest_plugins = ["backplane.testing.plugin"]


def pytest_configure(config: pytest.Config) -> None:
    """Declare the ``gpu`` marker (also declared in pyproject.toml, for ``--strict-markers``)."""
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` when no CUDA device is usable, saying so."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # only when GPU tests were collected: keep collection cheap otherwise

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; torch.cuda.is_available() is False")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def make_plugin_dist(tmp_path):
    """Return a factory that writes an installed-looking plugin distribution.

    ``make_plugin_dist(dist, entry_points, modules, version="1.0")`` writes
    ``<dist>-<version>.dist-info`` (METADATA and an ``entry_points.txt`` with
    ``entry_points`` ({name: "module[:attr]"}) in the ``backplane.plugins``
    group) and one ``<module>.py`` per item of ``modules`` ({module: source})
    into a directory, and returns that directory (put it on ``sys.path`` or
    ``PYTHONPATH`` to "install" the distribution).
    """
    root = tmp_path / "site"
    root.mkdir(exist_ok=True)

    def make(
        dist: str, entry_points: dict[str, str], modules: dict[str, str], version: str = "1.0"
    ):
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n", encoding="utf-8"
        )
        lines = ["[backplane.plugins]"] + [f"{n} = {v}" for n, v in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        for module, source in modules.items():
            (root / f"{module}.py").write_text(source, encoding="utf-8")
        return root

    return make
