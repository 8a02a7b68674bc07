"""The attention backend matrix: every registered attention backend runs the conformance kit."""

from __future__ import annotations

from typing import Any

import pytest

from backplane.testing.attention import AttentionBackendTests
from backplane.testing.plugin import backend_params, load_backend


@pytest.fixture(params=backend_params("attention"))
def backend(request: pytest.FixtureRequest) -> Any:
    """Each registered attention backend (unavailable ones are skipped with their reason)."""
    return load_backend(request.param)


class TestAttentionBackend(AttentionBackendTests):
    """The attention conformance suite, once per registered backend."""
