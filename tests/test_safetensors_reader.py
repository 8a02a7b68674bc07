"""The threaded safetensors reader: every tensor as safetensors itself reads it, in file
order, whatever the chunk size and read-ahead window; damaged files are named; on CUDA
the loader reads through it (the pinned staging is checked by the ``gpu`` tests)."""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from backplane.models import loader
from backplane.models.parallel import PartShard, ShardSlice
from backplane.models.safetensors_reader import (
    UnreadableTensorError,
    read_header,
    read_tensors,
)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of every common dtype and awkward sizes (a scalar, an empty one, odd lengths)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(97, 33, generator=g),
        "layer.0.q.weight": torch.randn(64, 40, generator=g).to(torch.bfloat16),
        "layer.0.k.weight": torch.randn(13, 40, generator=g).to(torch.float16),
        "layer.0.norm.weight": torch.randn(40, generator=g).double(),
        "layer.0.fp8.weight": torch.randn(24, 16, generator=g).to(torch.float8_e4m3fn),
        "positions": torch.randint(-(2**40), 2**40, (31,), generator=g),
        "mask": torch.rand(7, 5, generator=g) > 0.5,
        "bytes": torch.randint(0, 256, (1001,), generator=g, dtype=torch.uint8),
        "scale": torch.tensor(0.125),
        "nothing": torch.empty(0, 8),
    }


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    paths = []
    for i in range(2):
        path = tmp_path / f"model-{i}.safetensors"
        tensors = {f"shard{i}.{k}": v for k, v in _tensors(i).items()}
        save_file(tensors, str(path), metadata={"format": "pt"})
        paths.append(path)
    return paths


def _offset_order(path: Path) -> list[str]:
    """The tensor names of a file by data offset, from its raw header."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    header.pop("__metadata__", None)
    return sorted(header, key=lambda name: header[name]["data_offsets"][0])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaNs of a random fp8 tensor compare as bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_the_header_lists_what_safetensors_reads(files: list[Path]) -> None:
    for path in files:
        entries = read_header(path)
        assert [e.name for e in entries] == _offset_order(path)
        with safe_open(str(path), framework="pt") as handle:
            assert sorted(e.name for e in entries) == sorted(handle.keys())
            for e in entries:
                tensor = handle.get_tensor(e.name)
                assert (e.dtype, e.shape) == (tensor.dtype, tuple(tensor.shape)), e.name
                assert e.nbytes == tensor.numel() * tensor.element_size(), e.name


@pytest.mark.parametrize(
    ("threads", "chunk_bytes", "window_bytes"),
    [(1, 1 << 20, 1 << 30), (3, 7, 64), (2, 100, 0)],
)
def test_every_tensor_is_read_whole_in_file_order(
    files: list[Path], threads: int, chunk_bytes: int, window_bytes: int
) -> None:
    expected = {k: v for path in files for k, v in load_file(str(path)).items()}
    got = list(
        read_tensors(
            files, "cpu", threads=threads, chunk_bytes=chunk_bytes, window_bytes=window_bytes
        )
    )
    assert [name for _, name, _ in got] == [n for path in files for n in _offset_order(path)]
    assert [path for path, _, _ in got] == [p for p in files for _ in _offset_order(p)]
    for _, name, tensor in got:
        assert _same(tensor, expected[name]), name


def test_skipped_tensors_are_not_read(files: list[Path]) -> None:
    skip = frozenset({"shard0.embed.weight", "shard1.mask"})
    names = [name for _, name, _ in read_tensors(files, "cpu", skip=skip)]
    assert skip.isdisjoint(names)
    assert len(names) == 2 * len(_tensors(0)) - len(skip)


def test_a_truncated_file_names_the_tensor_past_its_end(files: list[Path]) -> None:
    path = files[1]
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    last = _offset_order(path)[-1]
    with pytest.raises(UnreadableTensorError) as info:
        list(read_tensors(files, "cpu"))
    assert (info.value.path, info.value.tensor) == (path, last)


def test_a_file_that_is_not_safetensors_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(UnreadableTensorError) as info:
        read_header(path)
    assert (info.value.path, info.value.tensor) == (path, None)


def test_closing_early_stops_the_readers(files: list[Path]) -> None:
    def readers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("safetensors-read")]

    before = readers()
    stream = read_tensors(files, "cpu", threads=2, chunk_bytes=16)
    next(stream)
    assert len(readers()) > len(before)
    stream.close()
    assert readers() == before


def test_the_loader_reads_on_the_cpu_through_memory_maps(
    files: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def unexpected(*args: object, **kwargs: object) -> None:
        raise AssertionError("the CPU path copies from the memory maps")

    monkeypatch.setattr(loader, "read_tensors", unexpected)
    expected = {k: v for path in files for k, v in load_file(str(path)).items()}
    got = dict(loader.iter_safetensors(files, progress=False, device="cpu"))
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert _same(tensor, expected[name]), name


# -- CUDA: the pinned staging and the loader's use of it ------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("threads", "chunk_bytes"), [(2, 64), (4, 1 << 20)])
def test_tensors_reach_the_gpu_through_pinned_buffers(
    files: list[Path], threads: int, chunk_bytes: int
) -> None:
    expected = {k: v for path in files for k, v in load_file(str(path)).items()}
    # two buffers per thread for hundreds of chunks: every buffer is reused many times
    got = list(
        read_tensors(files, "cuda", threads=threads, chunk_bytes=chunk_bytes, window_bytes=256)
    )
    assert len(got) == len(expected)
    for _, name, tensor in got:
        assert tensor.device.type == "cuda", name
        assert _same(tensor.cpu(), expected[name]), name


@pytest.mark.gpu
def test_the_loader_reads_whole_tensors_to_the_gpu_and_slices_through_memory_maps(
    files: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    staged: list[str] = []

    def spy(*args: Any, **kwargs: Any) -> Iterator[tuple[Path, str, torch.Tensor]]:
        for path, name, tensor in read_tensors(*args, **kwargs):
            staged.append(name)
            yield path, name, tensor

    monkeypatch.setattr(loader, "read_tensors", spy)
    sliced = "shard0.embed.weight"
    half = ShardSlice(0, PartShard(total=97, start=48, stop=96))

    expected = {k: v for path in files for k, v in load_file(str(path)).items()}
    got = dict(
        loader.iter_safetensors(
            files,
            progress=False,
            device="cuda",
            shard_of=lambda name: half if name == sliced else None,
        )
    )
    assert got.keys() == expected.keys()
    assert sorted(staged) == sorted(set(expected) - {sliced})
    for name in staged:
        assert got[name].device.type == "cuda", name
        assert _same(got[name].cpu(), expected[name]), name
    assert _same(got[sliced], expected[sliced][48:96])


def test_a_load_that_fails_part_way_stops_reading(files: list[Path]) -> None:
    from backplane.models.base import WeightLoadError

    class Refusing:
        def load_weights(self, tensors: Iterator[tuple[str, torch.Tensor]], strict: bool) -> None:
            name, _ = next(iter(tensors))
            raise WeightLoadError("wrong shape", tensor=name)

    stream = (item[1:] for item in read_tensors(files, "cpu", threads=2, chunk_bytes=16))
    with pytest.raises(WeightLoadError, match=r"^model: wrong shape"):
        loader._load(Refusing(), stream, lambda name: None, Path("model"))  # type: ignore[arg-type]
    assert stream.gi_frame is None
    assert not [t for t in threading.enumerate() if t.name.startswith("safetensors-read")]
