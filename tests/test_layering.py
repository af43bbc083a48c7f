"""The layering rules, checked on the source: arrows point down, no cycles, no module assigns another's globals.

Packages, from the bottom: `reference` (NumPy; the format's facts in `reference.format`), `nf4` (the
product: may import `reference.format` only), `verify` (measuring code; may use nf4 and reference),
`experiments` (may use verify, nf4, reference), `paper` (reads results/; may use reference). The
graph is built from every module's module-level imports (imports inside functions are the lazy kind
the rules ask for: they cannot form a load-time cycle); a violation names the file and the import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path, *, module_level_only: bool) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[: len(base) - node.level + 1]
                mod = ".".join(parent + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, node.lineno))
            # `from pkg import submodule` imports the submodule
            out += [(f"{mod}.{alias.name}", node.lineno) for alias in node.names if f"{mod}.{alias.name}" in MODULES]
    return out


def _ours(mod: str) -> str | None:
    top = mod.split(".")[0]
    return top if top in PACKAGES else None


def test_packages_import_only_what_lies_below_them():
    bad = []
    for name, path in MODULES.items():
        pkg = name.split(".")[0]
        for mod, line in _imports(name, path, module_level_only=False):
            other = _ours(mod)
            if other is None or other == pkg:
                continue
            if other not in ALLOWED[pkg]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {pkg} imports {mod}")
            elif pkg == "nf4" and not any(mod == m or mod.startswith(m + ".") for m in NF4_MAY_IMPORT_FROM_REFERENCE):
                if mod != "reference":
                    bad.append(f"{path.relative_to(ROOT)}:{line}: nf4 imports {mod} (only reference.format)")
                else:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: nf4 imports the reference package itself")
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


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


def test_no_import_cycles_between_modules_or_packages():
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    packages: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for name, path in MODULES.items():
        for mod, _ in _imports(name, path, module_level_only=True):
            target = mod
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):  # a package's own __init__
                graph[name].add(target)
        for mod, _ in _imports(name, path, module_level_only=False):
            other = _ours(mod)
            if other and other != name.split(".")[0]:
                packages[name.split(".")[0]].add(other)
    assert _cycle(packages) is None, f"package cycle: {' -> '.join(_cycle(packages))}"
    cycle = _cycle(graph)
    assert cycle is None, f"module-level import cycle: {' -> '.join(cycle)}"


def test_the_layering_check_can_fail():
    """The checks above see a planted violation: a cycle and an upward import."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert "verify" not in ALLOWED["nf4"] and "nf4" not in ALLOWED["reference"]


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
