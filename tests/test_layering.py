"""Imports only point down (issue 13; ../shared/DESIGN.md, section "Layers").

Every module of the package is parsed with `ast`; *all* its imports count,
including those inside functions (a lazy import still ties the two modules
together).  Each module is mapped to a layer by its path (`LAYERS`), and the
test asserts

1. no module imports from a layer above its own (`LAYERS` order; the side
   layer ``models`` is used by runtime and above and imports only itself and
   ``_core``; the "leaf" modules import nothing of the package), and
2. the module import graph has no cycle, apart from the commented entries of
   `ALLOWED_CYCLES`.

How an import becomes an edge: ``import a.b.c`` and ``from a.b import c``
(``c`` a module) point at ``a.b.c``; ``from a.b import name`` (``name`` not a
module) points at the package ``a.b`` (its ``__init__``).  The implicit import
of parent packages (``import a.b.c`` runs ``a/__init__`` and ``a/b/__init__``)
is not an edge: it would make every package's ``__init__`` part of a cycle with
its own submodules.  ``if TYPE_CHECKING:`` imports count like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = "cipherlm"
ROOT = Path(__file__).resolve().parents[1] / PKG

# Module-name prefix -> layer; the longest matching prefix wins.  The main stack,
# top to bottom, as in DESIGN.md: cli/serve -> runtime -> compile -> protocols
# (+ the CryptoMoE protocol files) -> mpc -> he -> net -> _core.
LAYERS = {
    # cli / serve: the command line, what each command does, launch helpers,
    # benchmark code behind `cipherlm bench`, run reports
    "cipherlm.__main__": "cli",
    "cipherlm.cli": "cli",
    "cipherlm.commands": "cli",
    "cipherlm.launch": "cli",
    "cipherlm.bench": "cli",
    "cipherlm.report": "cli",
    "cipherlm.runtime": "runtime",
    "cipherlm.compile": "compile",      # the model graph: IR, architecture table, builders, passes
    "cipherlm.fhe": "compile",          # fhe mode, compile time: approximations (used by passes.fhe_levels)
    "cipherlm.fhe.calibrate": "runtime",  # runs the plain executor to measure the approximations' ranges
    "cipherlm.protocols": "protocols",
    "cipherlm.moe": "protocols",        # CryptoMoE dispatch/combine/layer on shares, plaintext routing
    "cipherlm.mpc": "mpc",              # shares, OT, primitives (mpc/protocols/), nonlinear library
    "cipherlm.he": "he",
    "cipherlm.net": "net",
    "cipherlm._core": "_core",          # the Rust extension (cipherlm/_core.*.so)
    # side layer: loaders, configs, tokenizers, data, fixtures; used by runtime and above
    "cipherlm.models": "models",
    # leaves outside DESIGN.md's table: they import nothing from the package, every
    # layer may import them (the package root holds __version__; progress.py is a
    # stderr progress bar used by the runtime's sessions and by the commands)
    "cipherlm": "leaf",
    "cipherlm.progress": "leaf",
}

STACK = ["cli", "runtime", "compile", "protocols", "mpc", "he", "net", "_core"]   # top to bottom
RANK = {name: len(STACK) - i for i, name in enumerate(STACK)}
MODELS_USERS = {"cli", "runtime", "compile", "models"}    # who may import the side layer

# Cycles still tolerated: each entry is the exact set of modules of one cycle
# (strongly connected component).  A new module joining one of them, or any other
# cycle, fails the test.  Remove an entry once its cycle is gone.
ALLOWED_CYCLES: list[set[str]] = [
    # none left: protocols/linear <-> linear_simd was closed by moving what both use
    # (block plan, widths, input truncation) into protocols/linear_common.py
]


def _modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    mods = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root.parent).with_suffix("").parts
        is_pkg = rel[-1] == "__init__"
        name = ".".join(rel[:-1] if is_pkg else rel)
        mods[name] = (p, is_pkg)
    for p in root.glob("*.so"):  # compiled extension modules (_core.abi3.so)
        mods.setdefault(f"{PKG}.{p.name.split('.')[0]}", (p, False))
    mods.setdefault(f"{PKG}._core", (root / "_core", False))  # not built: still a module name
    return mods


def _resolve(name: str, mods) -> str:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """{module: {imported module: line of the first such import}} within the package."""
    mods = _modules(root)
    graph: dict[str, dict[str, int]] = {}
    for mod, (path, is_pkg) in mods.items():
        if path.suffix != ".py":
            graph[mod] = {}
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        package = mod if is_pkg else mod.rpartition(".")[0]
        out: dict[str, int] = {}

        def add(target: str, line: int) -> None:
            target = _resolve(target, mods)
            if target and target != mod:
                out.setdefault(target, line)

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == PKG or alias.name.startswith(PKG + "."):
                        add(alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = parts[:len(parts) - (node.level - 1)]
                    full = ".".join(base + ([node.module] if node.module else []))
                else:
                    full = node.module or ""
                if not (full == PKG or full.startswith(PKG + ".")):
                    continue
                for alias in node.names:
                    sub = f"{full}.{alias.name}"
                    add(sub if sub in mods else full, node.lineno)
        graph[mod] = out
    return graph


def layer_of(mod: str) -> str | None:
    best = None
    for prefix in LAYERS:
        if (mod == prefix or mod.startswith(prefix + ".")) and (best is None or len(prefix) > len(best)):
            best = prefix
    return None if best is None else LAYERS[best]


def may_import(src: str, dst: str) -> bool:
    if dst == "leaf" or src == dst:
        return True
    if src == "leaf":
        return False
    if dst == "models":
        return src in MODELS_USERS
    if src == "models":
        return dst == "_core"
    return RANK[src] > RANK[dst]


def cycles(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[set[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(comp)
    return out


def _cycle_path(graph, comp: set[str]) -> str:
    """One concrete loop through the component, for the failure message."""
    start = min(comp)
    path, seen = [start], {start}
    v = start
    while True:
        nxt = sorted(w for w in graph[v] if w in comp)
        back = [w for w in nxt if w == start]
        if back and len(path) > 1:
            return " -> ".join(path + [start])
        fresh = [w for w in nxt if w not in seen]
        if not fresh:
            w = nxt[0]
            return " -> ".join(path[path.index(w):] + [w]) if w in path else " -> ".join(path + [w])
        v = fresh[0]
        path.append(v)
        seen.add(v)


def test_every_module_has_a_layer():
    missing = sorted(m for m in import_graph() if layer_of(m) is None)
    assert not missing, f"modules with no layer in tests/test_layering.py LAYERS: {missing}"


def test_no_upward_imports():
    graph = import_graph()
    bad = []
    for src, targets in sorted(graph.items()):
        for dst, line in sorted(targets.items()):
            ls, ld = layer_of(src), layer_of(dst)
            if ls and ld and not may_import(ls, ld):
                bad.append(f"{src} ({ls}) imports {dst} ({ld}) at line {line}")
    assert not bad, "imports that point up (DESIGN.md 'Layers'):\n  " + "\n  ".join(bad)


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    bad = [c for c in found if c not in ALLOWED_CYCLES]
    assert not bad, "import cycles (lazy imports included):\n  " + "\n  ".join(
        f"{sorted(c)}: e.g. {_cycle_path(graph, c)}" for c in bad)


def test_checker_sees_lazy_and_relative_imports():
    """The checker itself: function-level and relative imports are edges."""
    graph = import_graph()
    # cli.main imports cipherlm.commands inside the function
    assert "cipherlm.commands" in graph["cipherlm.cli"]
    # relative "from ..protocols.linear import ..." in a subpackage
    assert "cipherlm.protocols.linear" in graph["cipherlm.moe.layer"]
    assert layer_of("cipherlm.mpc.protocols.mul") == "mpc"
    assert layer_of("cipherlm.protocols.linear") == "protocols"
    assert not may_import("mpc", "protocols") and may_import("protocols", "mpc")
    assert not may_import("protocols", "models") and may_import("runtime", "models")
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [{"a", "b", "c"}]
    # linear dispatches to linear_simd; both use linear_common; nothing points back
    assert "cipherlm.protocols.linear_simd" in graph["cipherlm.protocols.linear"]
    assert "cipherlm.protocols.linear" not in graph["cipherlm.protocols.linear_simd"]
    common = set(graph["cipherlm.protocols.linear_common"])
    assert not common & {"cipherlm.protocols.linear", "cipherlm.protocols.linear_simd"}


def test_checker_catches_a_lazy_upward_import_and_a_cycle(tmp_path):
    """A throw-away package: mpc/x.py imports the runtime inside a function (upward),
    and mpc/y.py <-> mpc/z.py import each other (one of them lazily)."""
    pkg = tmp_path / PKG
    files = {
        "__init__.py": "",
        "mpc/__init__.py": "",
        "mpc/x.py": "def f():\n    from cipherlm.runtime.plain import run\n    return run\n",
        "mpc/y.py": "from . import z\n",
        "mpc/z.py": "def g():\n    from .y import h\n",
        "runtime/__init__.py": "",
        "runtime/plain.py": "from ..mpc import x\n",
    }
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    graph = import_graph(pkg)
    assert graph["cipherlm.mpc.x"] == {"cipherlm.runtime.plain": 2}
    assert not may_import(layer_of("cipherlm.mpc.x"), layer_of("cipherlm.runtime.plain"))
    assert sorted(map(sorted, cycles(graph))) == [["cipherlm.mpc.x", "cipherlm.runtime.plain"],
                                                  ["cipherlm.mpc.y", "cipherlm.mpc.z"]]
