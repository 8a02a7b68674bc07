"""Memory sizes as people write them (``256MiB``, ``1.5GiB``, ``512MB``) and as messages show them, and the KV page counts they are made of."""

from __future__ import annotations

import math
import re
from typing import Any

from backplane.core.launch import cdiv

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gib": 2**30,
    "gb": 10**9,
    "t": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


# Any: whatever a config file or flag holds; all but an int or a size string is refused
def parse_size(value: Any) -> int:
    """Parse a memory size into bytes.

    :param value: an int (bytes) or a string such as ``"1073741824"``,
        ``"256MiB"``, ``"1.5GiB"``, ``"512MB"``. ``KiB``/``MiB``/``GiB``/``TiB``
        and the bare letters ``K``/``M``/``G``/``T`` are powers of 1024;
        ``KB``/``MB``/``GB``/``TB`` are powers of 1000. Case-insensitive.
    :return: the size in bytes (a non-negative int; fractions round down).
    :raises ValueError: the value is not a size (the message lists the units).
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 256MiB or a number of bytes, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0 or value != int(value):
            raise ValueError(f"expected a whole, non-negative number of bytes, got {value!r}")
        return int(value)
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            number, unit = match.groups()
            return int(float(number) * _SIZE_UNITS[unit.lower()])
    raise ValueError(
        f"expected a size such as 256MiB, 1.5GiB, 512MB or a number of bytes, got {value!r} "
        "(units: B, KiB, MiB, GiB, TiB or K, M, G, T in powers of 1024; KB, MB, GB, TB in "
        "powers of 1000)"
    )


def format_size(num_bytes: int) -> str:
    """Format a byte count for messages.

    :param num_bytes: the size in bytes.
    :return: e.g. ``"512 B"``, ``"256.0 MiB"``, ``"3.0 TiB"``.
    """
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}" if unit != "B" else f"{num_bytes} B"
        size /= 1024
    return f"{size:.1f} TiB"


#: Share of the memory available at start-up that the CPU KV cache may take by default.
CPU_KV_FRACTION = 0.5


def _read_int(path: str) -> int | None:
    """The integer in a one-line file, ``None`` if it is missing or not a number (``max``)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def available_memory() -> int | None:
    """Bytes of memory this process can still take, ``None`` if unknown.

    The OS's ``MemAvailable``, lowered to what is left under the process's
    cgroup memory limit when there is one (containers see the host's meminfo).
    """
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        # cgroup v1 reports "no limit" as a huge number, v2 as "max" (not an int)
        if limit is not None and usage is not None and limit < 1 << 60:
            left = max(0, limit - usage)
            available = left if available is None else min(available, left)
            break
    return available


def cpu_kv_budget(
    *,
    page_bytes: int,
    state_bytes: int,
    max_num_seqs: int,
    max_pages_per_seq: int,
    available: int | None = None,
    fraction: float = CPU_KV_FRACTION,
) -> tuple[int, str]:
    """The default KV memory of a CPU engine: what its limits can use, within a share of RAM.

    Every sequence at full length needs ``max_num_seqs x max_pages_per_seq``
    pages (plus the scratch page and the recurrent states); more could never be
    used at once, so that is the budget, unless it exceeds ``fraction`` of the
    memory available at start-up (the weights are loaded by then).

    :param page_bytes: bytes of one KV page over all paged caches.
    :param state_bytes: bytes of the recurrent states (fixed by the slot count).
    :param max_num_seqs: most sequences in one step.
    :param max_pages_per_seq: pages of one sequence at ``max_model_len``.
    :param available: available memory in bytes (default: read from the OS;
        unknown means no cap).
    :param fraction: the share of ``available`` the budget may take.
    :return: the budget in bytes and a sentence saying how it was chosen (for the log).
    """
    pages = max_num_seqs * max_pages_per_seq + 1
    needed = state_bytes + pages * page_bytes
    why = (
        f"{format_size(needed)} holds max_num_seqs={max_num_seqs} sequences of "
        f"{max_pages_per_seq} pages (max_model_len) plus the scratch page"
    )
    if available is None:
        available = available_memory()
    if available is not None:
        cap = int(available * fraction)
        if needed > cap:
            return cap, (
                f"{why}, capped at {fraction:.0%} of the {format_size(available)} available"
            )
        why += f", within {fraction:.0%} of the {format_size(available)} available"
    return needed, why


def pages_per_seq(max_model_len: int, page_size: int) -> int:
    """Pages that one sequence of ``max_model_len`` tokens holds: the width of its page table.

    Every holder of a page-table width (the KV budget, the input batch, the
    graph runner, the bench commands) takes it from here.

    :param max_model_len: the longest sequence, prompt and output, in tokens.
    :param page_size: tokens per KV page.
    :return: ``ceil(max_model_len / page_size)``.
    """
    return cdiv(max_model_len, page_size)
