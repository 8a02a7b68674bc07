"""Choosing the backend of each op family: the one home of backend selection.

* :func:`select_backend` turns one configured value into a spec: a backend
  name must be installed and able to run on the device; ``auto`` ranks the
  backends that can by their measured decode speed on the device's class
  (:func:`device_class_of`, ``BackendSpec.speed``), then by priority, takes the
  first, and logs why, with the figures compared, and why each other one lost.
  Under speculative decoding ``auto`` first prefers, for the recurrent families
  (``ssm``, ``delta``), the backends that declare
  :data:`~backplane.core.backend_spec.CHAINED_ROWS` (their verification runs in
  captured verify graphs).
* :func:`select_backends` does that for the families a model uses, from an
  :class:`~backplane.engine.config.EngineConfig` (errors name the file and
  key, or the flag, the value came from).
* :func:`load_backend` makes the backend object of a spec, and hands a backend
  that ``needs_fallback`` the backend that runs what it does not (its prefill),
  chosen like ``auto`` among the other backends of its family but ranked by
  their measured prefill speed.
* :func:`select_backends_for` loads one backend object per family from
  explicit ``{family: name}`` choices, with no engine configuration (the
  ahead-of-time kernel warm-up).
* :func:`select_fused_ops` decides who runs the models' fused elementwise work
  (``fused_ops``: Triton kernels or torch ops) on the engine's device.
* :class:`BackendSelection` holds the backends of one engine and replaces a
  backend chosen by ``auto`` that cannot run one of the model's layers (it
  raised :class:`~backplane.core.errors.UnsupportedLayerError`) with the next
  one ``auto`` would choose. A backend named in the configuration is never
  replaced.

Every function takes the plugin registry to choose from; ``None`` means the
process-wide one (:func:`backplane.core.registry.get_registry`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING

from backplane.core.backend_spec import CHAINED_ROWS, BackendSpec
from backplane.core.errors import (
    BackendUnavailableError,
    BackplaneError,
    ConfigError,
    PluginError,
)
from backplane.core.hookspecs import FAMILIES
from backplane.core.registry import BackendRegistry, get_registry

if TYPE_CHECKING:
    import torch

    from backplane.core.families import Backend
    from backplane.engine.config import EngineConfig

logger = logging.getLogger(__name__)

__all__ = [
    "DEVICE_TAGS",
    "RECURRENT_FAMILIES",
    "BackendSelection",
    "device_class_of",
    "load_backend",
    "preference_of",
    "runs_on",
    "select_backend",
    "select_backends",
    "select_backends_for",
    "select_fused_ops",
]

#: Capability tags that name a device type. A backend that declares any of them
#: runs only on the device types it declares; one that declares none is assumed
#: to run wherever its availability check says it can.
DEVICE_TAGS: frozenset[str] = frozenset({"cpu", "cuda", "rocm", "mps", "xpu"})

#: Capability of a backend whose kernels run in an interpreter here (Triton's, under
#: ``TRITON_INTERPRET=1``): ``auto`` takes it only when nothing else can run.
INTERPRETED = "interpret"

#: The families whose backends keep recurrent state per sequence.
RECURRENT_FAMILIES: frozenset[str] = frozenset({"ssm", "delta"})

#: Why ``auto`` prefers the backends that declare a capability (see :func:`preference_of`).
_PREFERRED_FOR = {
    CHAINED_ROWS: "it chains rows, so speculative verification runs in verify graphs",
}


def preference_of(config: EngineConfig, family: str) -> str | None:
    """Name the capability ``auto`` prefers for ``family`` under ``config``.

    With speculative decoding on, a recurrent family's backend that does not
    chain rows makes every verification step run through piecewise graphs
    (many times slower per token), so ``auto`` prefers the ones that do.

    :param config: the engine configuration (its ``speculative_config``).
    :param family: the op family.
    :return: :data:`~backplane.core.backend_spec.CHAINED_ROWS` for ``ssm`` and
        ``delta`` under speculation, else ``None`` (no preference).
    """
    if config.speculative_config is not None and family in RECURRENT_FAMILIES:
        return CHAINED_ROWS
    return None


def runs_on(spec: BackendSpec, device: str | None) -> tuple[bool, str]:
    """Say whether the backend of ``spec`` can run here, on ``device``.

    :param spec: the backend's spec.
    :param device: the device the engine runs on (``"cpu"``, ``"cuda"``,
        ``"cuda:1"``); a backend whose capabilities name device types (see
        :data:`DEVICE_TAGS`) must name this one. ``None`` skips that check.
    :return: ``(ok, reason)``: the reason says why not (the device, or the
        backend's own availability check).
    """
    if device is not None:
        device_type = device.split(":", 1)[0]
        declared = spec.capabilities & DEVICE_TAGS
        if declared and device_type not in declared:
            return False, (
                f"it does not run on {device_type} (it supports: {', '.join(sorted(declared))})"
            )
    return spec.availability()


def device_class_of(device: str | None) -> str | None:
    """Name the class of ``device`` that backends' measured figures are given for.

    :param device: the device the engine runs on (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
    :return: ``"smXY"`` for a CUDA device of compute capability X.Y (``"sm90"`` for
        H100 and H200, ``"sm80"`` for A100), ``"cpu"`` for the CPU, the device type
        for other devices, ``"cuda"`` when the CUDA device cannot be asked (no
        driver, a ROCm build: no figures match it) and ``None`` for ``None``.
    """
    if device is None:
        return None
    device_type, _, index = device.partition(":")
    if device_type != "cuda":
        return device_type
    import torch

    # ROCm builds answer through torch.cuda with gfx numbers that are not sm classes
    if getattr(torch.version, "hip", None) or not torch.cuda.is_available():
        return "cuda"
    try:
        major, minor = torch.cuda.get_device_capability(int(index) if index else None)
    except (AssertionError, RuntimeError, ValueError):  # an index this machine lacks
        return "cuda"
    return f"sm{major}{minor}"


def _registry(registry: BackendRegistry | None) -> BackendRegistry:
    return registry if registry is not None else get_registry()


def _tok_s(value: float) -> str:
    """A figure as logged: whole tokens per second, a few digits below 100."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _auto(
    registry: BackendRegistry,
    family: str,
    device: str | None,
    exclude: Collection[str] = (),
    *,
    device_class: str | None = None,
    kind: str = "decode",
    prefer: str | None = None,
) -> tuple[list[BackendSpec], list[str], str]:
    """Rank the backends of ``family`` the way ``auto`` does.

    The backends that can run here are ranked by their ``kind`` figure on
    ``device_class``, fastest first; those without one follow, and priority
    (then name: the registry's order) decides among equal figures and among
    backends without figures. Those that declare ``prefer`` (a capability)
    come before those that do not, ranked the same way among themselves.

    :return: the backends that can run here, best first; for every other
        backend (``exclude`` left out), in registry order, why the first one
        beat it; and why the first one was chosen (the figures compared and
        their source, or its priority).
    """
    ranked = [spec for spec in registry.backends(family) if spec.name not in exclude]
    verdicts = [(spec, *runs_on(spec, device)) for spec in ranked]
    figures = {spec.name: spec.figure(device_class, kind) for spec in ranked}
    # a stable sort: equal figures (and no figures) keep the registry's priority order;
    # a backend that runs in an interpreter (a debugging aid, orders of magnitude slower)
    # comes last, so setting TRITON_INTERPRET=1 does not change what auto picks
    plain = sorted(
        (spec for spec, ok, _ in verdicts if ok),
        key=lambda spec: (
            INTERPRETED in spec.capabilities,
            figures[spec.name] is None,
            -(figures[spec.name] or 0.0),
        ),
    )
    # stable again: the preference ranks above figures and priority, not above the
    # interpreter rule; with no usable backend declaring it, the order is unchanged
    usable = sorted(
        plain,
        key=lambda spec: (INTERPRETED in spec.capabilities, prefer not in spec.capabilities),
    )
    if not usable:
        return usable, [f"{spec.name} (unavailable: {reason})" for spec, _, reason in verdicts], ""
    best = usable[0]
    # the preference decided when it moved a backend that ranked above the chosen one
    passed_over = [spec.name for spec in plain[: plain.index(best)]] if prefer else []
    because = _PREFERRED_FOR.get(prefer or "", f"it declares {prefer!r}")
    best_figure = figures[best.name]
    where = f"tok/s on {device_class}"
    lost: list[str] = []
    for spec, ok, reason in verdicts:
        value = figures[spec.name]
        if not ok:
            lost.append(f"{spec.name} (unavailable: {reason})")
        elif spec is best:
            continue
        elif INTERPRETED in spec.capabilities and INTERPRETED not in best.capabilities:
            lost.append(f"{spec.name} (runs in an interpreter here; name it to use it)")
        elif spec.name in passed_over:
            lost.append(f"{spec.name} (lacks {prefer!r}; name it to use it)")
        elif best_figure is not None and value is None:
            lost.append(f"{spec.name} (no {kind} figure on {device_class})")
        elif best_figure is not None and value is not None and value != best_figure:
            lost.append(f"{spec.name} ({kind} {_tok_s(value)} < {_tok_s(best_figure)} {where})")
        elif spec.priority == best.priority:
            lost.append(f"{spec.name} (same priority {spec.priority}; ties go by name)")
        else:
            lost.append(f"{spec.name} (priority {spec.priority} < {best.priority})")
    why = f"plugin {best.plugin}, priority {best.priority}"
    if passed_over:
        why += f"; preferred over {', '.join(passed_over)}: {because}"
    if best_figure is None or device_class is None:
        return usable, lost, why
    rival = usable[1] if len(usable) > 1 and figures[usable[1].name] is not None else None
    if rival is None:
        why += f"; {kind} {_tok_s(best_figure)} {where}, the only {kind} figure there"
    else:
        rival_figure = figures[rival.name] or 0.0
        why += f"; {kind} {_tok_s(best_figure)} vs {rival.name} {_tok_s(rival_figure)} {where}"
        if rival_figure == best_figure:
            why += ", a tie broken by priority"
    sources = {
        spec.name: spec.speed[device_class].source
        for spec in (best, rival)
        if spec is not None and spec.speed[device_class].source
    }
    if len(set(sources.values())) == 1:
        why += f", from {next(iter(sources.values()))}"
    elif sources:
        why += ", from " + " and ".join(f"{name}: {text}" for name, text in sources.items())
    return usable, lost, why


def select_backend(
    family: str,
    name: str = "auto",
    *,
    registry: BackendRegistry | None = None,
    device: str | None = None,
    device_class: str | None = None,
    prefer: str | None = None,
) -> BackendSpec:
    """Choose the backend of ``family`` from one configured value.

    :param family: the op family.
    :param name: a backend name, or ``"auto"`` for the one that can run here
        with the best measured decode figure on the device class, or, among
        backends without one, the highest priority (what was chosen, the figures
        compared and the reasons the others lost are logged at INFO). With
        ``prefer``, ``auto`` first narrows the choice to the backends that can
        run here and declare that capability, when there are any.
    :param registry: the registry to choose from (the process-wide one if ``None``).
    :param device: the device the engine runs on; see :func:`runs_on`.
    :param device_class: the class the figures are looked up for (``"sm90"``);
        ``None`` derives it from ``device`` (:func:`device_class_of`).
    :param prefer: a capability ``auto`` prefers (:func:`preference_of`); a
        named backend is used whatever it declares.
    :return: the chosen spec.
    :raises UnknownBackendError: the family, or the named backend, is unknown;
        the message lists the installed backends and the plugins that failed.
    :raises BackendUnavailableError: the backend (or, for ``auto``, every
        backend) cannot run here; the message carries the reasons.
    """
    registry = _registry(registry)
    if name != "auto":
        spec = registry.get(family, name)
        ok, reason = runs_on(spec, device)
        if not ok:
            raise BackendUnavailableError(
                f"{family} backend {name!r} (plugin {spec.plugin}) is unavailable: {reason}",
                family=family,
                backend=name,
            )
        return spec
    if device_class is None:
        device_class = device_class_of(device)
    usable, lost, why = _auto(registry, family, device, device_class=device_class, prefer=prefer)
    if not usable:
        raise BackendUnavailableError(
            f"no available {family} backend: "
            + ("; ".join(lost) if lost else registry.installed_hint(family)),
            family=family,
        )
    logger.info(
        "%s backend: auto chose %s (%s)%s",
        family,
        usable[0].name,
        why,
        "; others: " + ", ".join(lost) if lost else "",
    )
    return usable[0]


def _naming_the_source(exc: BackplaneError, prefix: str) -> BackplaneError:
    """The same error with ``prefix`` (where the value came from) before its message."""
    message = f"{prefix}: {exc}"
    if isinstance(exc, BackendUnavailableError):
        return type(exc)(message, family=exc.family, backend=exc.backend)
    return type(exc)(message)


def select_backends(
    config: EngineConfig,
    families: Iterable[str] | None = None,
    *,
    registry: BackendRegistry | None = None,
) -> dict[str, BackendSpec]:
    """Check the configured backends against the registry and choose one per family.

    Every family whose backend is named in the configuration is checked for an
    installed backend of that name (a typo is an error even for a family the
    model does not use); the families in ``families`` are selected with
    :func:`select_backend` on the configuration's device. Under speculative
    decoding ``auto`` prefers, for ``ssm`` and ``delta``, the backends that chain
    rows (:func:`preference_of`), keeping the plain choice when none can run.

    :param config: the engine configuration (its ``backends`` and ``device``).
    :param families: the op families the model uses; ``None`` = all.
    :param registry: the registry to choose from (the process-wide one if ``None``).
    :return: ``{family: BackendSpec}`` for ``families``.
    :raises ConfigError: ``families`` names an unknown op family.
    :raises UnknownBackendError: naming the key, the installed backends and the
        plugins that failed to load.
    :raises BackendUnavailableError: with the reason the backend cannot run.
    """
    registry = _registry(registry)
    wanted = list(FAMILIES if families is None else families)
    for family in wanted:
        if family not in FAMILIES:
            raise ConfigError(
                f"unknown op family {family!r}; the families are: {', '.join(FAMILIES)}"
            )
    device = config.device_type
    klass = device_class_of(config.device_resolved)
    chosen: dict[str, BackendSpec] = {}
    for family in FAMILIES:
        name = config.backends.get(family, "auto")
        if family not in wanted and name == "auto":
            continue
        try:
            if family in wanted:
                spec = select_backend(
                    family,
                    name,
                    registry=registry,
                    device=device,
                    device_class=klass,
                    prefer=preference_of(config, family),
                )
                chosen[family] = spec
                if name != "auto":
                    logger.info("%s backend: %s (configured)", family, spec.name)
            else:
                registry.get(family, name)
        except BackplaneError as exc:
            key = f"backends.{family}"
            where = config.origin(key)
            if where.kind == "default":  # "auto" by default: the key was never written
                raise
            raise _naming_the_source(exc, where.where(key)) from None
    return chosen


def load_backend(
    spec: BackendSpec,
    *,
    registry: BackendRegistry | None = None,
    device: str | None = None,
    device_class: str | None = None,
) -> Backend:
    """Make the backend object of ``spec``, with its fallback when it needs one.

    A backend whose ``needs_fallback`` is true receives, through
    ``set_fallback``, the backend ``auto`` would choose among the other
    backends of its family that can run on ``device``, ranked by their
    *prefill* figures (the fallback runs the prefill the backend hands over).

    :param spec: a selected spec (see :func:`select_backend`).
    :param registry: the registry to choose a fallback from (the process-wide
        one if ``None``).
    :param device: the device the engine runs on; see :func:`runs_on`.
    :param device_class: the class the figures are looked up for; ``None``
        derives it from ``device`` (:func:`device_class_of`).
    :return: an instance of the family's base class in :mod:`backplane.core.families`.
    :raises BackendUnavailableError: ``load`` failed, or the backend needs a
        fallback and no other backend of the family can run here.
    :raises PluginError: ``load`` produced an object of the wrong family.
    """
    if device_class is None:
        device_class = device_class_of(device)
    return _load(spec, _registry(registry), device, device_class, taken=set())


def _load(
    spec: BackendSpec,
    registry: BackendRegistry,
    device: str | None,
    device_class: str | None,
    taken: set[str],
) -> Backend:
    """:func:`load_backend`, never choosing a fallback among ``taken`` (those already in use)."""
    from backplane.core.families import FAMILY_BASES

    family = spec.family
    load = spec.load if isinstance(spec.load, str) else repr(spec.load)
    try:
        backend = spec.resolve()
    except BackplaneError:
        raise
    except Exception as exc:
        raise BackendUnavailableError(
            f"{family} backend {spec.name!r} (plugin {spec.plugin}) failed to load "
            f"from {load}: {type(exc).__name__}: {exc}",
            family=family,
            backend=spec.name,
        ) from exc
    base = FAMILY_BASES[family]
    if not isinstance(backend, base):
        raise PluginError(
            f"{family} backend {spec.name!r} (plugin {spec.plugin}): {load} produced "
            f"{type(backend).__name__}, which is not a "
            f"backplane.core.families.{base.__name__}"
        )
    if backend.needs_fallback:
        backend.set_fallback(
            _fallback_for(spec, registry, device, device_class, {*taken, spec.name})
        )
    return backend


def _fallback_for(
    spec: BackendSpec,
    registry: BackendRegistry,
    device: str | None,
    device_class: str | None,
    taken: set[str],
) -> Backend:
    """Load the backend that runs what ``spec``'s backend does not (``auto`` among the others).

    What a backend hands over is its prefill, so the others rank by their prefill figures.
    """
    family = spec.family
    usable, lost, why = _auto(
        registry, family, device, exclude=taken, device_class=device_class, kind="prefill"
    )
    if not usable:
        raise BackendUnavailableError(
            f"{family} backend {spec.name!r} (plugin {spec.plugin}) runs part of its work on "
            f"another {family} backend, and none can run here: "
            + ("; ".join(lost) if lost else registry.installed_hint(family))
            + f"; install one, or select another backends.{family}",
            family=family,
            backend=spec.name,
        )
    chosen = usable[0]
    logger.info(
        "%s backend %s delegates what it does not run to %s (%s)%s",
        family,
        spec.name,
        chosen.name,
        why,
        "; others: " + ", ".join(lost) if lost else "",
    )
    return _load(chosen, registry, device, device_class, taken)


def select_backends_for(
    names: Mapping[str, str],
    families: Iterable[str] | None = None,
    *,
    prefer: str | None = None,
    device: str | None = None,
    registry: BackendRegistry | None = None,
    capabilities: Mapping[str, str] | None = None,
) -> dict[str, Backend]:
    """Load one backend object per family from explicit choices, without an engine configuration.

    A family named in ``names`` gets that backend (or ``auto``'s choice for
    ``"auto"``), and any error choosing or loading it is raised. Every other
    family gets ``prefer`` when it is installed and can run here, else the one
    ``auto`` chooses; a family where that fails is left out (logged at INFO),
    so that a machine without some family's kernels still serves the rest.

    :param names: ``{family: backend name or "auto"}``, e.g. from ``--backend FAMILY=NAME``.
    :param families: the families wanted; ``None`` = all.
    :param prefer: the backend tried first for families not in ``names``
        (``"flashinfer"`` for the kernel warm-up, whose JIT cache it fills);
        ``None`` = ``auto``.
    :param device: the device the backends will run on; see :func:`runs_on`
        (``None`` skips the device check and ranks by priority alone).
    :param registry: the registry to choose from (the process-wide one if ``None``).
    :param capabilities: ``{family: capability}`` ``auto`` prefers there, as the engine's
        selection does (:func:`preference_of`); ``prefer`` is then taken for such a family
        only when it declares the capability.
    :return: ``{family: backend object}``, in the order of the family list.
    :raises ConfigError: ``names`` or ``families`` names an unknown op family.
    :raises UnknownBackendError: a named backend is not installed.
    :raises BackendUnavailableError: a named backend cannot run or load here.
    """
    registry = _registry(registry)
    wanted = list(FAMILIES if families is None else families)
    for family in [*names, *wanted]:
        if family not in FAMILIES:
            raise ConfigError(
                f"unknown op family {family!r}; the families are: {', '.join(FAMILIES)}"
            )
    device_class = device_class_of(device)
    backends: dict[str, Backend] = {}
    for family in FAMILIES:
        if family not in wanted:
            continue
        name = names.get(family)
        wanted_cap = (capabilities or {}).get(family)
        if name is None:
            name = "auto"
            if prefer is not None:
                try:
                    spec = registry.get(family, prefer)
                    if spec.availability()[0] and (
                        wanted_cap is None or wanted_cap in spec.capabilities
                    ):
                        name = prefer
                except BackplaneError:  # not installed: auto decides
                    pass
        try:
            spec = select_backend(
                family,
                name,
                registry=registry,
                device=device,
                device_class=device_class,
                prefer=wanted_cap,
            )
            backends[family] = load_backend(
                spec, registry=registry, device=device, device_class=device_class
            )
        except BackplaneError as exc:
            if family in names:
                raise
            logger.info("no %s backend: %s", family, exc)
    return backends


def select_fused_ops(choice: str, device: torch.device | str) -> str:
    """Decide who runs the models' fused elementwise work on ``device``.

    :param choice: the ``fused_ops`` setting: ``"auto"`` (the Triton kernels on
        a CUDA device where they import, else torch ops), ``"torch"`` or ``"triton"``.
    :param device: the device of the model's tensors.
    :return: ``"torch"`` or ``"triton"``, for
        :meth:`~backplane.models.base.CausalLM.set_fused_ops` (the kernels are
        imported for the latter).
    :raises ConfigError: for ``"triton"`` where the kernels cannot run (no CUDA
        device, ``triton`` missing), or an unknown choice.
    """
    import torch

    from backplane.models.fused import check_fused_ops, load_kernels, triton_unavailable_reason

    if choice == "torch":
        return "torch"
    if choice not in ("auto", "triton"):
        raise ConfigError(f"fused_ops: expected one of auto, torch, triton, got {choice!r}")
    dev = torch.device(device)
    if choice == "triton":
        check_fused_ops("triton", dev)
        return "triton"
    if dev.type != "cuda" or triton_unavailable_reason(dev) is not None:
        return "torch"
    try:
        load_kernels()
    except ImportError as exc:
        logger.warning("fused_ops=auto: the Triton kernels do not import (%s); using torch", exc)
        return "torch"
    return "triton"


class BackendSelection:
    """The backends of one engine: chosen from its configuration, replaced when one cannot run.

    :param config: the engine configuration (its ``backends`` and ``device``).
    :param families: the op families to select; ``None`` = all.
    :param registry: the registry to choose from (the process-wide one if ``None``).
    :raises BackplaneError: as :func:`select_backends` and :func:`load_backend`.
    """

    def __init__(
        self,
        config: EngineConfig,
        families: Iterable[str] | None = None,
        *,
        registry: BackendRegistry | None = None,
    ) -> None:
        self.config = config
        self.registry = _registry(registry)
        self.device = config.device_type
        #: The class of the engine's device that measured figures are looked up for.
        self.device_class = device_class_of(config.device_resolved)
        #: The spec of each selected family's backend.
        self.specs: dict[str, BackendSpec] = select_backends(
            config, families, registry=self.registry
        )
        #: ``{family: backend object}``, updated by :meth:`replace`.
        self.backends: dict[str, Backend] = {
            family: self._load(spec) for family, spec in self.specs.items()
        }
        self._tried = {family: {spec.name} for family, spec in self.specs.items()}

    def _load(self, spec: BackendSpec) -> Backend:
        return load_backend(
            spec, registry=self.registry, device=self.device, device_class=self.device_class
        )

    def replace(self, exc: BackendUnavailableError) -> bool:
        """Replace the backend ``exc`` is about with the next one ``auto`` would choose.

        :param exc: what the backend raised while the model was built or its
            caches described; its ``family`` says which backend it is about.
        :return: ``True`` when the backend was replaced (with a warning); ``False``
            when ``exc`` names no selected family, the family's backend is named
            in the configuration, or no other backend of the family can run
            here. The caller then re-raises ``exc``.
        """
        family = exc.family
        if family not in self.backends or self.config.backends.get(family, "auto") != "auto":
            return False
        usable, _, _ = _auto(
            self.registry,
            family,
            self.device,
            exclude=self._tried[family],
            device_class=self.device_class,
            prefer=preference_of(self.config, family),
        )
        if not usable:
            return False
        spec = usable[0]
        self._tried[family].add(spec.name)
        logger.warning(
            "%s backend %r cannot run this model (%s); auto falls back to %r",
            family,
            self.specs[family].name,
            # the text, not the exception: a kept log record would pin its traceback's
            # frames (the engine being built, its caches) for as long as it lives
            str(exc),
            spec.name,
        )
        self.backends[family] = self._load(spec)
        self.specs[family] = spec
        return True
