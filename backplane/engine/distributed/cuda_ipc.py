"""Device memory shared between the ranks' processes through CUDA IPC handles.

The one-shot all-reduce (:mod:`.one_shot`) reads its peers' exchange buffers
directly. Each rank allocates its buffer with ``cudaMalloc`` (outside PyTorch's
caching allocator, so the handle covers exactly that buffer), exports a
``cudaIpcMemHandle_t``, and every peer opens it into its own address space with
peer access enabled. The handles are plain bytes, so any collective that moves
Python objects hands them round.

This is the CUDA runtime's own API, called through :mod:`ctypes` on the
``libcudart`` PyTorch has loaded: it keeps no state of its own between process
groups, so an engine started after another in the same process maps its
buffers afresh (PyTorch's symmetric memory keys its rendezvous by group name,
and a new default group takes the old one's name).
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

import torch

__all__ = ["CudaIpcError", "SharedBuffer", "cudart"]

#: ``cudaIpcMemLazyEnablePeerAccess``: opening a peer's handle enables access to its GPU
_LAZY_PEER_ACCESS = 1


class CudaIpcError(RuntimeError):
    """A CUDA runtime call of the buffer sharing failed (the message names the call)."""


class _IpcHandle(ctypes.Structure):
    """``cudaIpcMemHandle_t``: 64 opaque bytes."""

    _fields_ = [("reserved", ctypes.c_byte * 64)]


class _CudaRuntime:
    """The few CUDA runtime functions the sharing needs, each raising on an error code.

    :param lib: the loaded ``libcudart``.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        sigs = {
            "cudaSetDevice": [ctypes.c_int],
            "cudaMalloc": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t],
            "cudaFree": [ctypes.c_void_p],
            "cudaMemset": [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t],
            "cudaIpcGetMemHandle": [ctypes.POINTER(_IpcHandle), ctypes.c_void_p],
            "cudaIpcOpenMemHandle": [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint],
            "cudaIpcCloseMemHandle": [ctypes.c_void_p],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = (
            [ctypes.c_int],
            (ctypes.c_char_p),
        )

    def _call(self, name: str, *args: object) -> None:
        code = getattr(self._lib, name)(*args)
        if code != 0:
            what = self._lib.cudaGetErrorString(code).decode(errors="replace")
            raise CudaIpcError(f"{name} failed: {what} (CUDA error {code})")

    def malloc(self, device: int, nbytes: int) -> int:
        """Allocate ``nbytes`` on ``device``, zeroed; return the address."""
        self._call("cudaSetDevice", device)
        ptr = ctypes.c_void_p()
        self._call("cudaMalloc", ctypes.byref(ptr), nbytes)
        assert ptr.value is not None
        self._call("cudaMemset", ptr, 0, nbytes)
        return int(ptr.value)

    def free(self, device: int, ptr: int) -> None:
        """Free an allocation of :meth:`malloc`."""
        self._call("cudaSetDevice", device)
        self._call("cudaFree", ctypes.c_void_p(ptr))

    def export(self, ptr: int) -> bytes:
        """The IPC handle of an allocation, as bytes another process can open."""
        handle = _IpcHandle()
        self._call("cudaIpcGetMemHandle", ctypes.byref(handle), ctypes.c_void_p(ptr))
        return bytes(handle.reserved)

    def open(self, device: int, handle: bytes) -> int:
        """Map another process's allocation into ``device``'s address space; return its
        address here."""
        raw = _IpcHandle()
        ctypes.memmove(raw.reserved, handle, len(handle))
        self._call("cudaSetDevice", device)
        ptr = ctypes.c_void_p()
        self._call("cudaIpcOpenMemHandle", ctypes.byref(ptr), raw, _LAZY_PEER_ACCESS)
        assert ptr.value is not None
        return int(ptr.value)

    def close(self, device: int, ptr: int) -> None:
        """Unmap an address of :meth:`open`."""
        self._call("cudaSetDevice", device)
        self._call("cudaIpcCloseMemHandle", ctypes.c_void_p(ptr))


@cache
def cudart() -> _CudaRuntime:
    """The CUDA runtime PyTorch loaded (found among the process's mapped libraries).

    :raises CudaIpcError: no CUDA runtime library could be loaded.
    """
    torch.cuda.init()
    candidates: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libcudart") and path not in candidates:
                    candidates.append(path)
    except OSError:
        pass
    candidates += ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    for path in candidates:
        try:
            return _CudaRuntime(ctypes.CDLL(path))
        except (OSError, AttributeError):
            continue
    raise CudaIpcError("no CUDA runtime library (libcudart) could be loaded")


class SharedBuffer:
    """A zeroed device buffer of this rank that its peers' processes map too.

    :param device: this rank's GPU (the current device).
    :param nbytes: the buffer's size.
    """

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device, self.nbytes = device, nbytes
        self._rt = cudart()
        self.ptr = self._rt.malloc(self._index, nbytes)
        self._opened: list[int] = []

    @property
    def _index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def handle(self) -> bytes:
        """This buffer's IPC handle, for the peers to :meth:`open`."""
        return self._rt.export(self.ptr)

    def open(self, handle: bytes) -> int:
        """Map a peer's buffer (its :meth:`handle`) here; return its address on this GPU.

        Unmapped by :meth:`close`.
        """
        ptr = self._rt.open(self._index, handle)
        self._opened.append(ptr)
        return ptr

    def close(self) -> None:
        """Unmap the peers' buffers and free this one (no kernel may use them any more)."""
        torch.cuda.synchronize(self.device)
        opened, self._opened = self._opened, []
        for ptr in opened:
            self._rt.close(self._index, ptr)
        if self.ptr:
            self._rt.free(self._index, self.ptr)
            self.ptr = 0
