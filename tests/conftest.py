"""Test-suite configuration: the conformance kit plugin, the ``gpu`` marker, the leak check
and the one-thread fixture."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Every cached Triton launch in the tests (and their child processes) is checked
# against the kernel Triton itself would run (see backplane.core.launch).
os.environ.setdefault("BACKPLANE_CHECK_LAUNCHES", "1")

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


@pytest.fixture(autouse=True, scope="session")
def _register_schedulers():
    """Make every scheduler and engine the tests build known to the leak check."""
    import leaks

    leaks.install()


@pytest.fixture(autouse=True)
def leak_check(_register_schedulers):
    """After every test: every scheduler and engine alive holds nothing.

    No request left (queued, running, or finished with its final output not
    delivered), no step in flight, no page referenced, no state slot, host-tier
    claim or reservation held. A test that leaves requests behind finishes
    them (drains or aborts and steps) before it returns.
    """
    yield
    import leaks

    problems = leaks.check_all()
    if problems:
        leaks.forget_all()  # report each leak once
        pytest.fail("leak check: " + "; ".join(problems), pytrace=False)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module: its tiny matmuls run fastest single-threaded and do
    not fight over shared CI cores (modules opt in with ``pytest.mark.usefixtures``)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


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
