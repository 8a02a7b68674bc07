"""Opening a GGUF file: its metadata and the raw bytes of its tensors, through the ``gguf`` package.

The ``gguf`` package (llama.cpp's own reader) parses the header; backplane
reads the metadata values and each tensor's bytes from it and does the
dequantisation itself, in torch (:mod:`backplane.models.gguf.dequant`). The
package is an optional dependency (``pip install gguf``, or backplane's
``gguf`` extra) imported only when a GGUF file is opened.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backplane.core.errors import ConfigError


def import_gguf() -> Any:
    """Import the ``gguf`` package.

    :raises ConfigError: when it is not installed, saying how to install it.
    """
    try:
        import gguf
    except ImportError:
        raise ConfigError(
            "reading GGUF files needs the gguf package: pip install gguf "
            "(or install backplane with its gguf extra: pip install 'backplane[gguf]')"
        ) from None
    return gguf


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file.

    :param name: its GGUF name (``blk.0.attn_q.weight``).
    :param ggml_type: the ggml type id of its data.
    :param shape: its shape in torch order (the reverse of GGUF's dimension list).
    :param data: its raw bytes (a read-only memory map).
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray

    def raw(self, device: torch.device | str) -> torch.Tensor:
        """The tensor's bytes as a 1-D ``uint8`` tensor on ``device``."""
        flat = np.ascontiguousarray(self.data).reshape(-1).view(np.uint8)
        with warnings.catch_warnings():
            # The memory map is read-only; the bytes are only read (and copied to the device).
            warnings.simplefilter("ignore", UserWarning)
            host = torch.from_numpy(flat)
        return host.to(device)


class GGUFFile:
    """The metadata and tensors of one GGUF file.

    :param path: the ``.gguf`` file.
    :raises ConfigError: the ``gguf`` package is missing, or the file cannot be
        parsed (truncated, not GGUF), naming the file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        gguf = import_gguf()
        self.path = Path(path)
        try:
            reader = gguf.GGUFReader(str(self.path), "r")
            self.metadata: dict[str, Any] = {k: f.contents() for k, f in reader.fields.items()}
            self.tensors = [
                GGUFTensor(
                    name=t.name,
                    ggml_type=int(t.tensor_type),
                    shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                    data=t.data,
                )
                for t in reader.tensors
            ]
        except (ValueError, OSError, KeyError, IndexError, TypeError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"{self.path}: cannot read it as a GGUF file ({type(exc).__name__}: {exc}); "
                "it may be truncated or damaged: download it again"
            ) from None

    @property
    def architecture(self) -> str:
        """``general.architecture`` (``llama``, ``qwen3``...)."""
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value of ``key``, or ``default``."""
        value = self.metadata.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        """The metadata value of ``key``.

        :raises ConfigError: naming the file and the key when it is missing.
        """
        value = self.metadata.get(key)
        if value is None:
            raise ConfigError(
                f"{self.path}: the GGUF metadata lacks {key!r}; the file is incomplete or was "
                "written for another program"
            )
        return value

    def tensor_names(self) -> set[str]:
        """The names of the file's tensors."""
        return {t.name for t in self.tensors}
