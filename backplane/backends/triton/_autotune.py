"""mamba-ssm's autotuned kernels, adapted for start-up: compiled ahead, timed briefly.

The chunked scan's forward is six ``triton.autotune`` kernels (mamba-ssm
2.3.2; configurations in brackets): ``_chunk_cumsum_fwd_kernel`` [7],
``_chunk_state_fwd_kernel`` [9], ``_state_passing_fwd_kernel`` [6],
``_bmm_chunk_fwd_kernel`` [9], ``_chunk_scan_fwd_kernel`` [11] and
``_chunk_state_varlen_kernel`` [9]. Their tuning keys are model dimensions
(``chunk_size``, ``hdim``, ``dstate``, ``nheads``, ``dim``, ``K``,
``IS_CAUSAL``) and the arguments' dtypes, never a sequence length, so one
model tunes each kernel once; none has a configuration ``pre_hook``, so with
``TRITON_CACHE_AUTOTUNING=1`` (set by
:func:`~backplane.engine.worker.graph.compile_cache.configure_compile_caches`)
Triton keeps each choice on disk and a later process times nothing.

:func:`adapt` changes two things of such an autotuner, on CUDA only:

* its class becomes :class:`AheadAutotuner` (the same object, so mamba-ssm's
  functions find it under the same name): inside
  :func:`~backplane.core.compile_ahead.compile_only` a launch compiles the
  configurations it would need (every one it would time, or the choice already
  made, in memory or on disk) and runs nothing, so that the first real launch
  times configurations that are all compiled, 51 compiles side by side instead
  of one after the other;
* it times each configuration over :data:`TUNING_REP_MS` milliseconds after
  :data:`TUNING_WARMUP_MS` of warm-up instead of Triton's 100 and 25: 51
  configurations took about 6.5 s at Triton's figures. At the 8,192-token step
  where the engine tunes them the kernels take tens of microseconds to a
  millisecond, so 20 ms is still tens to thousands of runs for the median; the
  choice is kept on disk, so this is paid once per machine.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

from triton.runtime.autotuner import Autotuner, Config

from backplane.core import compile_ahead

__all__ = ["TUNING_DETAIL", "TUNING_REP_MS", "TUNING_WARMUP_MS", "AheadAutotuner", "adapt"]

#: milliseconds of warm-up before a configuration is timed (Triton: 25)
TUNING_WARMUP_MS = 5
#: milliseconds of timed runs per configuration (Triton: 100)
TUNING_REP_MS = 20
#: the start-up detail that the seconds spent timing configurations go to
TUNING_DETAIL = "autotune timing"


class _NotOnDisk(Exception):
    """Raised in place of timing, to learn that no choice is kept on disk."""


def _not_on_disk() -> None:
    raise _NotOnDisk


class AheadAutotuner(Autotuner):
    """A Triton autotuner that can compile ahead (see the module docstring).

    Made by :func:`adapt` from an existing autotuner; adds no state of its own.
    """

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Launch as Triton does, or, inside ``compile_only``, compile what the launch needs.

        :param args: the kernel's arguments.
        :param kwargs: ``grid``, ``warmup`` and the constants, as Triton passes them.
        :return: Triton's result; ``None`` when only compiling.
        """
        if compile_ahead.compiling_only():
            self.compile_ahead(*args, **kwargs)
            return None
        return super().run(*args, **kwargs)

    def _bench(self, *args: Any, config: Config, **meta: Any) -> Any:
        start = time.perf_counter()
        try:
            return super()._bench(*args, config=config, **meta)
        finally:
            # a warm start-up never gets here: the detail says whether one did
            compile_ahead.record(TUNING_DETAIL, time.perf_counter() - start)

    def tuning_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The key Triton's ``Autotuner.run`` tunes under for these arguments.

        :param args: the kernel's positional arguments.
        :param kwargs: its keyword arguments.
        :return: the values of the ``key`` arguments, then the dtype of every
            argument that has one (Triton 3.x's rule).
        """
        named = {**dict(zip(self.arg_names, args, strict=False)), **kwargs}
        named = {k: v for k, v in named.items() if k in self.arg_names}
        key = [named[k] for k in self.keys if k in named]
        key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
        return tuple(key)

    def configs_to_compile(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Config]:
        """The configurations a launch with these arguments needs compiled.

        The choice already made for its key (in memory, or on disk, which is
        then loaded as Triton's own run would), else every configuration the
        launch will time.

        :param args: the kernel's positional arguments.
        :param kwargs: its keyword arguments.
        :return: the configurations, each once.
        """
        if len(self.configs) <= 1:
            return list(self.configs)
        key = self.tuning_key(args, kwargs)
        self.nargs = dict(zip(self.arg_names, args, strict=False))
        try:
            configs = self.prune_configs(kwargs)
            if key not in self.cache and self.cache_results:
                with contextlib.suppress(_NotOnDisk):
                    self.check_disk_cache(key, configs, _not_on_disk)
        finally:
            self.nargs = None
        chosen = self.cache.get(key)
        return [chosen] if chosen is not None else list(configs)

    def compile_ahead(self, *args: Any, **kwargs: Any) -> list[Config]:
        """Ask Triton for each configuration :meth:`configs_to_compile` names, without launching.

        Inside ``AsyncCompileMode`` each request is queued and returns at once.

        :param args: the kernel's arguments.
        :param kwargs: ``grid``, ``warmup`` and the constants.
        :return: the configurations asked for.
        """
        configs = self.configs_to_compile(args, kwargs)
        meta = {**kwargs, "warmup": True}
        for config in configs:
            self.fn.run(*args, **meta, **config.all_kwargs())
        return configs


def adapt(tuner: Autotuner) -> Autotuner:
    """Make ``tuner`` an :class:`AheadAutotuner` timing over :data:`TUNING_REP_MS` ms.

    :param tuner: a Triton autotuner (of the plain class; a subclass is left as it is).
    :return: the same object.
    """
    if type(tuner) is Autotuner:
        tuner.__class__ = AheadAutotuner
    # Triton reads _do_bench once, when do_bench is first used
    if getattr(tuner, "_do_bench", None) is None and "do_bench" not in vars(tuner):
        import triton.testing

        tuner._do_bench = functools.partial(
            triton.testing.do_bench, warmup=TUNING_WARMUP_MS, rep=TUNING_REP_MS
        )
    return tuner
