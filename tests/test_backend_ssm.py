"""The ssm backend matrix: every registered ssm backend runs the conformance kit."""

from __future__ import annotations

from typing import Any

import pytest

from backplane.testing.plugin import backend_params, load_backend
from backplane.testing.ssm import SSMBackendTests


class TestSSMBackend(SSMBackendTests):
    """Runs :class:`SSMBackendTests` on each registered ssm backend."""

    @pytest.fixture(params=backend_params("ssm"))
    def backend(self, request: pytest.FixtureRequest) -> Any:
        """The backend object under test."""
        return load_backend(request.param)
