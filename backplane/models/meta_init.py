"""Building a model on the ``meta`` device without running its modules' initialisers.

A model is built on ``meta`` and then given storage with ``to_empty``
(:func:`backplane.models.base.build_model`), so whatever a module's constructor
writes into its parameters is dropped: the loader (or a preset's own
initialisation) fills them afterwards. The random fills still run, on meta
tensors, through torch's Python references, and the first ``normal_`` among
them imports ``torch._dynamo``: about a second of every start-up that
compiles nothing (CPU, CUDA graphs off). :func:`skip_meta_init` skips those
fills, and only on meta tensors, so a tensor with storage is initialised as before.

``Module.to_empty`` has a cost of the same kind: ``torch.empty_like`` of a meta
tensor runs torch's Python reference, whose first call imports
``torch.fx.experimental.symbolic_shapes`` and with it ``sympy`` (a third of a
second). :func:`materialize` allocates the same tensors through the device's
own allocator instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["materialize", "skip_meta_init"]

#: the in-place random fills of tensors that ``torch.nn.init`` functions end in
_TENSOR_FILLS = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_})


def _is_fill(func: Callable[..., Any]) -> bool:
    """Whether ``func`` fills its first tensor in place (``torch.nn.init.*_``, ``normal_``)."""
    if func in _TENSOR_FILLS:
        return True
    name = getattr(func, "__name__", "")
    return (
        getattr(func, "__module__", None) == "torch.nn.init"
        and name.endswith("_")
        and not name.startswith("_")
    )


class skip_meta_init(TorchFunctionMode):  # noqa: N801 - used as a context manager, like torch's
    """Within it, initialising a meta tensor in place returns the tensor untouched.

    Use around a model's construction under ``torch.device("meta")``. Every
    other call, and every fill of a tensor with storage, runs as usual.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        """Skip ``func`` when it fills a meta tensor in place; run it otherwise.

        :param func: the torch function or tensor method called.
        :param types: the argument types that asked for the dispatch.
        :param args: its positional arguments.
        :param kwargs: its keyword arguments.
        :return: the tensor, untouched, for a skipped fill; else what ``func`` returns.
        """
        kwargs = dict(kwargs or {})
        if _is_fill(func):
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def _empty_on(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """The allocation ``to_empty`` makes for each tensor, without torch's Python reference."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous():
            return torch.empty(t.shape, dtype=t.dtype, device=device)
        # an unusual layout keeps the exact semantics of to_empty (memory format, overlaps)
        return torch.empty_like(t, device=device)

    return empty


def materialize(module: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """Give every parameter and buffer of ``module`` uninitialised storage on ``device``.

    The same as ``module.to_empty(device=device)`` (the same shapes, dtypes
    and parameter objects' flags), without importing ``sympy`` on the way.

    :param module: a module built on ``meta`` (tensors with storage are reallocated too).
    :param device: where the storage goes.
    :return: ``module``, as ``to_empty`` returns it.
    """
    # _apply is how Module.to_empty itself converts every tensor (parameters keep their class)
    return module._apply(_empty_on(torch.device(device)))
