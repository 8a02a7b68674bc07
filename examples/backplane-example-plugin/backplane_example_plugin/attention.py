"""The ``example`` attention backend.

It is deliberately thin: it subclasses backplane's torch reference backend and
so computes with the same custom op and honours the same out-buffer contract.
What it demonstrates is the packaging around a backend (entry point, lazy
loading, availability, conformance tests), not a new kernel. A real plugin
would implement :meth:`forward` with its own ``torch.library.custom_op``
registered through :func:`backplane.core.contract.cached_op`.
"""

from __future__ import annotations

from backplane.backends.torch.attention import TorchAttentionBackend


class ExampleAttentionBackend(TorchAttentionBackend):
    """Attention through the torch reference kernels, registered by a third-party package."""

    name = "example"
