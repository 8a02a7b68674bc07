"""Run backplane's attention conformance tests against the example backend.

Run from this directory after installing the package:
``python -m pytest -q tests``.
"""

from __future__ import annotations

import pytest

from backplane.core.registry import get_registry

attention_kit = pytest.importorskip(
    "backplane.testing.attention", reason="backplane's attention conformance kit is not installed"
)


class TestExampleAttention(attention_kit.AttentionBackendTests):
    """Every test of the kit, with the example backend as ``backend``."""

    @pytest.fixture
    def backend(self):
        spec = get_registry().select("attention", "example")
        return spec.resolve()
