"""``backplane warmup``: compile a model's kernels ahead of time.

FlashInfer compiles its kernels with nvcc on first use (seconds to minutes per
kernel) and Triton JIT-compiles and autotunes on first launch. ``warmup`` runs
every op of the selected backends once, for every distinct layer shape of a
model, on a small synthetic batch with prefill, extend and decode sequences,
so the compiled kernels land in the on-disk caches
(``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer``, ``~/.triton/cache``) and the
first request does not pay for them. See ``docs/flashinfer.md``.

The layer shapes come from the model's own modules, built on the ``meta``
device from its ``config.json`` (or preset): no weights are read. The engine
flags (:mod:`backplane.cli.options`: ``--config``, ``--device``, ``--dtype``,
``--page-size``, ``--backend``) say what to warm for, and the backends are
chosen by the engine's selection
(:func:`backplane.engine.selection.select_backends_for`).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from backplane.cli._command import add_command
from backplane.cli.options import add_engine_arguments, config_from_args
from backplane.core.hookspecs import FAMILIES
from backplane.core.launch import cdiv
from backplane.engine.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass
class WarmupResult:
    """The outcome of warming one layer shape of one family.

    :param family: the op family.
    :param backend: the backend's name.
    :param shape: the layer spec (layer id zeroed).
    :param seconds: wall time of the first run (compile + run).
    :param error: why it failed, ``None`` on success.
    """

    family: str
    backend: str
    shape: Any
    seconds: float
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly view."""
        return {
            "family": self.family,
            "backend": self.backend,
            "shape": repr(self.shape),
            "seconds": round(self.seconds, 3),
            "error": self.error,
        }


def collect_layer_specs(model: Any) -> dict[str, list[Any]]:
    """Return the distinct layer specs of ``model`` per family.

    Walks every sub-module and picks up attributes that are layer specs of
    :mod:`backplane.core.families`; specs differing only in ``layer_id`` count once.

    :param model: an ``nn.Module`` (may live on the meta device).
    :return: ``{"attention": [...], "mla": [...], "ssm": [...], "conv": [...], "delta": [...]}``.
    """
    from backplane.core import families as fam

    kinds = {
        fam.AttentionLayerSpec: "attention",
        fam.MLALayerSpec: "mla",
        fam.SSMLayerSpec: "ssm",
        fam.ConvLayerSpec: "conv",
        fam.DeltaLayerSpec: "delta",
    }
    found: dict[str, list[Any]] = {k: [] for k in kinds.values()}
    seen: set[Any] = set()
    for module in model.modules():
        for value in vars(module).values():
            kind = kinds.get(type(value))
            if kind is None:
                continue
            spec = replace(value, layer_id=0)
            if spec not in seen:
                seen.add(spec)
                found[kind].append(spec)
    return found


def _synthetic_batch(device: Any, page_size: int, padded: int | None = None):
    """Prefill (37), extend (9 on 23 cached) and two decode sequences, pages 1.. in order."""
    from backplane.core.packing import build_batch_metadata

    query = [37, 9, 1, 1]
    cached = [0, 23, 40, 17]
    tables, nxt = [], 1
    for q, c in zip(query, cached, strict=True):
        need = cdiv(q + c, page_size)
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    batch = build_batch_metadata(
        query,
        cached,
        tables,
        page_size,
        state_slots=[1, 2, 3, 4],
        padded_num_tokens=padded,
        device=device,
    )
    return batch, nxt, 5


def _run_one(family: str, backend: Any, spec: Any, *, dtype, device, page_size: int) -> None:
    import torch

    from backplane.core.forward_context import forward_context

    batch, num_pages, num_slots = _synthetic_batch(device, page_size)
    t = batch.padded_num_tokens
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=0.5, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    def alloc(specs: dict) -> dict:
        return {name: s.allocate(device) for name, s in specs.items()}

    supports = getattr(backend, "supports", None)
    if supports is not None and family != "conv":
        ok, reason = supports(spec, dtype)
        if not ok:
            raise ValueError(f"backend {getattr(backend, 'name', '?')!r} cannot run it: {reason}")
    fam_name = "ssm" if family == "conv" else family
    with forward_context(batch, {fam_name: backend.plan(batch)}):
        if family == "attention":
            cache = alloc(
                backend.cache_spec(spec, num_pages=num_pages, page_size=page_size, dtype=dtype)
            )
            backend.forward(
                rnd(t, spec.num_heads, spec.head_dim),
                rnd(t, spec.num_kv_heads, spec.head_dim),
                rnd(t, spec.num_kv_heads, spec.head_dim),
                cache["kv_cache"],
                spec,
            )
        elif family == "mla":
            cache = alloc(
                backend.cache_spec(spec, num_pages=num_pages, page_size=page_size, dtype=dtype)
            )
            h = spec.num_heads
            backend.forward(
                rnd(t, h, spec.qk_nope_head_dim),
                rnd(t, h, spec.qk_rope_head_dim),
                rnd(t, spec.kv_lora_rank),
                rnd(t, spec.qk_rope_head_dim),
                cache["latent_cache"],
                rnd(h, spec.qk_nope_head_dim, spec.kv_lora_rank, scale=0.05),
                rnd(h, spec.v_head_dim, spec.kv_lora_rank, scale=0.05),
                spec,
            )
        elif family == "conv":
            cache = alloc(backend.conv_cache_spec(spec, num_slots=num_slots, dtype=dtype))
            backend.conv(
                rnd(t, spec.conv_dim),
                rnd(spec.conv_dim, spec.kernel_size),
                rnd(spec.conv_dim),
                cache["conv_state"],
                spec,
            )
        elif family == "ssm":
            cache = alloc(backend.cache_spec(spec, num_slots=num_slots, dtype=dtype))
            h, p, n, g = spec.nheads, spec.head_dim, spec.d_state, spec.n_groups
            backend.scan(
                rnd(t, h, p),
                rnd(t, h),
                -torch.rand(h, device=device) - 0.5,
                rnd(t, g, n),
                rnd(t, g, n),
                rnd(h),
                rnd(h),
                rnd(t, h, p),
                cache["ssm_state"],
                spec,
            )
        elif family == "delta":
            cache = alloc(backend.cache_spec(spec, num_slots=num_slots, dtype=dtype))
            hk, hv = spec.num_k_heads, spec.num_v_heads
            backend.forward(
                rnd(t, hk, spec.k_head_dim),
                rnd(t, hk, spec.k_head_dim),
                rnd(t, hv, spec.v_head_dim),
                -torch.rand(t, hv, device=device) * 0.1,
                torch.rand(t, hv, device=device) * 0.5 + 0.25,
                cache["delta_state"],
                spec,
            )
        else:
            raise ValueError(f"unknown family {family!r}")
    if torch.cuda.is_available() and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def warmup(
    specs: dict[str, list[Any]],
    backends: dict[str, Any],
    *,
    dtype: Any,
    device: Any,
    page_size: int = 16,
    families: Iterable[str] | None = None,
) -> list[WarmupResult]:
    """Run every backend op once per distinct layer shape.

    :param specs: from :func:`collect_layer_specs` (``conv`` runs on the ssm backend).
    :param backends: ``{family: backend object}``.
    :param dtype: the model dtype.
    :param device: the device to compile for.
    :param page_size: KV page size of the synthetic batch.
    :param families: restrict to these families (default: all with a backend).
    :return: one result per (family, shape); failures are recorded, not raised.
    """
    wanted = set(families) if families is not None else None
    results: list[WarmupResult] = []
    for kind, shapes in specs.items():
        family = "ssm" if kind == "conv" else kind
        if family not in backends or (wanted is not None and family not in wanted):
            continue
        backend = backends[family]
        for spec in shapes:
            start = time.perf_counter()
            error = None
            try:
                _run_one(kind, backend, spec, dtype=dtype, device=device, page_size=page_size)
            except Exception as exc:  # report and continue with the next shape
                error = f"{type(exc).__name__}: {exc}"
                logger.warning("warmup of %s %s failed: %s", kind, spec, error)
            results.append(
                WarmupResult(
                    kind, getattr(backend, "name", "?"), spec, time.perf_counter() - start, error
                )
            )
    return results


def _model_specs(model: str, backends: dict[str, Any]) -> tuple[dict[str, list[Any]], Any]:
    """Build ``model`` on the meta device and collect its layer specs."""
    from pathlib import Path

    import torch

    from backplane.models import presets
    from backplane.models.base import build_model
    from backplane.models.loader import read_config
    from backplane.models.registry import model_class

    if model in presets.PRESETS:
        config = presets.preset_config(model)
    elif Path(model).expanduser().is_dir():
        config = read_config(Path(model).expanduser())
    else:
        from backplane.core.errors import ConfigError

        raise ConfigError(
            f"model {model!r} is neither a local directory nor a preset; presets: "
            f"{', '.join(sorted(presets.PRESETS))}"
        )
    lm = build_model(
        model_class(config.architecture), config, backends, dtype=torch.float32, device="meta"
    )
    return collect_layer_specs(lm), config


def _ints(text: str, n_min: int, n_max: int, flag: str) -> list[int]:
    from backplane.core.errors import ConfigError

    try:
        vals = [int(x) for x in text.split(":")]
    except ValueError:
        vals = []
    if not n_min <= len(vals) <= n_max:
        raise ConfigError(
            f"{flag} expects {n_min} to {n_max} integers separated by ':', got {text!r}"
        )
    return vals


def explicit_specs(args: argparse.Namespace) -> dict[str, list[Any]]:
    """Layer specs from the ``--attention/--mla/--ssm/--delta`` flags."""
    from backplane.core import families as fam

    specs: dict[str, list[Any]] = {k: [] for k in ("attention", "mla", "ssm", "conv", "delta")}
    for text in args.attention:
        v = _ints(text, 3, 4, "--attention")
        specs["attention"].append(
            fam.AttentionLayerSpec(0, v[0], v[1], v[2], None, v[3] if len(v) > 3 else 0)
        )
    for text in args.mla:
        v = _ints(text, 1, 5, "--mla")
        h, rank, rope, nope, vd = (v + [512, 64, 128, 128][len(v) - 1 :])[:5]
        specs["mla"].append(fam.MLALayerSpec(0, h, rank, nope, rope, vd, (nope + rope) ** -0.5))
    for text in args.ssm:
        v = _ints(text, 4, 5, "--ssm")
        nheads, head_dim, d_state, groups = v[:4]
        specs["ssm"].append(fam.SSMLayerSpec(0, nheads, head_dim, d_state, groups))
        conv_dim = nheads * head_dim + 2 * groups * d_state
        specs["conv"].append(fam.ConvLayerSpec(0, conv_dim, v[4] if len(v) > 4 else 4))
    for text in args.delta:
        hk, hv, dk, dv = _ints(text, 4, 4, "--delta")
        specs["delta"].append(fam.DeltaLayerSpec(0, hk, hv, dk, dv))
    return specs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``warmup`` sub-command."""
    parser = add_command(
        subparsers,
        "warmup",
        help="compile a model's kernels (FlashInfer JIT, Triton) ahead of time",
        description=(
            "Run each op of the selected backends once for every layer shape of MODEL on a "
            "small synthetic batch, so JIT-compiled kernels are in the on-disk caches before "
            "the first request. FlashInfer's cache lives under $FLASHINFER_WORKSPACE_BASE "
            "(default: the home directory)/.cache/flashinfer. A family named with --backend "
            "(or in the --config file) warms that backend; every other family warms FlashInfer "
            "where it can run (under --speculative-config, for Mamba2 and delta-rule layers "
            "only where it chains rows), else the backend the engine's auto selection picks. "
            "Device, dtype and KV page size are the engine's (--device, --dtype, --page-size)."
        ),
        run=run,
        json_help="print the results as JSON",
    )
    parser.add_argument(
        "model_arg",
        nargs="?",
        metavar="model",
        help="a local model directory (config.json) or a preset name (or --model, or the "
        "--config file's model)",
    )
    parser.add_argument(
        "--attention",
        action="append",
        default=[],
        metavar="H:HKV:D[:WINDOW]",
        help="also warm this attention shape (heads, KV heads, head dim, sliding window)",
    )
    parser.add_argument(
        "--mla",
        action="append",
        default=[],
        metavar="H[:L:R:DN:DV]",
        help="also warm MLA with H heads (default latent 512, rope 64, nope 128, v 128)",
    )
    parser.add_argument(
        "--ssm",
        action="append",
        default=[],
        metavar="NHEADS:HEADDIM:DSTATE:NGROUPS[:CONVK]",
        help="also warm this Mamba2 shape (scan and its causal conv)",
    )
    parser.add_argument(
        "--delta",
        action="append",
        default=[],
        metavar="HK:HV:DK:DV",
        help="also warm this gated-delta-rule shape",
    )
    parser.add_argument(
        "--family",
        action="append",
        choices=FAMILIES,
        help="warm only these families (repeatable)",
    )
    add_engine_arguments(parser)


def _warmup_config(args: argparse.Namespace) -> tuple[EngineConfig, str | None]:
    """The engine configuration of the warm-up and the model to take shapes from.

    :param args: the parsed flags.
    :return: the configuration (``--config`` and the engine flags) and the model:
        the positional one, else ``--model`` or the file's ``model``, else ``None``
        (only the shapes given by flags are warmed).
    """
    config = config_from_args(args)
    if args.model_arg:
        return config.merge(model=args.model_arg), args.model_arg
    if config.origin("model").kind != "default":
        return config, config.model
    return config, None


def _select_backends(config: EngineConfig) -> dict[str, Any]:
    """Load the backend of each family the way the engine's selection does.

    A family named in the configuration gets that backend (an error if it cannot
    run); every other family gets FlashInfer where it is installed and can run,
    since its JIT cache is what the warm-up fills, else ``auto``'s choice, and
    is left out when nothing can run here. Under speculative decoding a
    recurrent family gets FlashInfer only where it chains rows, as the engine's
    ``auto`` would choose (:func:`~backplane.engine.selection.preference_of`).

    :param config: the warm-up's engine configuration.
    :return: ``{family: backend object}``.
    """
    from backplane.engine.selection import preference_of, select_backends_for

    named = {
        family: name
        for family, name in config.backends.items()
        if config.origin(f"backends.{family}").kind != "default"
    }
    wanted = {f: cap for f in FAMILIES if (cap := preference_of(config, f)) is not None}
    return select_backends_for(
        named, prefer="flashinfer", device=config.device_type, capabilities=wanted
    )


def run(args: argparse.Namespace) -> int:
    """Warm the kernels of the backends the engine's selection chooses.

    :param args: the parsed flags (:func:`add_parser`).
    :return: 0 when every shape ran, 1 otherwise.
    :raises ConfigError: nothing to warm, or a bad engine flag or ``--config`` key.
    """
    from backplane.engine.worker.graph.compile_cache import configure_compile_caches

    # the engines' start-up looks for the compiled kernels in these same directories
    configure_compile_caches()
    config, model = _warmup_config(args)
    backends = _select_backends(config)
    specs = explicit_specs(args)
    if model:
        found, _ = _model_specs(model, backends)
        for kind, shapes in found.items():
            specs[kind].extend(s for s in shapes if s not in specs[kind])
    if not any(specs.values()):
        from backplane.core.errors import ConfigError

        raise ConfigError("nothing to warm: give a MODEL or shapes (--attention, --mla, ...)")
    results = warmup(
        specs,
        backends,
        dtype=config.torch_dtype,
        device=config.torch_device,
        page_size=config.page_size,
        families=args.family,
    )
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        for r in results:
            status = "ok" if r.error is None else f"FAILED: {r.error}"
            print(f"{r.family:9s} {r.backend:10s} {r.seconds:8.1f}s  {r.shape}  {status}")
        total = sum(r.seconds for r in results)
        print(f"{len(results)} shape(s) warmed in {total:.1f}s")
    return 0 if all(r.error is None for r in results) else 1
