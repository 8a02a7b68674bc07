"""The pytest side of the conformance kit.

Load it from a ``conftest.py`` at the root of a test suite::

    pytest_plugins = ["backplane.testing.plugin"]

or on the command line with ``pytest -p backplane.testing.plugin``. It adds:

* the option ``--backplane-backend NAME`` (or ``FAMILY=NAME``, repeatable):
  run only the conformance tests of the named backend(s); tests of other
  backends are deselected;
* :func:`backend_params`: one ``pytest.param`` per registered backend of a
  family, for parametrising a ``backend`` fixture; unavailable backends are
  skipped with their reason;
* :class:`BackendTestsBase`: the skeleton every family suite shares
  (``device``, ``dtype`` and ``backend_capabilities`` fixtures, the batch-case
  loop, the out-buffer contract, no-host-sync and opcheck runners).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import pytest
import torch

from backplane.core.backend_spec import BackendSpec
from backplane.core.errors import UnsupportedLayerError
from backplane.core.forward_context import forward_context
from backplane.core.metadata import BatchMetadata
from backplane.testing.batches import BatchCase, batch_cases
from backplane.testing.checks import check_custom_ops, check_out_contract, no_host_sync

OPTION = "--backplane-backend"
_MARKER = "backplane_backend"


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--backplane-backend``."""
    group = parser.getgroup("backplane", "backplane conformance kit")
    group.addoption(
        OPTION,
        action="append",
        default=[],
        metavar="[FAMILY=]NAME",
        help=(
            "run the conformance tests of this backend only (all families, or just FAMILY "
            "with FAMILY=NAME); repeatable"
        ),
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers the kit uses."""
    config.addinivalue_line("markers", f"{_MARKER}(family, name): conformance test of one backend")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def _parse_selection(values: list[str]) -> tuple[set[str], dict[str, set[str]]]:
    anywhere: set[str] = set()
    per_family: dict[str, set[str]] = {}
    for raw in values:
        for item in raw.split(","):
            item = item.strip()
            if not item:
                continue
            family, sep, name = item.partition("=")
            if sep:
                per_family.setdefault(family.strip(), set()).add(name.strip())
            else:
                anywhere.add(item)
    return anywhere, per_family


def _selected(family: str, name: str, anywhere: set[str], per_family: dict[str, set[str]]) -> bool:
    if family in per_family:
        return name in per_family[family]
    if anywhere:
        return name in anywhere
    return not per_family


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """Report a backend that cannot run a test's layer shape or dtype as a skip.

    The shared cases use small shapes; a backend with shape limits raises
    :class:`~backplane.core.errors.UnsupportedLayerError` for them, and its own
    kit subclass runs the tests at shapes it supports.
    """
    try:
        return (yield)
    except UnsupportedLayerError as exc:
        pytest.skip(f"backend cannot run this layer: {exc}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect conformance tests of backends not named by ``--backplane-backend``."""
    values = config.getoption(OPTION, default=[]) or []
    if not values:
        return
    anywhere, per_family = _parse_selection(values)
    _check_names(anywhere, per_family)
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker(_MARKER)
        if marker is None:
            keep.append(item)
            continue
        family, name = marker.args[:2]
        (keep if _selected(family, name, anywhere, per_family) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _check_names(anywhere: set[str], per_family: dict[str, set[str]]) -> None:
    from backplane.core.hookspecs import FAMILIES
    from backplane.core.registry import get_registry

    registry = get_registry()
    known = {(s.family, s.name) for s in registry.backends()}
    for family, names in per_family.items():
        if family not in FAMILIES:
            raise pytest.UsageError(
                f"{OPTION} {family}=...: unknown family; the families are {', '.join(FAMILIES)}"
            )
        for name in names:
            if (family, name) not in known:
                installed = sorted(n for f, n in known if f == family)
                raise pytest.UsageError(
                    f"{OPTION} {family}={name}: no such {family} backend; installed: "
                    f"{', '.join(installed) or '(none)'}"
                )
    for name in anywhere:
        if not any(n == name for _, n in known):
            installed = sorted({n for _, n in known})
            raise pytest.UsageError(
                f"{OPTION} {name}: no backend of that name in any family; installed: "
                f"{', '.join(installed) or '(none)'}"
            )


def backend_params(family: str) -> list[Any]:
    """Return one ``pytest.param`` per registered backend of ``family``.

    Each param's value is the :class:`~backplane.core.backend_spec.BackendSpec`
    (turn it into the backend object with :func:`load_backend`), its id is the
    backend's name, and it carries a marker that ``--backplane-backend``
    filters on. A backend that cannot run here is skipped with its reason.

    :param family: ``attention``, ``ssm``, ``mla`` or ``delta``.
    :return: the params, best priority first.
    """
    from backplane.core.registry import get_registry

    params = []
    for spec in get_registry().backends(family):
        marks: list[Any] = [getattr(pytest.mark, _MARKER)(family, spec.name)]
        ok, reason = spec.availability()
        if not ok:
            marks.append(pytest.mark.skip(reason=f"{family} backend {spec.name!r}: {reason}"))
        params.append(pytest.param(spec, id=spec.name, marks=marks))
    if not params:
        params.append(
            pytest.param(
                None,
                id=f"no-{family}-backend",
                marks=pytest.mark.skip(reason=f"no {family} backend is registered"),
            )
        )
    return params


@functools.cache
def _load(spec: BackendSpec) -> Any:
    from backplane.core.registry import get_registry
    from backplane.engine import selection

    return selection.load_backend(spec, registry=get_registry())


def load_backend(spec: BackendSpec) -> Any:
    """Return the backend object of ``spec``, loaded once per test session.

    Loaded as the engine loads it (:func:`backplane.engine.selection.load_backend`):
    a backend that runs part of its work on another backend of its family gets
    that fallback.

    :param spec: a spec from :func:`backend_params`.
    :return: the backend object.
    """
    return _load(spec)


def capabilities_of(family: str, backend: Any) -> frozenset[str] | None:
    """Look up the declared capabilities of a backend object in the registry.

    :param family: the backend's family.
    :param backend: the backend object (its ``name`` attribute is looked up).
    :return: the capabilities, or ``None`` when the backend is not registered.
    """
    from backplane.core.registry import get_registry

    name = getattr(backend, "name", "")
    for spec in get_registry().backends(family):
        if spec.name == name:
            return spec.capabilities
    return None


_DEVICE_PARAMS = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
        ],
    ),
]
_DTYPE_PARAMS = [
    pytest.param(torch.float32, id="float32"),
    pytest.param(torch.bfloat16, id="bfloat16"),
    pytest.param(torch.float16, id="float16"),
]


class BackendTestsBase:
    """The skeleton every family suite shares.

    A family suite (:class:`~backplane.testing.attention.AttentionBackendTests`
    and the others) subclasses it with its inputs, references and tests; a
    backend's test class subclasses the family suite and provides a
    ``backend`` fixture returning the backend object. It may override
    ``device`` / ``dtype`` (e.g. to run CUDA only), ``backend_capabilities``
    (for a backend not registered through a plugin) and the class attributes.
    Devices and dtypes the backend's declared capabilities do not list
    (``"cpu"``, ``"cuda"``, ``"float32"``...) are skipped.

    What it gives every family:

    * the ``device``, ``dtype`` and ``backend_capabilities`` fixtures;
    * the batch loop: a test taking a ``case`` argument runs once per batch of
      :meth:`cases`; :meth:`get_case` picks one batch by name;
    * :meth:`planned`: the backend's plan of a batch as the active forward context;
    * :meth:`check_out_contract`: the out-buffer contract of one op call, with
      NaN-poisoned ``out`` and no host synchronisation inside the op;
    * :meth:`check_custom_ops`: the custom ops of one call are dynamic ops and
      pass ``opcheck``.
    """

    family: ClassVar[str] = ""
    #: Page size of every case, or ``None`` for the kit's mix of small pages.
    page_size: ClassVar[int | None] = None
    #: dtype of the tests that run in one dtype only (opcheck, custom scale, out validation).
    single_dtype: ClassVar[torch.dtype] = torch.float32

    # -- parametrisation -----------------------------------------------------------------------
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Run each test that takes a ``case`` argument once per batch of :meth:`cases`.

        :param metafunc: the test function being parametrised.
        """
        if "case" in metafunc.fixturenames:
            metafunc.parametrize("case", self.cases(), ids=lambda c: c.name)

    @classmethod
    def cases(cls) -> list[BatchCase]:
        """The batches a ``case`` test runs on (the kit's standard ragged batches).

        :return: the cases, with :attr:`page_size` pages when it is set.
        """
        return batch_cases(page_size=cls.page_size)

    def get_case(self, name: str) -> BatchCase:
        """One batch of :meth:`cases`.

        :param name: the case's name (``"prefill"``, ``"decode"``, ``"mixed"``...).
        :return: the case.
        """
        cases = self.cases()
        for case in cases:
            if case.name == name:
                return case
        raise KeyError(f"no batch case {name!r}; the cases are {', '.join(c.name for c in cases)}")

    @pytest.fixture
    def backend_capabilities(self, backend: Any) -> frozenset[str] | None:
        """The backend's capability tags, ``None`` when unknown (nothing is gated off)."""
        return capabilities_of(self.family, backend)

    @pytest.fixture(params=_DEVICE_PARAMS)
    def device(self, request: pytest.FixtureRequest, backend_capabilities: Any) -> torch.device:
        """The device the backend runs on."""
        require(backend_capabilities, request.param)
        return torch.device(request.param)

    @pytest.fixture(params=_DTYPE_PARAMS)
    def dtype(self, request: pytest.FixtureRequest, backend_capabilities: Any) -> torch.dtype:
        """The activation and cache dtype."""
        require(backend_capabilities, str(request.param).removeprefix("torch."))
        return request.param

    # -- running ops ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def planned(self, backend: Any, batch: BatchMetadata) -> Iterator[None]:
        """Plan ``batch`` with ``backend`` and make it the active forward context.

        :param backend: the backend under test.
        :param batch: the step's metadata.
        """
        with forward_context(batch, {self.family: backend.plan(batch)}):
            yield

    def check_out_contract(
        self,
        backend: Any,
        batch: BatchMetadata,
        call: Callable[[torch.Tensor | None], torch.Tensor],
        caches: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """Check the out-buffer contract of one op call on a planned batch.

        See :func:`backplane.testing.checks.check_out_contract`; every call of
        the op additionally runs under :func:`~backplane.testing.checks.no_host_sync`.

        :param backend: the backend under test (it plans ``batch``).
        :param batch: the step's metadata.
        :param call: calls the op once, with the given ``out`` (or ``None``).
        :param caches: every cache or state the op writes.
        :return: the op's result without ``out`` (compare it with a reference).
        """

        def run(out: torch.Tensor | None) -> torch.Tensor:
            with no_host_sync(batch.device):
                return call(out)

        with self.planned(backend, batch):
            return check_out_contract(run, caches, batch.num_tokens)

    def check_custom_ops(
        self,
        backend: Any,
        batch: BatchMetadata,
        fn: Callable[[], Any],
        out_shape: Sequence[int],
        out_dtype: torch.dtype,
    ) -> int:
        """Check the custom ops of one call on a planned batch.

        See :func:`backplane.testing.checks.check_custom_ops`.

        :param backend: the backend under test (it plans ``batch``).
        :param batch: the step's metadata (it must not read the state it writes).
        :param fn: calls the op once.
        :param out_shape: the op's full result shape.
        :param out_dtype: the op's result dtype.
        :return: the number of op calls checked.
        """
        with self.planned(backend, batch):
            return check_custom_ops(backend, fn, out_shape, out_dtype)


def require(capabilities: frozenset[str] | None, *tags: str) -> None:
    """Skip the running test unless the backend declares every tag.

    :param capabilities: the declared capabilities (``None``: unknown, run anyway
        for device/dtype tags).
    :param tags: the capability tags the test needs.
    """
    if capabilities is None:
        return
    missing = [t for t in tags if t not in capabilities]
    if missing:
        pytest.skip(f"backend does not declare capability {', '.join(missing)}")


def require_feature(capabilities: frozenset[str] | None, *tags: str) -> None:
    """Skip unless the backend declares every feature tag (unknown capabilities skip too).

    :param capabilities: the declared capabilities, ``None`` when unknown.
    :param tags: the feature tags the test needs (``"sliding_window"``, ``"gqa"``...).
    """
    if capabilities is None:
        pytest.skip(f"backend capabilities unknown; {', '.join(tags)} not declared")
    require(capabilities, *tags)
