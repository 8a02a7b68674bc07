"""Where compiled artefacts persist between processes: one backplane cache directory.

Start-up compiles Triton kernels (the backends' and the models' fused ones);
Triton, and Inductor where a user's ``torch.compile`` runs beside the engine,
keep what they compile in on-disk caches, so a second start-up of the same
shapes reuses it. Their default places differ (``/tmp`` for Inductor,
``~/.triton`` for Triton) and ``/tmp`` is often cleared between runs; backplane
puts both under one directory, so that ``backplane warmup`` and every engine
find the same artefacts:

- the directory is ``$BACKPLANE_CACHE_DIR``, else ``$XDG_CACHE_HOME/backplane``,
  else ``~/.cache/backplane``;
- ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` point into it unless the
  user has set them (a user's choice is never overridden);
- ``TRITON_CACHE_AUTOTUNING=1`` (unless set) keeps the choices of autotuned
  Triton kernels (mamba-ssm's and fla's scans; backplane's own kernels choose
  their launches without autotuning) in Triton's cache, so a later start-up
  does not time every configuration again.

:func:`configure_compile_caches` sets them; it runs before anything is compiled
(the worker's ``load_model``, ``backplane warmup``) and may run any number of
times.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["CACHE_DIR_ENV", "CompileCaches", "cache_root", "configure_compile_caches"]

#: the variable that moves backplane's cache directory
CACHE_DIR_ENV = "BACKPLANE_CACHE_DIR"

#: each tool's variable and its sub-directory of the backplane cache
_TOOL_DIRS = (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"))
#: Triton's switch for keeping autotuning results on disk (read when an autotuned
#: kernel is defined, so it is set before any backend imports its kernels)
AUTOTUNING_ENV = "TRITON_CACHE_AUTOTUNING"


@dataclass(frozen=True)
class CompileCaches:
    """Where each compiler's cache is, and who chose it.

    :param root: backplane's cache directory.
    :param dirs: variable -> the directory it names now.
    :param chosen_by_user: the variables the user had set (left as they were).
    """

    root: Path
    dirs: dict[str, str]
    chosen_by_user: frozenset[str]


def cache_root(environ: MutableMapping[str, str] | None = None) -> Path:
    """Backplane's cache directory (see the module's documentation).

    :param environ: the environment to read (default: ``os.environ``).
    :return: the directory (not created here).
    """
    env = os.environ if environ is None else environ
    explicit = env.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = env.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "backplane"


def configure_compile_caches(environ: MutableMapping[str, str] | None = None) -> CompileCaches:
    """Point Inductor's and Triton's caches into backplane's cache directory, and keep
    Triton's autotuning results there.

    A variable the user has set is left alone. When a directory cannot be
    created (a read-only home, say) its variable is not set and the compiler
    keeps its own default: a slower start-up, never a failed one (a warning
    says which directory and to set ``BACKPLANE_CACHE_DIR`` to a writable one).

    :param environ: the environment to update (default: ``os.environ``).
    :return: the directories now in use.
    """
    env = os.environ if environ is None else environ
    root = cache_root(env)
    dirs: dict[str, str] = {}
    user: set[str] = set()
    for var, sub in _TOOL_DIRS:
        given = env.get(var)
        if given:
            user.add(var)
            dirs[var] = given
            continue
        path = root / sub
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            logger.warning(
                "cannot create the compile cache %s (%s); compiled kernels will not persist "
                "there. Set %s to a writable directory",
                path,
                exc,
                CACHE_DIR_ENV,
            )
            continue
        env[var] = dirs[var] = str(path)
    if AUTOTUNING_ENV in env:
        user.add(AUTOTUNING_ENV)
    elif "TRITON_CACHE_DIR" in dirs:
        env[AUTOTUNING_ENV] = "1"
    logger.debug("compile caches: %s", dirs)
    return CompileCaches(root=root, dirs=dirs, chosen_by_user=frozenset(user))
