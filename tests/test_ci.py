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


def test_ci_runs_the_readme_commands_in_order(fake_checkout):
    result, calls = _run_ci(fake_checkout, 0)
    assert result.returncode == 0, result.stderr
    readme = _readme_setup_commands()
    assert readme[0] == "pip install torch==2.13.0"
    # The quotes in the README command are shell quoting and a leading VAR=value is the
    # command's environment; the fake sees the bare words.
    assert calls == [re.sub(r"^(\w+=\S*\s+)+", "", c.replace('"', "")) for c in readme]


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
    assert calls == ["pip install torch==2.13.0"]


def test_ci_script_is_executable():
    assert os.access(ROOT / ".ci" / "run", os.X_OK)
