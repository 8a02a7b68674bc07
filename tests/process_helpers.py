"""Processes and ports of the tests that start ranks or replicas in processes of their own."""

from __future__ import annotations

import socket


def alive(pid: int) -> bool:
    """Whether a process with this id still exists (a zombie counts as gone).

    :param pid: the process id.
    :return: ``True`` while the process runs.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def free_port() -> int:
    """A TCP port free on this machine, for the ranks to meet on.

    :return: the port number.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
