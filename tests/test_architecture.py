"""The structure docs/architecture.md describes, checked on the source (parsed, never imported).

- No import cycle in ``planner/``, ``runtime/``, ``search_spaces/``, ``jobs/`` or ``bench/``, counting
  imports inside functions (not those under ``if TYPE_CHECKING:``, which never run).
- Data flows one way: ``planner`` and ``search_spaces`` never import ``runtime``, ``jobs`` or ``bench``,
  and ``planner`` never imports ``search_spaces`` (it is handed the spaces), not even inside a function.
- No source file over 350 lines; no function with more than 12 parameters.
- No state attached to frozen objects: no ``object.__setattr__`` in ``planner/`` or ``search_spaces/``.
- Private torch attributes are reached only through ``runtime/torch_private.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "runtime", "search_spaces", "jobs", "bench")
MAX_LINES = 350
MAX_PARAMETERS = 12
# torch attributes that are private (leading underscore) and that this project needs; see runtime/torch_private.py.
PRIVATE_TORCH_ATTRIBUTES = {
    "_get_fsdp_state", "_fsdp_param_group", "_unsharded_param", "_set_unshard_async_op", "_states_to_forward_prefetch",
    "_states_to_backward_prefetch", "_orig_size", "_all_gather_result", "_attn_implementation",
}
# The module, and its test (which checks the attributes themselves still exist).
PRIVATE_API_FILES = {ROOT / "runtime" / "torch_private.py", ROOT / "tests" / "runtime" / "test_torch_private.py"}


def _sources(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in _sources(*PACKAGES)}


def _imported(node: ast.Import | ast.ImportFrom, module: str, path: Path) -> list[str]:
    """Our modules an import statement loads (``from a import b`` loads ``a.b`` when that is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative import
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import that can run: at module level and inside functions and classes, not under ``if TYPE_CHECKING``."""
    out = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
            return
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _import_graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        targets = {t for node in _imports(tree) for t in _imported(node, module, path)}
        graph[module] = {t for t in targets if t in MODULES and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_import_graph_is_parsed():
    """The checks below see the real graph: known edges are there, those inside functions too."""
    graph = _import_graph()
    assert "planner.study.simulated" in graph["planner.study.measured"]
    assert "runtime.torch_private" in graph["runtime.memory"]
    assert "planner.storages.models" in graph["planner.storages.rdb"]
    assert "jobs.tune" in graph["jobs.cli"]  # imported inside the command that runs it


def test_no_import_cycle():
    assert _cycles(_import_graph()) == []


def test_cycle_detection_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# What a package never imports, not even inside a function or under TYPE_CHECKING.
NEVER_IMPORTS = {
    # The planner runs where torch and the runtime are absent; the search spaces are handed to it
    # (planner.study.SearchSpace), so the two packages do not close a loop.
    "planner": ("runtime", "jobs", "bench", "search_spaces"),
    "search_spaces": ("runtime", "jobs", "bench"),
}


@pytest.mark.parametrize("package", sorted(NEVER_IMPORTS))
def test_data_flows_one_way(package):
    offenders = []
    for path in _sources(package):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(node, _module_name(path), path):
                    if target.split(".")[0] in NEVER_IMPORTS[package]:
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {target}")
    assert offenders == []


@pytest.mark.parametrize("package", ["planner", "search_spaces"])
def test_no_state_is_attached_to_frozen_objects(package):
    offenders = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in _sources(package)
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Attribute) and node.attr == "__setattr__"
                 and isinstance(node.value, ast.Name) and node.value.id == "object"]
    assert offenders == []


def test_no_source_file_over_the_limit():
    long = {str(p.relative_to(ROOT)): n for p in _sources(*PACKAGES) if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_function_with_too_many_parameters():
    wide = []
    for path in _sources(*PACKAGES):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                if count > MAX_PARAMETERS:
                    wide.append(f"{path.relative_to(ROOT)}:{node.lineno} {getattr(node, 'name', 'lambda')} ({count})")
    assert wide == []


def test_private_torch_apis_only_through_one_module():
    """Every private torch attribute or module is reached through runtime/torch_private.py (tests and benches too)."""
    offenders = []
    for path in _sources(*PACKAGES, "tests", "bench"):
        if path in PRIVATE_API_FILES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in PRIVATE_TORCH_ATTRIBUTES:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for name in names:
                    if name.startswith(("torch.", "transformers.")) and any(p.startswith("_") for p in name.split(".")):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert offenders == []
