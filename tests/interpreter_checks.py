"""Checks that run in one child process under ``TRITON_INTERPRET=1``, reported to pytest.

``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported, and it
would make the Triton backends "available" to every other test of the same
process. So a test file of such checks runs itself as a script in one child
process with the variable set (:func:`run_in_child`, from a module-scoped
fixture), and the script's ``__main__`` runs the checks and writes their
results as JSON (:func:`main`); each pytest test then reports one check.

The children are CPU-bound and the pytest process mostly runs one thread, so
once collection is done (:func:`prefetch`, from ``conftest.py``) a background
thread starts the selected files' children one after another while the other
tests run; a fixture takes its file's results when they are ready, and runs
the child itself if the background thread has not reached it yet.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
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


class _Child:
    """One file's child process, run by whichever comes first: the background thread of
    :func:`prefetch` or the file's fixture."""

    def __init__(self, script: Path, checks: list[str], timeout: float) -> None:
        self.script, self.checks, self.timeout = script, checks, timeout
        self._claim = threading.Lock()
        self._claimed = False
        self._done = threading.Event()
        self._outcome: tuple[int | None, str, dict[str, Result] | None] = (None, "", None)
        self._proc: subprocess.Popen[str] | None = None

    def claim(self) -> bool:
        """Take the run for the caller; ``False`` when another caller already took it."""
        with self._claim:
            mine, self._claimed = not self._claimed, True
            return mine

    def run(self) -> None:
        """Run the child (the claimer only) and keep its exit status, output and results."""
        env = dict(os.environ, TRITON_INTERPRET="1")
        with tempfile.TemporaryDirectory() as tmp:
            result_file = Path(tmp) / "results.json"
            self._proc = proc = subprocess.Popen(
                [sys.executable, str(self.script), "--json", str(result_file), *self.checks],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                out, err = proc.communicate(timeout=self.timeout)
                code, output = proc.returncode, f"{out[-4000:]}\n{err[-4000:]}"
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                code, output = None, f"the child took more than {self.timeout:.0f} s"
            results = json.loads(result_file.read_text()) if result_file.exists() else None
        self._outcome = (code, output, results)
        self._done.set()

    def cancel(self) -> None:
        """Keep the child from starting, or end it if it runs (the pytest run is over)."""
        self.claim()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def outcome(self) -> tuple[int | None, str, dict[str, Result] | None]:
        """The child's exit status, output tail and results, once it ended."""
        self._done.wait()
        return self._outcome


#: the children of the files whose checks this pytest run selected, by script path
_children: dict[Path, _Child] = {}
#: each file's checks and timeout, as its module declared them (see interpreter_tests)
_declared: dict[Path, tuple[list[str], float]] = {}


def prefetch(scripts: Iterable[str | Path], workers: int | None = None) -> None:
    """Start running the interpreter checks of ``scripts`` in the background, in order.

    Called once collection is done, with the files whose checks were selected.
    Without ``triton`` nothing starts (the tests skip).

    :param scripts: test files declared with :func:`interpreter_tests`.
    :param workers: children at a time (default: half the CPUs, at least one).
    """
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return
    queue: list[_Child] = []
    for script in scripts:
        path = Path(script).resolve()
        if path in _declared and path not in _children:
            checks, timeout = _declared[path]
            _children[path] = child = _Child(path, checks, timeout)
            queue.append(child)
    if workers is None:
        workers = max(1, (os.cpu_count() or 2) // 2)
    for w in range(min(workers, len(queue))):
        threading.Thread(
            target=_run_unclaimed, args=(queue[w::workers],), name="interpreter-checks", daemon=True
        ).start()


def _run_unclaimed(children: list[_Child]) -> None:
    """Run, in order, each of ``children`` no fixture has taken yet."""
    for child in children:
        if child.claim():
            child.run()


def stop_prefetch() -> None:
    """End the background children still running or waiting (the pytest run is over: a run
    stopped early leaves none behind)."""
    for child in _children.values():
        child.cancel()


def run_in_child(
    script: str | Path, checks: Iterable[str], *, timeout: float = 600
) -> dict[str, Result]:
    """Run ``script``'s checks in one child process under ``TRITON_INTERPRET=1`` (pytest side).

    Takes the results of the background run :func:`prefetch` started, if any
    (waiting for it), else runs the child now. Skips the calling test when
    ``triton`` is not installed, and fails it with the child's output when the
    child ends without writing its results.

    :param script: the test file, which runs :func:`main` when executed as a script.
    :param checks: the names of the checks to run.
    :param timeout: seconds the child may take.
    :return: each check's result, by name.
    """
    import pytest

    pytest.importorskip("triton", reason="triton is not installed")
    names = list(checks)
    child = _children.get(Path(script).resolve())
    if child is None or child.checks != names:
        child = _Child(Path(script), names, timeout)
    if child.claim():
        child.run()
    code, output, results = child.outcome()
    if results is None:
        pytest.fail(f"interpreter checks crashed (rc={code}):\n{output}")
    return results


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
    _declared[Path(script).resolve()] = (names, timeout)

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
