"""Test-suite configuration: the conformance kit plugin, the ``gpu`` marker, the leak check
and the one-thread fixture."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

# backplane before torch (which this file imports only inside fixtures): it asks OpenMP for
# sleeping idle threads, read once when torch loads the runtime (backplane.core.openmp), so the
# tests run the way the engine runs.
import backplane  # noqa: F401

# Every cached Triton launch in the tests (and their child processes) is checked
# against the kernel Triton itself would run (see backplane.core.launch).
os.environ.setdefault("BACKPLANE_CHECK_LAUNCHES", "1")

# The conformance kit's pytest plugin (``--backplane-backend``, backend
# parametrisation); loaded only when this checkout has it.
if importlib.util.find_spec("backplane.testing.plugin") is not None:
    pytest_plugins = ["backplane.testing.plugin"]


#: Import names of the ``dev`` extra's packages (pyproject.toml) that the tests import; a test that
#: skips because one of them is missing fails instead when ``CI`` is set, so a missing install step
#: cannot hide behind a skip. ``tests/test_ci.py`` checks this list against pyproject.toml.
DEV_IMPORTS: dict[str, str] = {
    "pytest": "pytest",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "hypothesis": "hypothesis",
    "triton": "triton",
    "einops": "einops",
    "fla-core": "fla",
    "gguf": "gguf",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "prometheus-client": "prometheus_client",
    "openai": "openai",
    "httpx": "httpx",
    "matplotlib": "matplotlib",
    "xgrammar": "xgrammar",
    "lm-eval": "lm_eval",
    "ray": "ray",
}
#: ``dev`` packages that no test imports (command-line tools).
DEV_TOOLS = frozenset({"ruff"})


def missing_dev_dependency(reason: str) -> str | None:
    """The ``dev`` package a skip reason says is missing, if any.

    Matches ``pytest.importorskip``'s "could not import 'x'" and the suite's own
    "x is not installed" reasons, also for the GGUF loader's "accelerate is required".

    :param reason: a skip's reason text.
    :return: the distribution name of the missing package, or ``None``.
    """
    for dist, module in DEV_IMPORTS.items():
        names = {dist, module}
        for name in names:
            pattern = (
                rf"(could not import '{re.escape(name)}'|\b{re.escape(name)}\b is not installed"
                rf"|\b{re.escape(name)}\b is required|No module named '{re.escape(name)}')"
            )
            if re.search(pattern, reason):
                return dist
    return None


def _fail_skip_for_missing_dev_dependency(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Under ``CI``, turn a skip caused by a missing ``dev`` package into a failure."""
    if not os.environ.get("CI") or not report.skipped:
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    dist = missing_dev_dependency(reason)
    if dist is None:
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{dist} is part of the dev extra but is not installed (skip reason: {reason}); "
        "CI installs exactly as README.md says, so `pip install -e '.[dev]'` must bring it"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """Fail, under ``CI``, a test skipped for a missing ``dev`` package."""
    outcome = yield
    _fail_skip_for_missing_dev_dependency(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> object:
    """Fail, under ``CI``, a module skipped at import for a missing ``dev`` package."""
    outcome = yield
    _fail_skip_for_missing_dev_dependency(outcome.get_result())


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


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the selected files' interpreter checks in the background (see
    :func:`interpreter_checks.prefetch`): they run on a core the other tests leave idle."""
    scripts: list[str] = []
    for item in session.items:
        if "interpret_results" in getattr(item, "fixturenames", ()):
            path = str(item.path)
            if path not in scripts:
                scripts.append(path)
    if scripts:
        import interpreter_checks

        interpreter_checks.prefetch(scripts)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """End the background interpreter checks a stopped run did not wait for."""
    import interpreter_checks

    interpreter_checks.stop_prefetch()


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
    import torch

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
