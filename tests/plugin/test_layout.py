"""The adapter's layout, read from its source (Python's `ast`, every `import` and `from ... import`, at module level
and inside functions, `TYPE_CHECKING` blocks included):

- at most 12 modules at the adapter's top level; the rest in its sub-packages (`gdn`, `trees`, `v1`, `v2`, `compat`,
  `testing`);
- `v1` (vLLM's V1 runner's hooks) and `v2` (Model Runner V2's) never import each other; `gdn` and `trees` (what both
  runners share) import neither, and `gdn` does not import `trees`;
- no import circle among the adapter's modules;
- the math and kernels (`vllm_treewy.kernels`, `vllm_treewy.tree`, `vllm_treewy.spec_decode`) import no vllm.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = "vllm_treewy.vllm_plugin"
MAX_TOP_LEVEL_MODULES = 12


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> set[str]:
    """Every dotted name an import statement of the file names (a module, or `module.name` for `from module import
    name`), wherever the statement sits."""
    names = set()
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            module = node.module if node.level == 0 else base
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def adapter_graph() -> dict[str, set[str]]:
    """module -> the adapter modules it imports (a package's `__init__` only where it is imported as such: `from pkg
    import module` names the module, not the package)."""
    modules = {module_name(p): p for p in (ROOT / "vllm_treewy" / "vllm_plugin").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = {n for n in imported_names(path) if n in modules and n != name}
        graph[name] = {t for t in targets if not any(o.startswith(t + ".") for o in targets)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and modules that import themselves."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def sub_package(module: str) -> str:
    rest = module[len(ADAPTER) + 1:]
    return rest.split(".")[0] if "." in rest else ""


FORBIDDEN = {"v1": {"v2"}, "v2": {"v1"}, "trees": {"v1", "v2"}, "gdn": {"v1", "v2", "trees"}}


def layer_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return [(m, d) for m, deps in graph.items() for d in deps
            if sub_package(d) in FORBIDDEN.get(sub_package(m), ())]


def test_the_adapter_has_at_most_twelve_top_level_modules():
    top = sorted(p.name for p in (ROOT / "vllm_treewy" / "vllm_plugin").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_runner_imports_the_other_and_the_shared_packages_import_no_runner():
    graph = adapter_graph()
    assert any(sub_package(m) == "v2" for m in graph) and any(sub_package(m) == "v1" for m in graph)
    assert layer_violations(graph) == []


def test_no_import_circle_among_the_adapters_modules():
    assert cycles(adapter_graph()) == []


def test_the_checks_find_a_planted_circle_and_a_planted_v2_to_v1_import():
    graph = adapter_graph()
    v1_module = next(m for m in graph if sub_package(m) == "v1" and not m.endswith(".v1"))
    v2_module = next(m for m in graph if sub_package(m) == "v2" and not m.endswith(".v2"))
    planted = {**graph, v2_module: graph[v2_module] | {v1_module}, v1_module: graph[v1_module] | {v2_module}}
    assert (v2_module, v1_module) in layer_violations(planted)
    assert any(v1_module in c and v2_module in c for c in cycles(planted))


@pytest.mark.parametrize("part", ["kernels", "tree.py", "spec_decode"])
def test_the_math_and_kernels_import_no_vllm(part):
    base = ROOT / "vllm_treewy" / part
    files = [base] if base.is_file() else sorted(base.rglob("*.py"))
    assert files
    for path in files:
        assert not {n for n in imported_names(path) if n == "vllm" or n.startswith("vllm.")}, path
