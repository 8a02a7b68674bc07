"""The package's layers import only downwards, and no modules import each other in a circle.

Layers, bottom to top (a module may import its own layer's package and any
layer below it, never one above, never a sibling)::

    0  backplane.core
    1  backplane.kernels                         (the kernel room: imports only core)
    2  backplane.backends, backplane.models     (siblings: never each other)
    3  backplane.plugins
    4  backplane.engine
    5  backplane.api, backplane.testing          (siblings: never each other)
    6  backplane.server                          (built on api: it serves backplane.api)
    7  backplane.cli

The server sits above the api, not beside it: it is built on the api (its
routes drive ``AsyncLLM``, its request bodies become the api's parameters), as
the design brief puts it: "server (on api)".

Every import counts: module level or inside a function, ``import x`` or
``from x import y``, relative imports resolved, imports under
``TYPE_CHECKING`` and ``importlib.import_module("...")`` with a literal name.
The package root ``backplane/__init__.py`` is the public surface and may
import anything (lazily). A name imported from the root counts as an import
of the module the root takes it from (``from backplane import LLM`` is an
import of ``backplane.api``); the root's own constants (``__version__``)
belong to no layer.

The same imports make the module graph in which no circle may close
(:func:`import_cycles`): an import inside a function that only breaks a circle
at import time still counts, because the two modules still depend on each
other. Importing a submodule also runs its parent package's ``__init__``; that
implicit step is not an edge, since a package may gather its own submodules.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "backplane"

#: Top-level component -> layer. Components of one layer are siblings.
LAYERS: dict[str, int] = {
    "backplane.core": 0,
    "backplane.kernels": 1,
    "backplane.backends": 2,
    "backplane.models": 2,
    "backplane.plugins": 3,
    "backplane.engine": 4,
    "backplane.api": 5,
    "backplane.testing": 5,
    "backplane.server": 6,
    "backplane.cli": 7,
}
ROOT = "backplane"


@dataclass(frozen=True)
class Import:
    """One import statement's target, as seen from the importing module.

    :param importer: dotted name of the importing module.
    :param target: dotted name of the imported module (or of the package an
        imported attribute lives in).
    :param line: line number of the statement.
    """

    importer: str
    target: str
    line: int


def component(module: str) -> str | None:
    """The layered component ``module`` belongs to (``None``: the root or outside the package).

    :param module: a dotted module name.
    :return: a key of :data:`LAYERS`, or ``None``.
    """
    for name in LAYERS:
        if module == name or module.startswith(name + "."):
            return name
    return None


def module_name(path: Path, package_dir: Path = PACKAGE_DIR) -> str:
    """The dotted name of a source file of the package.

    :param path: a ``.py`` file under ``package_dir``.
    :param package_dir: the package's directory.
    :return: e.g. ``backplane.engine.kv_cache`` for its ``__init__.py``.
    """
    parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name a ``from <dots><module> import ...`` refers to."""
    base = importer.split(".")
    if not is_package:
        base.pop()
    if level > 1:
        base = base[: len(base) - (level - 1)]
    if not base:
        raise ValueError(f"{importer}: relative import beyond the top-level package")
    return ".".join([*base, module] if module else base)


def imports_of(
    source: str,
    importer: str,
    *,
    is_package: bool = False,
    known: frozenset[str] = frozenset(),
    root_names: dict[str, str] | None = None,
) -> list[Import]:
    """Every import of the package's own modules made anywhere in ``source``.

    :param source: the module's source text.
    :param importer: the module's dotted name (resolves relative imports).
    :param is_package: the source is a package's ``__init__.py``.
    :param known: dotted names of the package's modules; ``from pkg import name``
        targets ``pkg.name`` when that is one of them.
    :param root_names: the names the package root takes from other modules
        (:func:`root_names`); ``from backplane import name`` targets that module.
    :return: the imports whose target is ``backplane`` or inside it.
    """
    root_names = root_names or {}
    found: list[Import] = []

    def add(target: str, line: int) -> None:
        if target == ROOT or target.startswith(ROOT + "."):
            found.append(Import(importer, target, line))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(importer, is_package, node.level, node.module)
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    add(sub, node.lineno)
                elif base == ROOT:
                    add(root_names.get(alias.name, ROOT), node.lineno)
                else:
                    add(base, node.lineno)
        elif isinstance(node, ast.Call) and _is_import_module_call(node):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                add(arg.value, node.lineno)
    return found


def root_names(source: str) -> dict[str, str]:
    """The names the package root imports from the package's modules, eagerly or lazily.

    :param source: the source of ``backplane/__init__.py``.
    :return: ``{name: module it comes from}``.
    """
    names: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.startswith(ROOT + "."):
                for alias in node.names:
                    names[alias.asname or alias.name] = node.module
    return names


def _is_import_module_call(node: ast.Call) -> bool:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in ("import_module", "__import__") and bool(node.args)


def violation(imp: Import) -> str | None:
    """Why ``imp`` breaks the layering, or ``None`` when it is allowed.

    :param imp: one import.
    :return: a one-line explanation naming both modules and their layers.
    """
    src = component(imp.importer)
    dst = component(imp.target)
    # the root (public surface) imports anything; the root's own constants have no layer
    if src is None or dst is None or dst == src:
        return None
    where = f"{imp.importer}:{imp.line} imports {imp.target}"
    if LAYERS[dst] > LAYERS[src]:
        return f"{where}: {dst} (layer {LAYERS[dst]}) is above {src} (layer {LAYERS[src]})"
    if LAYERS[dst] == LAYERS[src]:
        return f"{where}: {dst} and {src} are siblings in layer {LAYERS[src]}"
    return None


def package_imports(package_dir: Path = PACKAGE_DIR) -> list[Import]:
    """Every import of every module of the package.

    :param package_dir: the package's directory.
    :return: the imports, module by module.
    """
    files = sorted(package_dir.rglob("*.py"))
    known = frozenset(module_name(f, package_dir) for f in files)
    exported = root_names((package_dir / "__init__.py").read_text(encoding="utf-8"))
    found: list[Import] = []
    for f in files:
        found += imports_of(
            f.read_text(encoding="utf-8"),
            module_name(f, package_dir),
            is_package=f.name == "__init__.py",
            known=known,
            root_names=exported,
        )
    return found


def owning_module(target: str, known: frozenset[str]) -> str | None:
    """The module of the package that an import target names.

    :param target: an import's target: a module, a package, or a dotted name
        inside one (``backplane.core.errors.ConfigError``).
    :param known: dotted names of the package's modules.
    :return: the longest prefix of ``target`` that is a module, or ``None``.
    """
    name = target
    while name not in known:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def import_graph(imports: Iterable[Import], known: frozenset[str]) -> dict[str, dict[str, int]]:
    """The module graph that ``imports`` make.

    :param imports: imports, e.g. from :func:`package_imports`.
    :param known: dotted names of the package's modules.
    :return: ``{importer: {imported module: line of the first such import}}``;
        a module importing itself makes no edge.
    """
    graph: dict[str, dict[str, int]] = {}
    for imp in imports:
        target = owning_module(imp.target, known)
        if target is None or target == imp.importer:
            continue
        edges = graph.setdefault(imp.importer, {})
        edges[target] = min(edges.get(target, imp.line), imp.line)
    return graph


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm: the graph's strongly connected components, nodes sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _shortest_cycle(graph: dict[str, dict[str, int]], start: str, members: set[str]) -> list[str]:
    """The shortest path ``start -> ... -> start`` through ``members`` (breadth first)."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph.get(node, ())):
            if nxt not in members:
                continue
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{start} is on no cycle of {sorted(members)}")


def import_cycles(imports: Iterable[Import], known: frozenset[str]) -> list[str]:
    """Every circle of imports among the package's modules, one line each.

    :param imports: imports, e.g. from :func:`package_imports` (module level and
        inside functions alike).
    :param known: dotted names of the package's modules.
    :return: per group of modules that import each other (directly or through
        others), one shortest circle through its first module, each step with
        the line of its import: ``a:3 -> b:10 -> a``; empty when there is none.
    """
    graph = import_graph(imports, known)
    cycles = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        path = _shortest_cycle(graph, component[0], set(component))
        steps = [f"{a}:{graph[a][b]}" for a, b in pairwise(path)]
        others = sorted(set(component) - set(path))
        also = f" (with {', '.join(others)} in the same circle)" if others else ""
        cycles.append(" -> ".join([*steps, path[-1]]) + also)
    return cycles


def known_modules(package_dir: Path = PACKAGE_DIR) -> frozenset[str]:
    """The dotted names of every module of the package.

    :param package_dir: the package's directory.
    :return: one name per ``.py`` file (packages by their own name).
    """
    return frozenset(module_name(f, package_dir) for f in package_dir.rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    """A new top-level module or package must be placed in :data:`LAYERS`."""
    unplaced = sorted(
        name
        for name in {module_name(f) for f in PACKAGE_DIR.rglob("*.py")}
        if name != ROOT and component(name) is None
    )
    assert not unplaced, f"modules without a layer (add them to LAYERS): {unplaced}"


def test_imports_go_down_the_layers() -> None:
    """No module imports a layer above its own or a sibling of it."""
    problems = [v for imp in package_imports() if (v := violation(imp)) is not None]
    assert not problems, "imports against the layering:\n" + "\n".join(problems)


def test_no_import_circles() -> None:
    """No modules of the package import each other, directly or through others."""
    cycles = import_cycles(package_imports(), known_modules())
    assert not cycles, "modules that import each other in a circle:\n" + "\n".join(cycles)


# -- the checker itself ---------------------------------------------------------------------------


_ROOT_NAMES = {"LLM": "backplane.api", "BackendSpec": "backplane.core.backend_spec"}


def _violations(source: str, importer: str, is_package: bool = False) -> list[str]:
    found = imports_of(source, importer, is_package=is_package, root_names=_ROOT_NAMES)
    return [v for imp in found if (v := violation(imp)) is not None]


@pytest.mark.parametrize(
    ("importer", "source", "why"),
    [
        ("backplane.core.x", "import backplane.engine.executor", "above"),
        ("backplane.core.x", "from backplane.engine import executor", "above"),
        ("backplane.core.x", "def f():\n    from backplane.plugins import torch\n", "above"),
        (
            "backplane.core.x",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import backplane.models\n",
            "above",
        ),
        ("backplane.core.x", "from ..engine import config", "above"),
        ("backplane.engine.kv_cache.manager", "from ...testing import checks", "above"),
        (
            "backplane.backends.torch.ssm",
            "from backplane.models.llama import LlamaModel",
            "siblings",
        ),
        ("backplane.models.llama", "from ..backends import torch", "siblings"),
        ("backplane.testing.plugin", "from backplane.api import LLM", "siblings"),
        ("backplane.api", "import backplane.testing.checks", "siblings"),
        ("backplane.engine.executor", "from backplane import LLM", "above"),
        ("backplane.core.registry", "importlib.import_module('backplane.plugins.torch')", "above"),
        ("backplane.kernels.gemv", "from backplane.models import fused", "above"),
        ("backplane.kernels", "from backplane.backends.triton import _common", "above"),
        ("backplane.core.launch", "from backplane.kernels import load_gemv", "above"),
        ("backplane.api.llm", "from backplane.server import protocol", "above"),
    ],
)
def test_checker_catches_a_bad_import(importer: str, source: str, why: str) -> None:
    found = _violations(source, importer)
    assert len(found) == 1 and why in found[0], found


@pytest.mark.parametrize(
    ("importer", "source", "is_package"),
    [
        ("backplane.engine.executor", "from backplane.core.errors import BackplaneError", False),
        ("backplane.engine.executor", "from .kv_cache import KVCacheManager", False),
        ("backplane.engine.kv_cache", "from .manager import KVCacheManager", True),
        ("backplane.cli.main", "from backplane.api import LLM\nimport backplane.engine", False),
        ("backplane.testing.plugin", "from backplane.engine import selection", False),
        ("backplane.models.llama", "from ..core import families", False),
        ("backplane", "from backplane.cli import main", True),
        ("backplane.core.x", "from backplane import BackendSpec, __version__", False),
        ("backplane.core.x", "import numpy, torch\nfrom os import path", False),
        ("backplane.kernels.gemv", "from backplane.core.launch import cdiv", False),
        ("backplane.models.linear", "from backplane.kernels import load_gemv", False),
        ("backplane.backends.triton.x", "from backplane.kernels.gemv import gemv", False),
        ("backplane.server.app", "from backplane.api.async_llm import AsyncLLM", False),
    ],
)
def test_checker_allows_a_good_import(importer: str, source: str, is_package: bool) -> None:
    assert _violations(source, importer, is_package=is_package) == []


def test_root_names_come_from_eager_and_lazy_imports() -> None:
    source = (
        "from backplane.core.backend_spec import BackendSpec\n"
        "__version__ = '1'\n"
        "def __getattr__(name):\n"
        "    from backplane.api import LLM\n"
        "    return LLM\n"
    )
    assert root_names(source) == {
        "BackendSpec": "backplane.core.backend_spec",
        "LLM": "backplane.api",
    }


def test_checker_resolves_relative_imports_from_modules_and_packages() -> None:
    mod = imports_of("from . import a\nfrom .. import b", "backplane.engine.sched.scheduler")
    assert [i.target for i in mod] == ["backplane.engine.sched", "backplane.engine"]
    pkg = imports_of("from . import a", "backplane.engine.sched", is_package=True)
    assert [i.target for i in pkg] == ["backplane.engine.sched"]
    known = frozenset({"backplane.engine.sched.scheduler"})
    sub = imports_of(
        "from . import scheduler", "backplane.engine.sched", is_package=True, known=known
    )
    assert [i.target for i in sub] == ["backplane.engine.sched.scheduler"]


def _imports(sources: dict[str, str]) -> tuple[list[Import], frozenset[str]]:
    """The imports of a made-up package, given as ``{module: source}``."""
    known = frozenset(sources)
    found: list[Import] = []
    for name, source in sources.items():
        found += imports_of(source, name, is_package=name == "backplane.p", known=known)
    return found, known


def test_cycle_finder_catches_a_circle_closed_inside_a_function() -> None:
    found, known = _imports(
        {
            "backplane.p.a": "import os\n\ndef f():\n    from backplane.p.b import g\n",
            "backplane.p.b": "from backplane.p.a import f\n",
        }
    )
    assert import_cycles(found, known) == ["backplane.p.a:4 -> backplane.p.b:1 -> backplane.p.a"]


def test_cycle_finder_names_the_shortest_circle_and_the_rest_of_the_group() -> None:
    found, known = _imports(
        {
            "backplane.p.a": "from . import b",
            "backplane.p.b": "from .c import x\nfrom . import d",
            "backplane.p.c": "from backplane.p import a",
            "backplane.p.d": "from backplane.p.b import y",
        }
    )
    assert import_cycles(found, known) == [
        "backplane.p.a:1 -> backplane.p.b:1 -> backplane.p.c:1 -> backplane.p.a"
        " (with backplane.p.d in the same circle)"
    ]


def test_cycle_finder_allows_chains_packages_and_self_imports() -> None:
    found, known = _imports(
        {
            # a package gathering its submodules, which import each other in one direction
            "backplane.p": "from .a import f\nfrom .b import g",
            "backplane.p.a": "from backplane.p.b import g\nfrom backplane.p.a import f",
            "backplane.p.b": "import backplane.core.errors.ConfigError",
        }
    )
    assert import_graph(found, known) == {
        "backplane.p": {"backplane.p.a": 1, "backplane.p.b": 2},
        "backplane.p.a": {"backplane.p.b": 1},
    }
    assert import_cycles(found, known) == []


def test_cycle_finder_counts_a_package_importing_back_from_its_submodule() -> None:
    found, known = _imports(
        {
            "backplane.p": "def load():\n    return importlib.import_module('backplane.p.k')\n",
            "backplane.p.k": "from backplane.p import helper",
        }
    )
    assert import_cycles(found, known) == ["backplane.p:2 -> backplane.p.k:1 -> backplane.p"]
