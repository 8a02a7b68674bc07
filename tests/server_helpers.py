"""Start ``backplane serve`` as a subprocess on 127.0.0.1 and a free port, for tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_env() -> dict[str, str]:
    # The served model runs on the torch kernels whatever the test run's Triton mode:
    # these tests are about serving, and a model served through Triton's CPU
    # interpreter (TRITON_INTERPRET=1, which the kernel tests use) takes minutes per
    # request. The kernels have their own tests.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextlib.contextmanager
def running_server(args: Sequence[str], *, timeout: float = 180.0) -> Iterator[str]:
    """Run ``backplane serve ARGS --port P`` until the block ends; yield its base URL.

    :param args: the command's arguments (model and flags; not ``--port``).
    :param timeout: seconds to wait for ``/health`` to answer 200.
    :raises AssertionError: the server exited or never became healthy (with its stderr).
    """
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "backplane.cli", "serve", *args, "--port", str(port)]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=_server_env(),
        )

        def stderr() -> str:
            err.seek(0)
            return err.read().decode(errors="replace")[-4000:]

        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise AssertionError(f"the server exited ({proc.returncode}): {stderr()}")
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"the server was not healthy after {timeout} s: {stderr()}"
                    )
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
