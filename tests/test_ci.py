"""``.ci/run``: installs exactly as README.md says, runs its test command, fails on exit 5."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_setup_commands() -> list[str]:
    """The commands of README.md's first shell block, split at ``&&``."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no bash block"
    commands = []
    for line in block.group(1).splitlines():
        commands += [part.strip() for part in line.split("&&") if part.strip()]
    return commands


def _fake_tool(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body, encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_checkout(tmp_path):
    """A copy of .ci/run plus fake pip/python that log their arguments."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy2(ROOT / ".ci" / "run", repo / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "log"
    _fake_tool(bin_dir / "pip", f'echo "pip $*" >> {log}\n')
    _fake_tool(
        bin_dir / "python",
        f'echo "python $*" >> {log}\nif [ "$*" = "-m pytest -q" ]; then exit "$PYTEST_STATUS"; fi\n',
    )
    # ``python3 -m venv DIR`` makes a venv whose activation keeps the fakes first on PATH.
    _fake_tool(
        bin_dir / "python3",
        f'echo "python3 $1 $2" >> {log}\necho "$3" > {tmp_path}/venv_dir\nmkdir -p "$3/bin"\n'
        f'echo "export PATH={bin_dir}:\\$PATH" > "$3/bin/activate"\n',
    )
    shutil.copy2(ROOT / "README.md", repo / "README.md")
    return repo, bin_dir, log


def _run_ci(
    fake_checkout, pytest_status: int
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    repo, bin_dir, log = fake_checkout
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env["PYTEST_STATUS"] = str(pytest_status)
    result = subprocess.run(
        [str(repo / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=60
    )
    return result, log.read_text(encoding="utf-8").splitlines()


def test_ci_runs_the_readme_commands_in_order_in_a_new_venv(fake_checkout):
    result, calls = _run_ci(fake_checkout, 0)
    assert result.returncode == 0, result.stderr
    readme = _readme_setup_commands()
    assert readme[0] == "pip install torch==2.13.0"
    assert readme[-1] == "python -m pytest -q"
    # The quotes in the README command are shell quoting and a leading VAR=value is the
    # command's environment; the fake sees the bare words.
    assert calls == ["python3 -m venv"] + [
        re.sub(r"^(\w+=\S*\s+)+", "", c.replace('"', "")) for c in readme
    ]


def test_ci_venv_is_new_each_run_and_removed_after(fake_checkout, tmp_path):
    seen = []
    for _ in range(2):
        result, _ = _run_ci(fake_checkout, 0)
        assert result.returncode == 0, result.stderr
        venv = Path((tmp_path / "venv_dir").read_text(encoding="utf-8").strip())
        assert not venv.exists(), "the temporary venv outlived the run"
        seen.append(venv)
    assert seen[0] != seen[1]


def test_ci_follows_an_edited_readme(fake_checkout):
    repo, _, _ = fake_checkout
    readme = repo / "README.md"
    text = readme.read_text(encoding="utf-8")
    readme.write_text(
        text.replace("python -m pytest -q", "python -m pytest -q -x"), encoding="utf-8"
    )
    result, calls = _run_ci(fake_checkout, 0)
    assert result.returncode == 0, result.stderr
    assert calls[-1] == "python -m pytest -q -x"


@pytest.mark.parametrize(("pytest_status", "ci_status"), [(1, 1), (2, 2), (5, 1)])
def test_ci_fails_on_test_failures_and_on_no_tests_collected(
    fake_checkout, pytest_status, ci_status
):
    result, _ = _run_ci(fake_checkout, pytest_status)
    assert result.returncode == ci_status
    if pytest_status == 5:
        assert "ci: FAILED: pytest collected no tests" in result.stderr


def test_ci_stops_when_the_install_fails(fake_checkout):
    repo, bin_dir, log = fake_checkout
    _fake_tool(bin_dir / "pip", f'echo "pip $*" >> {log}\nexit 3\n')
    result, calls = _run_ci(fake_checkout, 0)
    assert result.returncode == 3
    assert calls == ["python3 -m venv", "pip install torch==2.13.0"]


def test_ci_script_is_executable():
    assert os.access(ROOT / ".ci" / "run", os.X_OK)


def _dev_extra() -> set[str]:
    """The package names of pyproject.toml's ``dev`` extra."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"^dev = \[(.*?)\]", text, re.S | re.M)
    assert block, "pyproject.toml has no dev extra"
    return set(re.findall(r'"([A-Za-z0-9_.-]+)', block.group(1)))


def test_dev_extra_names_every_package_the_tests_import():
    from conftest import DEV_IMPORTS, DEV_TOOLS

    assert _dev_extra() == set(DEV_IMPORTS) | DEV_TOOLS
    # The packages a fresh venv lacked: the GGUF loader of transformers and the server tests.
    assert {"accelerate", "httpx"} <= _dev_extra()


_SKIPPING_TESTS = """
import pytest

def test_needs_httpx():
    pytest.skip("httpx is not installed (pip install -e '.[dev]')")

def test_needs_importorskip():
    pytest.importorskip("backplane_no_such_module_xyz")
"""

_SKIPPING_MODULE = """
import pytest
pytest.skip("could not import 'gguf': No module named 'gguf'", allow_module_level=True)

def test_never_runs():
    pass
"""


@pytest.mark.parametrize("ci", ["", "true"])
def test_missing_dev_dependency_fails_under_ci_and_skips_otherwise(tmp_path, ci):
    (tmp_path / "test_one.py").write_text(_SKIPPING_TESTS, encoding="utf-8")
    (tmp_path / "test_two.py").write_text(_SKIPPING_MODULE, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"), CI=ci)
    result = subprocess.run(
        [
            "python",
            "-m",
            "pytest",
            "-q",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            "-rA",
            "--continue-on-collection-errors",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    out = result.stdout + result.stderr
    if ci:
        assert result.returncode == 1, out
        assert "httpx is part of the dev extra but is not installed" in out
        assert "gguf is part of the dev extra but is not installed" in out
        # A module that is not a dev package still skips.
        assert "1 skipped" in out, out
    else:
        assert result.returncode == 0, out
        assert "3 skipped" in out, out
