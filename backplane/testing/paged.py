"""Conformance tests shared by the families whose op appends to a paged cache.

Attention and MLA ops take a step's new tokens, write their keys/values (or
latents) into a paged cache at ``slot_mapping`` and attend over every cached
position of each sequence. :class:`PagedBackendTests` holds the tests both
families run; :class:`~backplane.testing.attention.AttentionBackendTests` and
:class:`~backplane.testing.mla.MLABackendTests` supply the family's layer,
inputs, ``forward`` call and float64 reference through the hooks below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch

from backplane.core.layouts import TensorSpec
from backplane.core.metadata import BatchMetadata
from backplane.testing.batches import BatchCase
from backplane.testing.checks import assert_close_to_reference, no_host_sync
from backplane.testing.plugin import BackendTestsBase


class PagedBackendTests(BackendTestsBase):
    """The tests of a paged-cache family, written against the hooks a family suite fills in.

    The family's inputs object carries the cache the step writes (:meth:`cache`)
    and ``expected_cache``, the cache as it must be after the step: the kit's
    random starting cache with exactly the new tokens' rows written.
    """

    #: Key of the family's cache in ``backend.cache_spec(...)``.
    cache_name: ClassVar[str] = ""
    #: What the step writes into the cache, for failure messages.
    cache_rows: ClassVar[str] = ""
    #: Softmax scale of :meth:`test_custom_scale` (anything but the default).
    custom_scale: ClassVar[float] = 0.5

    # -- hooks of the family -------------------------------------------------------------------
    def layer(self, **kw: Any) -> Any:
        """The layer constants of a test.

        :param kw: overrides of the family's layer spec (``scale=...``).
        :return: the layer spec.
        """
        raise NotImplementedError

    def make_inputs(
        self, case: BatchCase, layer: Any, dtype: torch.dtype, device: torch.device, seed: int = 0
    ) -> Any:
        """Random inputs and a prefilled cache for ``case``.

        :param case: the batch.
        :param layer: the layer spec.
        :param dtype: activation and cache dtype.
        :param device: where the tensors go.
        :param seed: seeds the inputs.
        :return: the family's inputs object.
        """
        raise NotImplementedError

    def call_forward(
        self, backend: Any, inputs: Any, layer: Any, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Call ``backend.forward`` on ``inputs`` (inside an active forward context).

        :param backend: the backend under test.
        :param inputs: from :meth:`make_inputs`.
        :param layer: the layer spec.
        :param out: the out buffer, or ``None``.
        :return: what ``forward`` returns.
        """
        raise NotImplementedError

    def cache(self, inputs: Any) -> torch.Tensor:
        """The cache tensor of ``inputs`` the step writes.

        The families' inputs objects name their cache field as the cache spec
        does, so by default it is the field :attr:`cache_name`.

        :param inputs: from :meth:`make_inputs`.
        :return: the cache.
        """
        return getattr(inputs, self.cache_name)

    def reference(self, case: BatchCase, inputs: Any, layer: Any) -> torch.Tensor:
        """The float64 reference of the real tokens of ``case``.

        :param case: the batch.
        :param inputs: from :meth:`make_inputs`.
        :param layer: the layer spec.
        :return: ``[num_tokens, ...]`` in float64.
        """
        raise NotImplementedError

    def out_shape(self, case: BatchCase, layer: Any) -> tuple[int, ...]:
        """The full (padded) result shape of ``forward`` on ``case``.

        :param case: the batch.
        :param layer: the layer spec.
        :return: the shape.
        """
        raise NotImplementedError

    def shared_cache_layout(self, case: BatchCase, layer: Any, dtype: torch.dtype) -> TensorSpec:
        """The shared cache layout the kit fills (:mod:`backplane.core.layouts`).

        :param case: the batch (pool size and page size).
        :param layer: the layer spec.
        :param dtype: the cache dtype.
        :return: the layout.
        """
        raise NotImplementedError

    # -- helpers -------------------------------------------------------------------------------
    def run_step(
        self,
        backend: Any,
        batch: BatchMetadata,
        inputs: Any,
        layer: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Plan and run one forward of ``backend`` on ``batch``.

        :param backend: the backend under test.
        :param batch: the step's metadata.
        :param inputs: from :meth:`make_inputs`.
        :param layer: the layer spec.
        :param out: the out buffer, or ``None``.
        :return: what ``forward`` returns.
        """
        with self.planned(backend, batch):
            return self.call_forward(backend, inputs, layer, out)

    def check_cache_spec(
        self, backend: Any, case: BatchCase, layer: Any, dtype: torch.dtype
    ) -> None:
        """Skip unless the backend uses the shared cache layout (the kit writes the cache).

        :param backend: the backend under test.
        :param case: the batch.
        :param layer: the layer spec.
        :param dtype: the cache dtype.
        """
        spec = backend.cache_spec(
            layer, num_pages=case.num_pages, page_size=case.page_size, dtype=dtype
        )
        if spec.get(self.cache_name) != self.shared_cache_layout(case, layer, dtype):
            pytest.skip(f"backend cache spec {spec} is not the shared layout the kit fills")

    def check_against_reference(
        self,
        backend: Any,
        case: BatchCase,
        layer: Any,
        dtype: torch.dtype,
        device: torch.device,
        table_width: int | None = None,
        relayout: Callable[[Any], Any] | None = None,
    ) -> None:
        """Run ``case`` and compare the output and the cache with the reference.

        :param backend: the backend under test.
        :param case: the batch.
        :param layer: the layer spec.
        :param dtype: activation and cache dtype.
        :param device: where the step runs.
        :param table_width: pad the block table to this many columns (default: as narrow as fits).
        :param relayout: turns the kit's inputs into those the step gets: the
            same values in another memory layout (e.g. strided views), sharing the cache.
        """
        self.check_cache_spec(backend, case, layer, dtype)
        batch = case.metadata(device, table_width=table_width)
        inputs = self.make_inputs(case, layer, dtype, device)
        out = self.run_step(backend, batch, inputs if relayout is None else relayout(inputs), layer)
        expected_shape = self.out_shape(case, layer)
        assert tuple(out.shape) == expected_shape, (
            f"output shape {tuple(out.shape)} != {expected_shape}"
        )
        assert out.dtype == dtype
        assert_close_to_reference(
            out[: case.num_tokens],
            self.reference(case, inputs, layer),
            dtype,
            msg=f"case {case.name}",
        )
        assert torch.equal(self.cache(inputs).cpu(), inputs.expected_cache), (
            f"case {case.name}: the {self.cache_name} after the step differs from the expected "
            f"contents ({self.cache_rows} at slot_mapping, every other entry untouched)"
        )

    # -- tests ---------------------------------------------------------------------------------
    def test_matches_reference(
        self, backend: Any, case: BatchCase, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Output rows match the float64 reference; the cache holds exactly the new rows."""
        self.check_against_reference(backend, case, self.layer(), dtype, device)

    @pytest.mark.parametrize("case_name", ["decode", "mixed"])
    def test_wide_block_table(
        self, backend: Any, case_name: str, dtype: torch.dtype, device: torch.device
    ) -> None:
        """A block table wider than needed (page-0 padded, as in persistent buffers) is fine."""
        case = self.get_case(case_name)
        width = max(len(t) for t in case.page_tables) + 3
        self.check_against_reference(backend, case, self.layer(), dtype, device, width)

    @pytest.mark.parametrize("case_name", ["mixed", "decode", "prefill"])
    def test_out_contract(
        self, backend: Any, case_name: str, dtype: torch.dtype, device: torch.device
    ) -> None:
        """NaN-poisoned out: rows written, tail exactly zero, empty sentinel, same cache."""
        case = self.get_case(case_name)
        layer = self.layer()
        batch = case.metadata(device)
        inputs = self.make_inputs(case, layer, dtype, device, seed=1)
        full = self.check_out_contract(
            backend,
            batch,
            lambda out: self.call_forward(backend, inputs, layer, out),
            [self.cache(inputs)],
        )
        assert_close_to_reference(
            full[: case.num_tokens], self.reference(case, inputs, layer), dtype
        )

    def test_out_buffer_validation(self, backend: Any, device: torch.device) -> None:
        """An out buffer of the wrong shape or dtype is rejected, not silently used."""
        case = self.get_case("mixed")
        layer = self.layer()
        batch = case.metadata(device)
        inputs = self.make_inputs(case, layer, self.single_dtype, device)
        shape = self.out_shape(case, layer)
        other = torch.float64 if self.single_dtype != torch.float64 else torch.float32
        bad = [
            torch.empty(shape[0] + 1, *shape[1:], dtype=self.single_dtype, device=device),
            torch.empty(*shape[:-1], shape[-1] + 1, dtype=self.single_dtype, device=device),
            torch.empty(shape, dtype=other, device=device),
        ]
        for buf in bad:
            with pytest.raises((ValueError, RuntimeError)):
                self.run_step(backend, batch, inputs, layer, out=buf)

    def test_custom_scale(self, backend: Any, device: torch.device) -> None:
        """An explicit softmax scale is honoured (not replaced by the default)."""
        layer = self.layer(scale=self.custom_scale)
        self.check_against_reference(
            backend, self.get_case("mixed"), layer, self.single_dtype, device
        )

    def test_opcheck(self, backend: Any, device: torch.device) -> None:
        """Every custom op forward calls passes torch.library.opcheck and is a dynamic op."""
        case = self.get_case("mixed")
        layer = self.layer()
        batch = case.metadata(device)
        inputs = self.make_inputs(case, layer, self.single_dtype, device)
        self.check_custom_ops(
            backend,
            batch,
            lambda: self.call_forward(backend, inputs, layer),
            self.out_shape(case, layer),
            self.single_dtype,
        )

    @pytest.mark.gpu
    def test_no_host_sync(self, backend: Any, dtype: torch.dtype, device: torch.device) -> None:
        """The op never synchronises with the device (CUDA sync debug mode 'error')."""
        if device.type != "cuda":
            pytest.skip("host synchronisation is only observable on CUDA")
        case = self.get_case("mixed")
        layer = self.layer()
        batch = case.metadata(device)
        inputs = self.make_inputs(case, layer, dtype, device)
        out = torch.empty(self.out_shape(case, layer), dtype=dtype, device=device)
        with self.planned(backend, batch):
            torch.cuda.synchronize()
            with no_host_sync(device):
                self.call_forward(backend, inputs, layer, out)
        torch.cuda.synchronize()
        assert_close_to_reference(
            out[: case.num_tokens], self.reference(case, inputs, layer), dtype
        )
