"""Checks that run in one child process under ``TRITON_INTERPRET=1``, reported to pytest.

``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported, and it
would make the Triton backends "available" to every other test of the same
process. So a test file of such checks runs itself as a script in one child
process with the variable set (:func:`run_in_child`, from a module-scoped
fixture), and the script's ``__main__`` runs the checks and writes their
results as JSON (:func:`main`); each pytest test then reports one check.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger(__name__)

#: a check's result as the child reports it: ``{"status": "ok" | "skip" | "fail", "detail": ...}``
Result = dict[str, str]


def interpreting() -> bool:
    """Whether the Triton interpreter is switched on in this process.

    :return: ``True`` when ``TRITON_INTERPRET`` is set to something other than ``0``.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_gpu(min_capability: tuple[int, int] | None = None, why: str = "") -> Any:
    """The CUDA device the Triton kernels run on, skipping the calling test where they cannot.

    For the ``gpu`` twins of the interpreter checks: they skip without triton,
    without CUDA, under ``TRITON_INTERPRET`` (the kernels would not run on the
    GPU) and below ``min_capability``.

    :param min_capability: the least compute capability, or ``None``.
    :param why: what needs it, for the skip message.
    :return: ``torch.device("cuda", current device)``.
    """
    import pytest
    import torch

    pytest.importorskip("triton", reason="triton is not installed")
    if interpreting():
        pytest.skip("TRITON_INTERPRET is set: the kernels would not run on the GPU")
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    if min_capability is not None and torch.cuda.get_device_capability() < min_capability:
        pytest.skip(f"{why} need compute capability {min_capability[0]}.{min_capability[1]}+")
    return torch.device("cuda", torch.cuda.current_device())


def run_in_child(
    script: str | Path, checks: Iterable[str], *, timeout: float = 600
) -> dict[str, Result]:
    """Run ``script``'s checks in one child process under ``TRITON_INTERPRET=1`` (pytest side).

    Skips the calling test when ``triton`` is not installed, and fails it with
    the child's output when the child ends without writing its results.

    :param script: the test file, which runs :func:`main` when executed as a script.
    :param checks: the names of the checks to run.
    :param timeout: seconds the child may take.
    :return: each check's result, by name.
    """
    import pytest

    pytest.importorskip("triton", reason="triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "results.json"
        proc = subprocess.run(
            [sys.executable, str(script), "--json", str(result_file), *checks],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if not result_file.exists():
            pytest.fail(
                f"interpreter checks crashed (rc={proc.returncode}):\n"
                f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            )
        return json.loads(result_file.read_text())


def main(
    argv: list[str],
    checks: Iterable[str],
    run_check: Callable[[str], tuple[str, str] | None],
) -> int:
    """Run the named checks in this process (child side); with ``--json FILE`` write the results there.

    :param argv: the script's arguments: optionally ``--json FILE``, then check names
        (none: every check).
    :param checks: every check's name, run when ``argv`` names none.
    :param run_check: runs one check by name; raises on a mismatch, returns
        ``(status, detail)`` (``("skip", reason)`` to skip) or ``None`` for ``ok``.
    :return: the exit status: 0 when no check failed, 1 when one did, 2 outside the interpreter.
    """
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result_file = None
    if argv[:1] == ["--json"]:
        result_file, argv = Path(argv[1]), argv[2:]
    if not interpreting():
        log.error("set TRITON_INTERPRET=1 before running these checks")
        return 2
    # the checks import backplane from this checkout and the tests' helper modules
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    results: dict[str, Result] = {}
    for name in argv or list(checks):
        try:
            status, detail = run_check(name) or ("ok", "")
        except Exception:  # noqa: BLE001 - every failure is reported to the pytest side
            status, detail = "fail", traceback.format_exc()[-6000:]
        results[name] = {"status": status, "detail": detail}
        log.info("%s: %s%s", name, status, f"\n{detail}" if detail else "")
    if result_file is not None:
        result_file.write_text(json.dumps(results))
    return 1 if any(r["status"] == "fail" for r in results.values()) else 0


def interpreter_tests(
    script: str | Path, checks: Iterable[str], *, timeout: float = 600
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The pytest side of a file of interpreter checks: a fixture and one test per check.

    The fixture (module scope) runs every check in one child process
    (:func:`run_in_child`); the test reports one check's result, skipping
    where the child skipped it. Bind both at module level, the test under
    a name starting with ``test``::

        interpret_results, test_in_interpreter = interpreter_tests(__file__, CHECKS)

    :param script: the test file, which runs :func:`main` when executed as a script.
    :param checks: the names of its checks.
    :param timeout: seconds the child may take.
    :return: ``(fixture named interpret_results, parametrized test)``.
    """
    import pytest

    names = list(checks)

    @pytest.fixture(scope="module")
    def interpret_results() -> dict[str, Result]:
        """Run every check in one child process under ``TRITON_INTERPRET=1``."""
        return run_in_child(script, names, timeout=timeout)

    @pytest.mark.parametrize("check", names)
    def test_in_interpreter(interpret_results: dict[str, Result], check: str) -> None:
        """One check, run on CPU tensors in the Triton interpreter."""
        res = interpret_results.get(check)
        assert res is not None, f"check {check} did not report"
        if res["status"] == "skip":
            pytest.skip(res["detail"])
        assert res["status"] == "ok", res["detail"]

    return interpret_results, test_in_interpreter
