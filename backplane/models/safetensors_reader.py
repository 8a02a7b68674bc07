"""Reading safetensors files onto a device with several threads, in file order.

The loader's memory-mapped path (``safe_open`` and ``get_tensor``, then one
``copy_`` per tensor into the model) reads a file on one thread, and on CUDA
every ``copy_`` from the page cache is a synchronous pageable host-to-device
copy that the driver stages through its own small pinned buffer (an 8B
model's 15 GiB took 4.3 s of weight load on an H100, about 3.7 GB/s;
``safe_open(..., device="cuda")`` copies the same way). :func:`read_tensors` instead parses the
header itself, cuts every tensor's bytes into chunks and has a pool of threads
read them (``os.preadv``, which releases the GIL) into pinned buffers, each
copied to the device asynchronously on the caller's stream; a buffer is
refilled once its copy is done. The tensors come out whole, on the device, in
the checkpoint's dtype and in file order, a bounded number of bytes ahead of
the caller; casting to the model's dtype is the caller's ``copy_``, on the
device.

On the CPU the threads read straight into the tensors they yield (nothing to
stage); the loader keeps the memory-mapped path there, which copies once.

The format (https://github.com/huggingface/safetensors): eight bytes, the
little-endian length of a JSON header, the header (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}}``, offsets counted from the header's end, and an
optional ``"__metadata__"``), then the data.
"""

from __future__ import annotations

import json
import os
import queue
import struct
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["TensorEntry", "UnreadableTensorError", "read_header", "read_tensors"]

#: safetensors dtype names -> torch dtypes (those torch has)
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

#: bytes one thread reads and copies at a time
CHUNK_BYTES = 16 << 20

#: bytes of tensors read ahead of the caller (one larger tensor is still read whole)
WINDOW_BYTES = 1 << 30


class UnreadableTensorError(Exception):
    """A file's header or a tensor's data cannot be read.

    :param path: the file.
    :param tensor: the tensor, or ``None`` for the header.
    :param reason: what went wrong.
    """

    def __init__(self, path: Path, tensor: str | None, reason: str) -> None:
        super().__init__(reason)
        self.path = path
        self.tensor = tensor


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a safetensors file lies.

    :param name: its name in the file.
    :param dtype: its torch dtype.
    :param shape: its shape.
    :param start: the file offset of its first byte.
    :param end: the file offset past its last byte.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""
        return self.end - self.start


def read_header(path: str | os.PathLike[str]) -> list[TensorEntry]:
    """Read where every tensor of a safetensors file lies, in file order.

    :param path: the file.
    :return: its tensors, ordered by offset.
    :raises UnreadableTensorError: the header is not a safetensors header, names a
        dtype torch lacks or a size that disagrees with the shape, or the data ends
        past the end of the file (the tensor is named where one is at fault).
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise UnreadableTensorError(path, None, "shorter than a header")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise UnreadableTensorError(path, None, f"a header of {length} bytes")
        try:
            header = json.loads(fh.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UnreadableTensorError(path, None, f"not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise UnreadableTensorError(path, None, "not a JSON object")
    base = 8 + length
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise UnreadableTensorError(path, name, f"an entry {info!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise UnreadableTensorError(path, name, f"offsets {begin}..{end} for shape {shape}")
        if base + end > size:
            raise UnreadableTensorError(path, name, f"data past the end of the file ({size} bytes)")
        entries.append(TensorEntry(name, dtype, shape, base + begin, base + end))
    entries.sort(key=lambda e: e.start)
    return entries


def _read_exactly(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` with the file's bytes from ``offset`` (``preadv`` may return fewer)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"the file ends {offset + done} bytes in")
        done += got


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s storage as a flat ``uint8`` tensor (it is contiguous and new)."""
    return tensor.reshape(-1).view(torch.uint8)


class _Staging:
    """Pinned host buffers for host-to-device copies, each free again once its copy is done.

    :param count: how many buffers.
    :param size: bytes each.
    :param stream: the stream the copies run on.
    """

    def __init__(self, count: int, size: int, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        # one pinned block, cut into buffers: one allocation however many threads read
        block = torch.empty(count * size, dtype=torch.uint8, pin_memory=True)
        self._free: queue.SimpleQueue[tuple[torch.Tensor, torch.cuda.Event]] = queue.SimpleQueue()
        for i in range(count):
            self._free.put((block[i * size : (i + 1) * size], torch.cuda.Event()))

    def copy(self, fd: int, offset: int, dest: torch.Tensor) -> None:
        """Read ``dest.numel()`` bytes of the file at ``offset`` and copy them into ``dest``.

        :param fd: the open file.
        :param offset: where the bytes start.
        :param dest: a ``uint8`` slice of a device tensor.
        """
        buffer, done = self._free.get()
        try:
            # the copy that last read this buffer must be over before it is overwritten
            done.synchronize()
            staged = buffer[: dest.numel()]
            _read_exactly(fd, memoryview(staged.numpy()), offset)
            with torch.cuda.stream(self.stream):
                dest.copy_(staged, non_blocking=True)
            done.record(self.stream)
        finally:
            self._free.put((buffer, done))


def read_tensors(
    files: Sequence[str | os.PathLike[str]],
    device: torch.device | str,
    *,
    threads: int = 8,
    chunk_bytes: int = CHUNK_BYTES,
    window_bytes: int = WINDOW_BYTES,
    skip: frozenset[str] = frozenset(),
) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Read every tensor of ``files`` onto ``device``, several threads at a time.

    On CUDA the bytes go through pinned buffers (two per thread) and are copied
    on the caller's current stream, so whatever the caller then does with a
    tensor on that stream comes after its copies. On the CPU the threads read
    straight into the tensors.

    :param files: safetensors files (their headers are read first).
    :param device: where the tensors go.
    :param threads: how many threads read (at most one a core).
    :param chunk_bytes: the most bytes one read (and one copy) moves.
    :param window_bytes: how many bytes may be read ahead of the tensor yielded last.
    :param skip: names not to read (not yielded).
    :return: ``(file, name, tensor)`` for every tensor, file by file, each file in
        offset order; a tensor is whole when it is yielded.
    :raises UnreadableTensorError: a header or a tensor's data cannot be read.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    plan = [(Path(f), e) for f in files for e in read_header(f) if e.name not in skip]
    # a small checkpoint needs no buffers larger than its largest tensor
    chunk_bytes = max(1, min(int(chunk_bytes), max((e.nbytes for _, e in plan), default=1)))
    # more readers than cores only take turns
    threads = max(1, min(int(threads), os.cpu_count() or 1))
    staging = (
        _Staging(2 * threads, chunk_bytes, torch.cuda.current_stream(device))
        if device.type == "cuda"
        else None
    )
    fds: dict[Path, int] = {}
    pending: deque[tuple[Path, TensorEntry, torch.Tensor, list[Future[None]]]] = deque()
    ahead = 0
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="safetensors-read")
    try:
        for path in dict.fromkeys(p for p, _ in plan):
            fds[path] = os.open(path, os.O_RDONLY)
        todo = deque(plan)
        while todo or pending:
            # read ahead within the window; the tensor to yield next is always being read
            while todo and (not pending or ahead + todo[0][1].nbytes <= window_bytes):
                path, entry = todo.popleft()
                tensor = torch.empty(entry.shape, dtype=entry.dtype, device=device)
                flat = _byte_view(tensor)
                jobs = [
                    pool.submit(
                        _read_chunk,
                        staging,
                        fds[path],
                        entry.start + lo,
                        flat[lo : lo + chunk_bytes],
                    )
                    for lo in range(0, entry.nbytes, chunk_bytes)
                ]
                pending.append((path, entry, tensor, jobs))
                ahead += entry.nbytes
            path, entry, tensor, jobs = pending.popleft()
            ahead -= entry.nbytes
            for job in jobs:
                try:
                    job.result()
                except OSError as exc:
                    raise UnreadableTensorError(path, entry.name, str(exc)) from None
            yield path, entry.name, tensor
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if staging is not None:
            # the pinned buffers are freed with this frame: no copy may still read them
            staging.stream.synchronize()
        for fd in fds.values():
            os.close(fd)


def _read_chunk(staging: _Staging | None, fd: int, offset: int, dest: torch.Tensor) -> None:
    """One job of :func:`read_tensors`: ``dest.numel()`` bytes at ``offset`` into ``dest``."""
    if staging is None:
        _read_exactly(fd, memoryview(dest.numpy()), offset)
    else:
        staging.copy(fd, offset, dest)
