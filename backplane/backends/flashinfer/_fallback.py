"""Finding the backend that runs what FlashInfer does not (SSM prefill and conv, delta decode)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def fallback_backend(family: str, preferred: tuple[str, ...] = ("triton", "torch")) -> Any:
    """Return the first available backend of ``family`` among ``preferred``.

    :param family: the op family.
    :param preferred: backend names in order of preference.
    :return: the backend object.
    :raises RuntimeError: none of them is installed and available.
    """
    from backplane.core.registry import get_registry

    registry = get_registry()
    reasons = []
    for name in preferred:
        try:
            spec = registry.get(family, name)
        except Exception as exc:  # not installed
            reasons.append(f"{name}: {exc}")
            continue
        ok, reason = spec.availability()
        if not ok:
            reasons.append(f"{name}: {reason}")
            continue
        try:
            backend = spec.resolve()
        except Exception as exc:
            reasons.append(f"{name}: failed to load ({type(exc).__name__}: {exc})")
            continue
        logger.info("flashinfer %s backend delegates to the %s backend", family, name)
        return backend
    raise RuntimeError(
        f"the FlashInfer {family} backend needs a {' or '.join(preferred)} {family} backend "
        f"for the parts FlashInfer does not run; none is usable: {'; '.join(reasons)}"
    )
