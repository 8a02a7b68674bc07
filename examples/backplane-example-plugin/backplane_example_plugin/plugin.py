"""The plugin module: describes the ``example`` attention backend without loading it.

backplane imports this module during plugin discovery, for every command and
every engine start, so it must stay cheap: it imports neither torch nor the
backend module. ``load`` names the backend by import path and
``is_available`` answers without importing anything heavy.
"""

from __future__ import annotations

import importlib.util

from backplane import BackendSpec, hookimpl


def _available() -> tuple[bool, str]:
    """The backend builds on backplane's torch reference attention, so it needs that module."""
    try:
        found = importlib.util.find_spec("backplane.backends.torch.attention") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return False, "backplane.backends.torch.attention (the torch reference kernels) is missing"
    return True, ""


@hookimpl
def backplane_attention_backends() -> list[BackendSpec]:
    """Provide the ``example`` attention backend."""
    return [
        BackendSpec(
            family="attention",
            name="example",
            load="backplane_example_plugin.attention:ExampleAttentionBackend",
            is_available=_available,
            # Below the in-tree backends, so that `auto` never picks the example.
            priority=-10,
            capabilities=frozenset(
                {"cpu", "cuda", "float32", "bfloat16", "float16", "sliding_window", "gqa"}
            ),
            description="example plugin backend (reuses the torch reference kernels)",
        )
    ]
