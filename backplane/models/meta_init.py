"""Building a model on the ``meta`` device without running its modules' initialisers.

A model is built on ``meta`` and then given storage with ``to_empty``
(:func:`backplane.models.base.build_model`), so whatever a module's constructor
writes into its parameters is dropped: the loader (or a preset's own
initialisation) fills them afterwards. The random fills still run, on meta
tensors, through torch's Python references, and the first ``normal_`` among
them imports ``torch._dynamo``: about a second of every start-up that
compiles nothing (CPU, CUDA graphs off). :func:`skip_meta_init` skips those
fills, and only on meta tensors, so a tensor with storage is initialised as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["skip_meta_init"]

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
