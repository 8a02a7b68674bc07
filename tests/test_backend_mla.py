"""The MLA backend matrix: every registered MLA backend runs the conformance kit."""

from __future__ import annotations

from typing import Any

import pytest

from backplane.testing.mla import MLABackendTests
from backplane.testing.plugin import backend_params, load_backend


@pytest.fixture(params=backend_params("mla"))
def backend(request: pytest.FixtureRequest) -> Any:
    """Each registered MLA backend (unavailable ones are skipped with their reason)."""
    return load_backend(request.param)


class TestMLABackend(MLABackendTests):
    """The MLA conformance suite, once per registered backend."""
