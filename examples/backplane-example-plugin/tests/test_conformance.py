"""Run backplane's attention conformance tests against the example backend.

Run from this directory after installing the package:
``python -m pytest -q tests``.
"""

from __future__ import annotations

import pytest

from backplane.engine.selection import load_backend, select_backend

attention_kit = pytest.importorskip(
    "backplane.testing.attention", reason="backplane's attention conformance kit is not installed"
)


class TestExampleAttention(attention_kit.AttentionBackendTests):
    """Every test of the kit, with the example backend as ``backend``."""

    @pytest.fixture
    def backend(self):
        return load_backend(select_backend("attention", "example"))
