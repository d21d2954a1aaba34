"""The package's shape: layer folders and the direction of their imports, no import cycle, imports at the top of
the file, few modules directly in lora_eval/, no long function outside the kernels (issue 43)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = {"errors", "names", "progress", "distributed", "hf"}  # plain helpers every layer may use
# layer -> the layers its modules may import (itself always); a module directly in lora_eval/ is its own layer
MAY_IMPORT = {
    **{name: BASE for name in BASE},
    "kernels": set(), "runners": set(),
    "models": BASE,
    "adapters": BASE | {"models"},
    "inputs": BASE | {"models"},
    "engine": BASE | {"inputs", "models", "adapters", "kernels", "runners"},
    "results": BASE | {"inputs"},
    "render": BASE | {"results"},
    "tasks": BASE | {"inputs", "models", "adapters", "engine", "results", "render", "kernels", "runners"},
}
TOP = {"__init__", "__main__", "cli", "commands", "launch", "golden"}  # the entry points: may import any layer
MAX_TOP_MODULES = 12
MAX_FUNCTION_LINES = 80


def package_files() -> list[Path]:
    return [*ROOT.joinpath("lora_eval").rglob("*.py"), *ROOT.joinpath("kernels").glob("*.py"),
            *ROOT.joinpath("runners").glob("*.py")]


def module_name(path: Path) -> str:
    """lora_eval.x.y for a file of the package (kernels/ and runners/ are lora_eval.kernels / lora_eval.runners)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = ("lora_eval", *parts) if parts[0] in ("kernels", "runners") else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path: Path, modules: set[str]) -> tuple[set[str], list[str]]:
    """The package's modules a file imports (anywhere in it), and those it imports inside a function."""
    tree = ast.parse(path.read_text())
    name = module_name(path)
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)}
    found, local = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {a.name for a in node.names if a.name.startswith("lora_eval")}
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("lora_eval")):
            origin = ".".join(here[:len(here) - node.level + 1]) if node.level else ""
            target = ".".join(p for p in (origin, node.module or "") if p)
            names = {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
        else:
            continue
        found |= names
        if id(node) in inside:
            local += sorted(names)
    return found, local


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    modules = {module_name(p): p for p in package_files()}
    graph, deferred = {}, []
    for name, path in modules.items():
        found, local = package_imports(path, set(modules))
        graph[name] = found & set(modules) - {name}
        deferred += [(name, m) for m in local]
    return graph, deferred


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_import_graph_has_no_cycle_and_imports_sit_at_the_top():
    graph, deferred = import_graph()
    # the Triton kernels and CUDA-graph runner are the one optional heavy dependency a module may defer
    assert [(a, b) for a, b in deferred if not b.startswith(("lora_eval.kernels", "lora_eval.runners"))] == []
    assert graph["lora_eval.render.files"] >= {"lora_eval.results.tables", "lora_eval.render.html"}  # (it sees imports)
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, node, nxt]))
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def wrong_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of `graph` that goes up the layers or sideways into a layer MAY_IMPORT does not allow."""
    return sorted(f"{a} imports {b}" for a, targets in graph.items() for b in targets
                  if layer(a) not in TOP and layer(b) != layer(a) and layer(b) not in MAY_IMPORT[layer(a)])


def test_every_import_goes_down_the_layers():
    graph, _ = import_graph()
    layers = {layer(m) for m in graph}
    assert layers - TOP - set(MAY_IMPORT) == set(), "a module directly in lora_eval/ without a place in MAY_IMPORT"
    assert wrong_imports(graph) == []


def test_the_rule_sees_a_wrong_import():
    """The check above is not vacuous: an import up the layers, as the graph would hold it, is caught by it."""
    graph, _ = import_graph()
    graph["lora_eval.results.tables"] = graph["lora_eval.results.tables"] | {"lora_eval.engine.engine"}
    assert wrong_imports(graph) == ["lora_eval.results.tables imports lora_eval.engine.engine"]


def test_every_folder_says_what_belongs_there():
    for init in ROOT.joinpath("lora_eval").rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 80, f"{init}: a docstring saying what belongs there"


def test_few_modules_directly_in_the_package():
    top = sorted(p.stem for p in ROOT.joinpath("lora_eval").glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
    assert set(top) <= TOP | BASE, set(top) - TOP - BASE


def test_no_long_function_outside_the_kernels():
    long = []
    for path in ROOT.joinpath("lora_eval").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_every_package_folder_is_installed():
    """pyproject.toml lists the packages a (non-editable) install ships: a layer folder left out would be missing from
    the wheel while every editable checkout works."""
    listed = set(tomllib.loads(ROOT.joinpath("pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in ROOT.joinpath("lora_eval").rglob("__init__.py")}
    assert folders | {"lora_eval.kernels", "lora_eval.runners"} == listed
