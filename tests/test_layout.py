"""The layout holds: the import graph, built from the source, has no circle; each layer imports only the layers
below it (docs/design.md, "Module map"); no product file outgrows one concept; bench/ and tests/ import the
product and never each other, and bench/ never edits sys.path."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("quant", "server")
# Which product layer may import which (a layer always imports itself). quant.errors is the shared bottom.
ALLOWED = {
    "quant.shape": {"quant.errors"},
    "quant.format": {"quant.errors", "quant.shape"},
    "quant.runtime": {"quant.errors", "quant.shape", "quant.format"},
    "quant.build": {"quant.errors", "quant.shape", "quant.format", "quant.runtime"},
    "quant.cli": {"quant.errors", "quant.shape", "quant.format", "quant.runtime", "quant.build"},
    "server": {"quant.errors", "quant.shape", "quant.format", "quant.runtime"},
}
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, package: str) -> list[tuple[str, str | None]]:
    """(module, name imported from it) for every import that runs (at module level or in a function); the
    imports under ``if TYPE_CHECKING:`` are annotations only and never run."""
    out: list[tuple[str, str | None]] = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, None) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - child.level + 1] + ([base] if base else []))
                out.extend((base, a.name) for a in child.names)
            visit(child)

    visit(tree)
    return out


def _graph() -> dict[str, set[str]]:
    files = {p: _module_name(p) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    modules = set(files.values())
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for path, mod in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for base, name in _imports(ast.parse(path.read_text()), package):
            target = f"{base}.{name}" if name and f"{base}.{name}" in modules else base
            if target in modules and target != mod:
                graph[mod].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _layer(mod: str) -> str | None:
    if mod == "server" or mod.startswith("server."):
        return "server"
    for layer in ALLOWED:
        if mod == layer or mod.startswith(layer + "."):
            return layer
    return None


def test_cycle_finder_finds_a_circle_and_passes_a_chain():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle_in_the_product():
    circles = _cycles(_graph())
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_each_layer_imports_only_the_layers_below_it():
    bad = []
    for mod, targets in _graph().items():
        layer = _layer(mod)
        for t in targets:
            tl = _layer(t)
            if layer and tl and tl != layer and tl not in ALLOWED[layer]:
                bad.append(f"{mod} -> {t}")
    assert not bad, "imports against the layering: " + ", ".join(sorted(bad))


def test_no_product_file_over_the_line_limit():
    over = [f"{p.relative_to(ROOT)} ({n})" for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not over, f"over {MAX_LINES} lines: " + ", ".join(over)


def test_bench_imports_the_product_never_tests_and_never_edits_sys_path():
    bad = []
    for p in (ROOT / "bench").rglob("*.py"):
        if (ROOT / "bench" / "out") in p.parents:  # bench's outputs (git-ignored), e.g. a baseline's worktree
            continue
        text = p.read_text()
        for base, _ in _imports(ast.parse(text), "bench"):
            if base == "tests" or base.startswith("tests."):
                bad.append(f"{p.relative_to(ROOT)} imports {base}")
        if "sys.path" in text:
            bad.append(f"{p.relative_to(ROOT)} edits sys.path")
    assert not bad, "; ".join(bad)


def test_tests_never_import_bench():
    """A test runs bench/'s scripts as a user does (a process of its own), never imports them: what both need is
    the product's (server/loadgen holds the load and fuzz drivers)."""
    bad = [f"{p.relative_to(ROOT)} imports {base}" for p in sorted((ROOT / "tests").rglob("*.py"))
           for base, _ in _imports(ast.parse(p.read_text()), "tests") if base == "bench" or base.startswith("bench.")]
    assert not bad, "; ".join(bad)
