"""The layering rules, checked on the source: arrows point down, no cycles, no module assigns another's globals,
no file in nf4 over 400 lines, no op reads another op's private names.

Packages, from the bottom: `reference` (NumPy; the format's facts in `reference.format`), `nf4` (the
product: may import `reference.format` only), `verify` (measuring code; may use nf4 and reference),
`experiments` (may use verify, nf4, reference), `paper` (reads results/; may use reference).

The import graph is built from every import in every module, the ones inside functions too (a lazy import
defers a cycle to the first call, it does not remove it), relative imports resolved; `import a.b.c` is an
edge to `a.b.c` only (not to the packages `a`, `a.b` it also runs), `from pkg import name` an edge to
`pkg.name` where that is a module and to `pkg` (its `__init__`) where it is not. Imports under
`if TYPE_CHECKING:` never run and are left out. A cycle is reported as its path of modules with the
file:line of each edge; any other violation names the file, the line and the import.

An op is a folder of nf4 with an `api.py` (nf4/dequant, nf4/linear, ...). No module of one op, and no module of
nf4 outside the ops, imports a name beginning with `_` from another op's folder or reads `mod._name` on a module
of another op's folder. The checks are functions of a source tree ({path relative to the root: text}), and
each is shown to fail on a small planted tree, so none can pass vacuously.
"""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("reference", "nf4", "verify", "experiments", "paper")
# package -> the packages it may import (module level or lazily)
ALLOWED = {
    "reference": set(),
    "nf4": {"reference"},
    "verify": {"reference", "nf4"},
    "experiments": {"reference", "nf4", "verify"},
    "paper": {"reference"},
}
# what nf4 may take from reference: the format's facts (NumPy only), nothing that pulls in the rest
NF4_MAY_IMPORT_FROM_REFERENCE = {"reference.format"}
PRODUCT = "nf4"
MAX_LINES = 400  # per source file of the product


# --- the source tree as data: {path relative to the root, with "/": text} ------------------

def _read_tree(root: Path, folders) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for f in folders for p in sorted((root / f).rglob("*.py"))}


def _module_of(rel: str) -> tuple[str, bool]:
    """("a.b.c", is a package) for "a/b/c.py" or "a/b/c/__init__.py"."""
    parts = rel.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


TREE = _read_tree(ROOT, PACKAGES)
MODULES = {_module_of(rel)[0]: ROOT / rel for rel in TREE}


class _Import(NamedTuple):
    line: int
    module: str  # the module the statement names, relative imports resolved
    name: str | None  # `from module import name`; None for `import module`
    asname: str | None
    in_function: bool
    type_checking: bool  # under `if TYPE_CHECKING:`: never runs


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, in_function: bool = False, type_checking: bool = False):
    """ast.walk that also says whether a node lies inside a function and under `if TYPE_CHECKING:`."""
    yield node, in_function, type_checking
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        for child in node.body:
            yield from _walk(child, in_function, True)
        for child in node.orelse:
            yield from _walk(child, in_function, type_checking)
        return
    inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    for child in ast.iter_child_nodes(node):
        yield from _walk(child, inner, type_checking)


def _from_module(rel: str, node: ast.ImportFrom) -> str:
    """The absolute module of `from ... import`, relative to the file at `rel`."""
    if not node.level:
        return node.module or ""
    name, is_pkg = _module_of(rel)
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    return ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))


def _imports_of(rel: str, text: str) -> list[_Import]:
    """Every import in the file (module level, in functions, under TYPE_CHECKING), one per imported name."""
    out = []
    for node, in_function, type_checking in _walk(ast.parse(text, filename=rel)):
        if isinstance(node, ast.Import):
            out += [_Import(node.lineno, a.name, None, a.asname, in_function, type_checking) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(rel, node)
            out += [_Import(node.lineno, mod, a.name, a.asname, in_function, type_checking) for a in node.names]
    return out


def _imports(rel: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file; `from pkg import submodule` also gives the submodule."""
    out = []
    for imp in _imports_of(rel, TREE[rel]):
        out.append((imp.module, imp.line))
        if imp.name and f"{imp.module}.{imp.name}" in MODULES:
            out.append((f"{imp.module}.{imp.name}", imp.line))
    return out


def _ours(mod: str) -> str | None:
    top = mod.split(".")[0]
    return top if top in PACKAGES else None


def test_packages_import_only_what_lies_below_them():
    bad = []
    for rel in TREE:
        pkg = rel.split("/")[0]
        for mod, line in _imports(rel):
            other = _ours(mod)
            if other is None or other == pkg:
                continue
            if other not in ALLOWED[pkg]:
                bad.append(f"{rel}:{line}: {pkg} imports {mod}")
            elif pkg == "nf4" and not any(mod == m or mod.startswith(m + ".") for m in NF4_MAY_IMPORT_FROM_REFERENCE):
                if mod != "reference":
                    bad.append(f"{rel}:{line}: nf4 imports {mod} (only reference.format)")
                else:
                    bad.append(f"{rel}:{line}: nf4 imports the reference package itself")
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


# --- import cycles, through imports inside functions too ------------------------------------

# module -> module it imports -> the sites of that edge ("path:line", "(in a function)" where lazy)
Graph = dict[str, dict[str, list[str]]]


def _edge_target(imp: _Import, modules) -> str | None:
    """The one module of `modules` an import runs: `import a.b.c` -> a.b.c (not a, a.b); `from pkg import m` ->
    pkg.m where that is a module, else pkg (its __init__); the nearest enclosing module where the named one is not
    ours (None for other projects' modules)."""
    if imp.name and f"{imp.module}.{imp.name}" in modules:
        return f"{imp.module}.{imp.name}"
    target = imp.module
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def _import_graph(tree: dict[str, str]) -> Graph:
    modules = {_module_of(rel)[0] for rel in tree}
    graph: Graph = {m: {} for m in modules}
    for rel, text in tree.items():
        name = _module_of(rel)[0]
        for imp in _imports_of(rel, text):
            target = None if imp.type_checking else _edge_target(imp, modules)
            if target and target != name:
                site = f"{rel}:{imp.line}" + (" (in a function)" if imp.in_function else "")
                sites = graph[name].setdefault(target, [])
                if site not in sites:  # `from m import a, b`: one site
                    sites.append(site)
    return graph


def _package_graph(graph: Graph) -> Graph:
    packages: Graph = {}
    for name, targets in graph.items():
        packages.setdefault(name.split(".")[0], {})
        for target, sites in targets.items():
            if target.split(".")[0] != name.split(".")[0]:
                packages[name.split(".")[0]].setdefault(target.split(".")[0], []).extend(sites)
                packages.setdefault(target.split(".")[0], {})
    return packages


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _strongly_connected(graph) -> list[list[str]]:
    """Tarjan's components of the graph, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _shortest_cycle_through(graph, start: str, within: set[str]) -> list[str]:
    prev: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                path = [node]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return [*reversed(path), start]
            if nxt in within and nxt not in prev:
                prev[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{start} is on no cycle")


def _import_cycles(graph) -> list[list[str]]:
    """Cycles that together pass through every module that lies on any cycle: per strongly connected
    component, the shortest cycle through each member that no cycle reported so far passes through."""
    cycles = []
    for component in _strongly_connected(graph):
        if len(component) == 1 and component[0] not in graph.get(component[0], ()):
            continue
        covered: set[str] = set()
        for node in component:
            if node not in covered:
                cycle = _shortest_cycle_through(graph, node, set(component))
                cycles.append(cycle)
                covered.update(cycle)
    return cycles


def _describe_cycle(graph: Graph, cycle: list[str]) -> str:
    lines = [" -> ".join(cycle)]
    for a, b in itertools.pairwise(cycle):
        sites = graph[a][b]
        more = f" and {len(sites) - 3} more" if len(sites) > 3 else ""
        lines.append(f"    {a} -> {b}: {', '.join(sites[:3])}{more}")
    return "\n".join(lines)


def _cycle_report(graph: Graph) -> list[str]:
    return [_describe_cycle(graph, cycle) for cycle in _import_cycles(graph)]


def test_no_import_cycles_between_modules_or_packages():
    """No cycle among packages or among modules, imports inside functions counted (every package in PACKAGES)."""
    graph = _import_graph(TREE)
    packages = _package_graph(graph)
    assert _cycle(packages) is None, "package cycle:\n" + "\n".join(_cycle_report(packages))
    found = _cycle_report(graph)
    assert not found, f"{len(found)} import cycle(s), imports inside functions included:\n" + "\n".join(found)


def test_the_layering_check_can_fail():
    """The checks above see a planted violation: a cycle and an upward import."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert "verify" not in ALLOWED["nf4"] and "nf4" not in ALLOWED["reference"]


def test_the_cycle_check_sees_imports_inside_functions():
    """A planted cycle through a function-local import is found, with the file:line of each edge; a
    TYPE_CHECKING import is no edge; `import pkg.sub` is an edge to pkg.sub alone, `from pkg import
    not_a_module` an edge to pkg's __init__."""
    tree = {
        "pkg/__init__.py": "",
        "pkg/ops.py": "import torch\n\nfrom .sub.api import f\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/api.py": "import math\n\n\ndef f():\n    from .. import ops\n    return ops\n",
    }
    graph = _import_graph(tree)
    assert graph["pkg.sub.api"] == {"pkg.ops": ["pkg/sub/api.py:5 (in a function)"]}
    assert _import_cycles(graph) == [["pkg.ops", "pkg.sub.api", "pkg.ops"]]
    report = _cycle_report(graph)[0]
    assert "pkg/ops.py:3" in report and "pkg/sub/api.py:5 (in a function)" in report, report
    # the absolute spelling, deeper in a function, is the same edge
    absolute = {**tree, "pkg/sub/api.py": "def f():\n    if True:\n        import pkg.ops\n"}
    assert _import_cycles(_import_graph(absolute)) == [["pkg.ops", "pkg.sub.api", "pkg.ops"]]
    # under TYPE_CHECKING (either spelling): never runs, no edge
    for guard in ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:", "import typing\nif typing.TYPE_CHECKING:"):
        typed = {**tree, "pkg/sub/api.py": f"{guard}\n    from .. import ops\n"}
        assert _import_cycles(_import_graph(typed)) == []
    # an import of a submodule is no edge to its parent packages ...
    tree = {"pkg/__init__.py": "from .a import g\n", "pkg/a.py": "def g():\n    import pkg.b\n",
            "pkg/b.py": "from pkg import c\n", "pkg/c.py": ""}
    assert _import_cycles(_import_graph(tree)) == []
    # ... but `from pkg import name`, name not a module, is an edge to pkg/__init__.py
    tree["pkg/b.py"] = "from pkg import g\n"
    assert _import_cycles(_import_graph(tree)) == [["pkg", "pkg.a", "pkg.b", "pkg"]]
    # two separate cycles are both reported, and the package graph sees a package cycle
    tree = {"x/__init__.py": "", "x/m.py": "def f():\n    from y import n\n", "y/__init__.py": "",
            "y/n.py": "import x.m\n", "z/__init__.py": "", "z/p.py": "from . import q\n",
            "z/q.py": "from .p import h\n"}
    graph = _import_graph(tree)
    assert _import_cycles(graph) == [["x.m", "y.n", "x.m"], ["z.p", "z.q", "z.p"]]
    assert _cycle(_package_graph(graph)) == ["x", "y", "x"]

def _loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return set(result.stdout.split())


def _tops(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def test_import_nf4_loads_torch_and_triton_only():
    loaded = _tops(_loaded_after("import nf4"))
    baseline = _tops(_loaded_after("import torch, triton"))
    assert {"torch", "triton", "nf4"} <= loaded
    extra = loaded - baseline - {"nf4", "reference"}
    assert not extra & {"scipy", "bitsandbytes", "transformers", "peft", "verify", "experiments", "paper"}, extra
    assert not extra, f"import nf4 loads more than torch and triton: {sorted(extra)}"


def test_import_reference_loads_no_torch_and_no_scipy_until_needed():
    loaded = _tops(_loaded_after("import reference; reference.dequantize_nf4; reference.NF4_CODE"))
    assert "torch" not in loaded and "scipy" not in loaded and "triton" not in loaded
    assert "scipy" in _tops(_loaded_after("import reference; reference.nf4_code_from_normal()"))


# --- no module assigns another module's globals ---------------------------------------------

SOURCES = [p for pkg in (*PACKAGES, "tests") for p in sorted((ROOT / pkg).rglob("*.py"))]


def _module_aliases(tree: ast.Module) -> dict[str, str]:
    """Local names bound to one of our modules: `import nf4.api as api`, `from nf4 import runtime`, ..."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    top = alias.name.split(".")[0]
                    aliases[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and _ours(node.module) and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in MODULES:
                    aliases[alias.asname or alias.name] = full
        elif isinstance(node, ast.ImportFrom) and node.level:
            for alias in node.names:
                if alias.name[:1].islower() and alias.name not in ("annotations",):
                    aliases.setdefault(alias.asname or alias.name, f".{alias.name}")
    return aliases


def _assigned_module_globals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return _assigned_in(tree, str(path.relative_to(ROOT)))


def _assigned_in(tree: ast.AST, where: str) -> list[str]:
    """The assignments to our modules' globals in `tree`, also inside string constants that are Python programs
    importing our packages (a child process's `python -c` source)."""
    aliases = _module_aliases(tree)
    found = []

    def target_module(node):
        # a.b.c = ... / a.b[...] = ... where `a` (or `a.b`) names one of our modules
        while isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Attribute):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                return f"{base.id}...{node.attr}"
        return None

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                hit = target_module(leaf)
                if hit:
                    found.append(f"{where}:{node.lineno}: assigns {hit}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("setattr",):
            args = node.args
            if args and isinstance(args[0], ast.Name) and args[0].id in aliases:
                found.append(f"{where}:{node.lineno}: setattr on module {args[0].id}")
            if (args and isinstance(args[0], ast.Attribute) and isinstance(args[0].value, ast.Name)
                    and args[0].value.id in aliases):
                found.append(f"{where}:{node.lineno}: setattr on {args[0].value.id}.{args[0].attr}")
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" in node.value
                and any(f"import {p}" in node.value or f"from {p}" in node.value for p in PACKAGES)):
            try:
                child = ast.parse(node.value)
            except SyntaxError:
                continue  # prose, not a program
            found += _assigned_in(child, f"{where}:{node.lineno} (a program in a string)")
    return found


def test_no_module_assigns_another_modules_globals():
    bad = [hit for path in SOURCES for hit in _assigned_module_globals(path)]
    assert not bad, "\n".join(bad)


def test_the_globals_check_can_fail(tmp_path):
    planted = tmp_path / "planted.py"
    # one line per constant, so that this file holds no program in a string of its own
    lines = ["import nf4.dequant.api as api", "from nf4 import runtime", "api.TILE = 3", "runtime._compiled['k'] = 1",
             "def f(monkeypatch):", "    monkeypatch.setattr(api, 'X', 1)",
             'CHILD = """', "from nf4.linear import api", "api.mma_ok = None", '"""']
    planted.write_text("\n".join(lines) + "\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        hits = _assigned_module_globals(planted)
    finally:
        ROOT = saved
    assert len(hits) == 4 and sum("a program in a string" in h for h in hits) == 1, hits


# the documents outside the repository that the code once cited (spelled so this file does not match)
OUTSIDE = ("NF4_" + "FORMAT.md", "/work/" + "shared", "../" + "shared/", "GPU" + ".md")


@pytest.mark.parametrize("folder", [*PACKAGES, "tests", "docs"])
def test_no_citation_outside_the_repository(folder):
    """The code and docs cite the repository's own docs (docs/FORMAT.md), never a file outside it."""
    bad = []
    for path in sorted((ROOT / folder).rglob("*")):
        if path.suffix not in (".py", ".md", ".tex", ".sh") or "generated" in path.parts:
            continue
        text = path.read_text()
        for needle in OUTSIDE:
            if needle in text:
                bad.append(f"{path.relative_to(ROOT)}: cites {needle}")
    assert not bad, "\n".join(bad)


def test_experiments_import_no_private_names_from_nf4():
    """Variants, labs and the bench use nf4's public names (nf4.device, nf4.runtime, nf4.dequant), not `_x`."""
    bad = []
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "nf4":
                bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{a.name}"
                        for a in node.names if a.name.startswith("_")]
                if any(part.startswith("_") for part in node.module.split(".")):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: private module {node.module}")
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in ("nf4", "dequant_api", "runtime", "native"):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {base.id}...{node.attr}")
    assert not bad, "\n".join(bad)


# --- no source file of nf4 over MAX_LINES lines --------------------------------------------

def _long_files(tree: dict[str, str], folder: str = PRODUCT, limit: int = MAX_LINES) -> list[str]:
    return [f"{rel}: {n} lines (at most {limit})" for rel, text in sorted(tree.items())
            if rel.startswith(folder + "/") and (n := len(text.splitlines())) > limit]


def test_no_file_in_nf4_is_over_400_lines():
    bad = _long_files(TREE)
    assert not bad, f"{len(bad)} file(s) of {PRODUCT}/ over {MAX_LINES} lines:\n" + "\n".join(bad)


def test_the_length_check_can_fail():
    tree = {"nf4/a.py": "x = 1\n" * 401, "nf4/b.py": "x = 1\n" * 400, "nf4/c/d.py": "x = 1\n" * 900,
            "verify/e.py": "x = 1\n" * 900}
    assert _long_files(tree) == ["nf4/a.py: 401 lines (at most 400)", "nf4/c/d.py: 900 lines (at most 400)"]


# --- no op reads another op's private names ------------------------------------------------

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _op_folders(tree: dict[str, str], product: str = PRODUCT) -> set[str]:
    """The ops: the direct subfolders of the product that hold an api.py."""
    return {rel.split("/")[1] for rel in tree
            if rel.startswith(product + "/") and rel.count("/") == 2 and rel.endswith("/api.py")}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _scope_nodes(scope: ast.AST):
    """The nodes of one scope: not those inside the functions and classes nested in it (those are yielded, not
    entered)."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, _SCOPES):
            todo.extend(ast.iter_child_nodes(node))


def _module_reads(rel: str, module: ast.Module, modules: set[str]):
    """(attribute node, the module its base names) for every `alias.x.y` whose base is a local name bound to one of
    `modules` by an import in its scope or an enclosing one (`import a.b as m`, `from a import b`, `import a.b`)."""

    def bindings(node) -> dict[str, str]:
        if isinstance(node, ast.Import):
            return {a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0] for a in node.names}
        mod = _from_module(rel, node)
        return {a.asname or a.name: f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules}

    def visit(scope, outer):
        aliases = dict(outer)
        nodes = list(_scope_nodes(scope))
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                aliases.update(bindings(node))
        for node in nodes:
            if isinstance(node, ast.Attribute):
                chain, base = [], node.value
                while isinstance(base, ast.Attribute):
                    chain.append(base.attr)
                    base = base.value
                if isinstance(base, ast.Name) and base.id in aliases:
                    yield node, ".".join([aliases[base.id], *reversed(chain)])
            if isinstance(node, _SCOPES):
                yield from visit(node, aliases)

    yield from visit(module, {})


def _private_reads(tree: dict[str, str], product: str = PRODUCT) -> list[str]:
    """Every place a module of the product reads a private name of an op it does not belong to: an import of
    `_name` from (or a private module path into) that op's folder, module level or in a function, or `mod._name`
    on a module of that folder. Modules outside the ops (ops.py, integrations, runtime) are held to the same rule."""
    ops = _op_folders(tree, product)
    modules = {_module_of(rel)[0] for rel in tree}

    def op_of(dotted: str) -> str | None:
        parts = dotted.split(".")
        return parts[1] if len(parts) > 1 and parts[0] == product and parts[1] in ops else None

    bad: list[tuple[str, int, str]] = []
    for rel, text in sorted(tree.items()):
        if not rel.startswith(product + "/"):
            continue
        own = op_of(_module_of(rel)[0])
        for imp in _imports_of(rel, text):
            dotted = imp.module if imp.name in (None, "*") else f"{imp.module}.{imp.name}"
            op = op_of(dotted)
            if op is None or op == own:
                continue
            private = [p for p in dotted.split(".")[2:] if _is_private(p)]
            if private:
                bad.append((rel, imp.line, f"imports {private[0]} from {dotted.rpartition('.' + private[0])[0]}"
                                           f" (private to the {op} op)"))
        for node, dotted in _module_reads(rel, ast.parse(text, filename=rel), modules):
            op = op_of(dotted)
            if _is_private(node.attr) and dotted in modules and op is not None and op != own:
                bad.append((rel, node.lineno, f"reads {node.attr} of {dotted} (private to the {op} op)"))
    return [f"{rel}:{line}: {what}" for rel, line, what in sorted(bad)]


def test_no_op_reads_another_ops_private_names():
    """An op (a folder of nf4 with an api.py) uses another op only through its public names; so does the rest of nf4."""
    assert {"dequant", "linear"} <= _op_folders(TREE)
    bad = _private_reads(TREE)
    assert not bad, f"{len(bad)} read(s) of another op's private names:\n" + "\n".join(bad)


def test_the_private_names_check_can_fail():
    tree = {
        "nf4/__init__.py": "",
        "nf4/_shared.py": "",
        "nf4/ops.py": "from .dequant.api import _dummy, launch\n",
        "nf4/util/__init__.py": "",
        "nf4/util/helpers.py": "_x = 1\n",  # not an op: no api.py
        "nf4/dequant/__init__.py": "from .api import dequantize\n",
        "nf4/dequant/api.py": "from ._impl import _fast\n_check = 1\ndequantize = 2\n",
        "nf4/dequant/_impl.py": "_fast = 1\n",
        "nf4/linear/__init__.py": "",
        "nf4/linear/kernel.py": "_tile = 1\n",
        "nf4/linear/api.py": "\n".join([
            "from .. import _shared",  # nf4's own private module: not an op's
            "from ..util.helpers import _x",  # not an op
            "from .kernel import _tile",  # its own op
            "from ..dequant.api import _check, dequantize as _dequantize",  # 4: _check (the alias is no matter)
            "from ..dequant import api as dapi",
            "import nf4.dequant.api",
            "def f():",
            "    from nf4.dequant.api import _check as c",  # 8: in a function
            "    return dapi._check, dapi.dequantize, nf4.dequant.api._check, dapi.__name__",  # 9: two reads
            "def g():",
            "    from nf4.dequant import _impl",  # 11: a private module
            "    import nf4.dequant._impl as impl",  # 12: a private module path
            "    return impl._fast",  # 13
            "def h(api):",
            "    return api._private",  # a parameter, not a module alias: nothing
        ]) + "\n",
        "nf4/integrations/__init__.py": "",
        "nf4/integrations/bnb.py": "def patch():\n    from ..linear import api\n    return api._dapi_cache\n",
        "verify/t.py": "from nf4.dequant.api import _check\n",  # not nf4: rule does not apply here
    }
    assert _op_folders(tree) == {"dequant", "linear"}
    bad = _private_reads(tree)
    assert bad == [
        "nf4/integrations/bnb.py:3: reads _dapi_cache of nf4.linear.api (private to the linear op)",
        "nf4/linear/api.py:4: imports _check from nf4.dequant.api (private to the dequant op)",
        "nf4/linear/api.py:8: imports _check from nf4.dequant.api (private to the dequant op)",
        "nf4/linear/api.py:9: reads _check of nf4.dequant.api (private to the dequant op)",
        "nf4/linear/api.py:9: reads _check of nf4.dequant.api (private to the dequant op)",
        "nf4/linear/api.py:11: imports _impl from nf4.dequant (private to the dequant op)",
        "nf4/linear/api.py:12: imports _impl from nf4.dequant (private to the dequant op)",
        "nf4/linear/api.py:13: reads _fast of nf4.dequant._impl (private to the dequant op)",
        "nf4/ops.py:1: imports _dummy from nf4.dequant.api (private to the dequant op)",
    ], bad
