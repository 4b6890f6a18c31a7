"""The structure docs/architecture.md describes, checked on the source (parsed, never imported).

- No import cycle in ``planner/``, ``runtime/``, ``search_spaces/``, ``jobs/`` or ``bench/``, counting
  imports inside functions (not those under ``if TYPE_CHECKING:``, which never run).
- Inside ``runtime/`` and ``planner/`` the rooms (sub-packages) import one way: ``ROOMS`` orders them.
- Data flows one way: ``planner`` and ``search_spaces`` never import ``runtime``, ``jobs`` or ``bench``,
  and ``planner`` never imports ``search_spaces`` (it is handed the spaces), not even inside a function.
- No source file over 500 lines (split by concept, never squeezed); no function with more than 12 parameters; no
  class of the study driver (``planner/study/``) over 200 lines.
- No state attached to frozen objects: no ``object.__setattr__`` in ``planner/`` or ``search_spaces/``.
- Private torch attributes are reached only through ``runtime/ranks/torch_private/``: any ``._name`` attribute that
  our own sources do not define is someone else's private API, and is flagged anywhere else (no allow-list).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "runtime", "search_spaces", "jobs", "bench")
MAX_LINES = 500
MAX_PARAMETERS = 12
# The module, and its test (which checks the attributes themselves still exist).
PRIVATE_API_FILES = {*(ROOT / "runtime" / "ranks" / "torch_private").glob("*.py"),
                     ROOT / "tests" / "runtime" / "ranks" / "test_torch_private.py"}


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
    assert "runtime.ranks.torch_private" in graph["runtime.recording.memory"]
    assert "planner.storages.models" in graph["planner.storages.rdb"]
    assert "jobs.tune" in graph["jobs.cli"]  # imported inside the command that runs it


def test_no_import_cycle():
    assert _cycles(_import_graph()) == []


def test_cycle_detection_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# Inside a package, its rooms (sub-packages; "" the modules at its top) in order, lowest first: a module imports
# only its own room's modules and those of rooms below it (rooms in one tuple are side by side). The rank
# processes' plumbing is at the bottom of runtime/, then the model-facing core (apply, workload, timing), the
# recorder, the measured rounds, the in-loop tuner, and the adapters over it. In planner/, what a user reads
# (presentation) is at the top, the study under it, and the artifacts under everything but the statistics' defaults.
ROOMS = {
    "runtime": (("ranks",), ("",), ("recording",), ("measuring",), ("in_loop",), ("adapters",)),
    "planner": (("",), ("statistics",), ("artifacts",), ("simulation", "traces", "storages"), ("study",),
                ("presentation",), ("testing",)),
}


def room_of(module: str) -> str:
    """A module's room: its sub-package under the top package, or ``""`` for a module at the top (``testing`` is
    planner's test support, a room of its own)."""
    parts = module.split(".")
    if len(parts) == 1:
        return ""
    if parts[1] == "testing":
        return "testing"
    return parts[1] if f"{parts[0]}.{parts[1]}" in PACKAGE_NAMES else ""


PACKAGE_NAMES = {_module_name(p.parent / "__init__.py") for p in _sources(*PACKAGES) if p.name == "__init__.py"}


def back_arrows(graph: dict[str, set[str]], package: str, rooms: tuple[tuple[str, ...], ...]) -> list[str]:
    """``a -> b`` for every import in ``package`` from a room to a room above it (the package's own
    ``__init__``, a facade of lazy exports, is not counted)."""
    level = {room: i for i, side_by_side in enumerate(rooms) for room in side_by_side}
    found = []
    for a, targets in sorted(graph.items()):
        if a.split(".")[0] != package or a == package:
            continue
        for b in sorted(targets):
            if b.split(".")[0] == package and b != package and level[room_of(b)] > level[room_of(a)]:
                found.append(f"{a} -> {b}")
    return found


@pytest.mark.parametrize("package", sorted(ROOMS))
def test_rooms_import_one_way(package):
    graph = _import_graph()
    unplaced = {room_of(m) for m in graph if m.split(".")[0] == package and m != package} - {
        room for side_by_side in ROOMS[package] for room in side_by_side}
    assert unplaced == set(), f"rooms of {package}/ missing from ROOMS: {unplaced}"
    assert back_arrows(graph, package, ROOMS[package]) == []


def test_a_back_arrow_is_found():
    """The check catches the arrows it exists for: the recorder importing the measured rounds, a rank module
    importing apply, and the study importing what a user reads."""
    graph = {"runtime.recording.recorder": {"runtime.measuring.measure", "runtime.workload"},
             "runtime.ranks.launch": {"runtime.apply"}, "runtime.in_loop.round": {"runtime.recording.recorder"},
             "planner.study.session": {"planner.presentation.report"}}
    assert back_arrows(graph, "runtime", ROOMS["runtime"]) == [
        "runtime.ranks.launch -> runtime.apply", "runtime.recording.recorder -> runtime.measuring.measure"]
    assert back_arrows(graph, "planner", ROOMS["planner"]) == [
        "planner.study.session -> planner.presentation.report"]


def what_if_offenders(sources: dict[str, str]) -> list[str]:
    """``path:line`` of every call of ``deepen`` or ``retarget`` in ``sources`` (path -> text)."""
    offenders = []
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in ("deepen", "retarget"):
                    offenders.append(f"{path}:{node.lineno} {name}")
    return offenders


def test_the_what_if_has_one_corridor():
    """``simulate``, ``tune --target`` and the predicted stage share one what-if (``planner.simulation.what_if``):
    nothing else in the planner or the jobs deepens or re-targets a profile, and no job module imports the planner's
    command-line module (``jobs.cli`` adds the planner's commands from their own modules)."""
    pipeline = {ROOT / "planner" / "simulation" / name for name in ("what_if.py", "depth.py", "link.py", "band.py")}
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in _sources("planner", "jobs") if p not in pipeline}
    assert what_if_offenders(sources) == []
    assert what_if_offenders({"jobs/predict.py": "x = deepen(recorded, 32)\nlink.retarget(p, t)\n"}) == [
        "jobs/predict.py:1 deepen", "jobs/predict.py:2 retarget"]
    graph = _import_graph()
    assert sorted(a for a, targets in graph.items()
                  if a.startswith("jobs.") and "planner.presentation.cli" in targets) == []


def _called(node: ast.Call) -> str:
    return node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")


def measured_round_offenders(sources: dict[str, str]) -> list[str]:
    """Where a source does one of the measured round's own jobs (``runtime.measuring.round``): checks measured peaks
    against the budget (``over_budget``), fails a trial for its own error (``FailKind.ERROR``), feeds a schedule a
    block (``step_orders``, ``block_times``), or applies plans checked on every rank (``apply_plan(..., check=True)``
    and ``gather_objects`` in one function)."""
    offenders = []
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and _called(node) in ("over_budget", "step_orders", "block_times"):
                offenders.append(f"{path}:{node.lineno} {_called(node)}")
            elif (isinstance(node, ast.Attribute) and node.attr == "ERROR" and isinstance(node.value, ast.Name)
                  and node.value.id == "FailKind"):
                offenders.append(f"{path}:{node.lineno} FailKind.ERROR")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                calls = [c for c in ast.walk(node) if isinstance(c, ast.Call)]
                checked = any(_called(c) == "apply_plan" and any(
                    k.arg == "check" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in c.keywords) for c in calls)
                if checked and any(_called(c) == "gather_objects" for c in calls):
                    offenders.append(f"{path}:{node.lineno} applies plans on every rank")
    return offenders


def test_the_measured_round_has_one_copy():
    """The tune job's ranks (``runtime.measuring.measure``) and the in-loop tuner (``runtime.in_loop``) drive one
    measured round, ``runtime.measuring.round.MeasuredRound``: no other runtime or job module applies the round's
    plans on every rank, checks their peaks against the budget, fails a trial for its error or feeds the schedule."""
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in _sources("runtime", "jobs")
               if p != ROOT / "runtime" / "measuring" / "round.py"}
    assert measured_round_offenders(sources) == []
    copy = ("def apply_everywhere(model, plans, group):\n"
            "    for plan in plans:\n        apply_plan(model, plan, check=True)\n"
            "    return gather_objects(None, group)\n"
            "def left_out(stage, kept, peaks):\n    return stage.over_budget(kept, peaks)\n"
            "def failed(stage, asked):\n    stage.fail(asked, 'x', FailKind.ERROR)\n")
    assert measured_round_offenders({"runtime/in_loop/round.py": copy}) == [
        "runtime/in_loop/round.py:1 applies plans on every rank", "runtime/in_loop/round.py:6 over_budget",
        "runtime/in_loop/round.py:8 FailKind.ERROR"]


def test_a_stored_trial_becomes_a_plan_in_one_place():
    """Stored parameters (a trial's, a grid point's, a predicted plan's) become a plan through
    ``SearchSpace.build`` alone (``search_spaces._space.BaseSpace``): no other product module builds an
    ``optuna.trial.FixedTrial``."""
    one = ROOT / "search_spaces" / "_space.py"
    offenders = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in _sources(*PACKAGES) if path != one
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Attribute) and node.attr == "FixedTrial"]
    assert offenders == []


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
    long = {
        str(p.relative_to(ROOT)): n for p in _sources(*PACKAGES) if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


MAX_STUDY_CLASS_LINES = 200  # the study driver is read most: one concept a class, as FSDP2's _fully_shard/ is


def test_no_class_of_the_study_driver_over_the_limit():
    long = [f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
            for p in _sources("planner/study") for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_STUDY_CLASS_LINES]
    assert long == []


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


# Public, documented names that start with an underscore (``os._exit``: the standard library's exit without teardown).
DOCUMENTED_UNDERSCORE_NAMES = {"os._exit"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_private_names(trees: list[ast.Module]) -> set[str]:
    """The ``_name`` attributes our own code defines: functions, classes, module and class variables, dataclass
    fields, and ``self._x`` / ``cls._x`` assignments."""
    out: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            if isinstance(node, (ast.Module, ast.ClassDef)):
                for stmt in node.body:
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
                    out.update(t.id for t in targets if isinstance(t, ast.Name))
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.add(node.attr)
    return {name for name in out if _is_private(name)}


def private_api_offenders(sources: dict[str, str]) -> list[str]:
    """``path:line`` of every reach into another library's private API in ``sources`` (path -> text): a ``._name``
    attribute none of the sources defines, or an import of a private ``torch.``/``transformers.`` module."""
    trees = {path: ast.parse(text) for path, text in sources.items()}
    ours = _defined_private_names(list(trees.values()))
    offenders = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in ours
                    and ast.unparse(node) not in DOCUMENTED_UNDERSCORE_NAMES):
                offenders.append(f"{path}:{node.lineno} .{node.attr}")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for name in names:
                    if name.startswith(("torch.", "transformers.")) and any(p.startswith("_") for p in name.split(".")):
                        offenders.append(f"{path}:{node.lineno} imports {name}")
    return offenders


def test_private_torch_apis_only_through_one_module():
    """Every private attribute or module of torch (or any library) is reached through runtime/ranks/torch_private/
    (tests and benches too)."""
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in _sources(*PACKAGES, "tests")
               if p not in PRIVATE_API_FILES}
    assert private_api_offenders(sources) == []


def test_the_private_api_check_catches_a_private_torch_attribute():
    """A module reaching FSDP2's param group directly is flagged; our own ``self._x`` and ``_helper()`` are not."""
    ours = "class A:\n    def __init__(self):\n        self._cache = {}\n\ndef _helper(a):\n    return a._cache\n"
    theirs = "def f(module):\n    return module._fsdp_param_group, module._get_fsdp_state()\n"
    assert private_api_offenders({"ours.py": ours}) == []
    assert private_api_offenders({"ours.py": ours, "bad.py": theirs}) == [
        "bad.py:2 ._fsdp_param_group", "bad.py:2 ._get_fsdp_state"]
    assert private_api_offenders({"bad.py": "from torch.distributed.fsdp._fully_shard import _fsdp_state\n"}) == [
        "bad.py:1 imports torch.distributed.fsdp._fully_shard"]
    documented_and_not = {"ok.py": "import os\nos._exit(130)\n", "bad.py": "import torch\ntorch._exit(1)\n"}
    assert private_api_offenders(documented_and_not) == ["bad.py:2 ._exit"]


PRODUCT = ("planner", "runtime", "search_spaces", "jobs")
MAX_FUNCTION_LINES = 80
# A knob is declared once (planner/artifacts/knobs.py); beyond that only its simulator rule and the runtime
# mechanism a few need (gradient accumulation, a private setter) may name it.
KNOB_FILES = 5
COUNTED_KNOBS = ("reduce_scatter_max_input_buffers", "reshard_after_backward", "unshard_in_backward",
                 "separate_reduce_scatter_group")


def names_in_code(tree: ast.Module, name: str) -> bool:
    """Whether ``tree`` names ``name`` in code: an identifier containing it (not FSDP2's own setters ``set_<name>``
    and ``_set_<name>``) or a string constant equal to it. Comments and docstrings do not count."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    setters = {f"set_{name}", f"_set_{name}"}
    for node in ast.walk(tree):
        identifiers = []
        if isinstance(node, ast.Name):
            identifiers = [node.id]
        elif isinstance(node, ast.Attribute):
            identifiers = [node.attr]
        elif isinstance(node, ast.arg):
            identifiers = [node.arg]
        elif isinstance(node, ast.keyword) and node.arg:
            identifiers = [node.arg]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            identifiers = [node.name]
        elif isinstance(node, ast.alias):
            identifiers = [node.name.rpartition(".")[2], node.asname or ""]
        elif isinstance(node, ast.Constant) and id(node) not in docstrings and node.value == name:
            return True
        if any(name in i and i not in setters for i in identifiers):
            return True
    return False


def test_names_in_code_ignores_comments_docstrings_and_fsdp2_setters():
    tree = ast.parse('"""reshard_after_backward"""\n# reshard_after_backward\nm.set_reshard_after_backward(x)\n'
                     'f"the plan sets reshard_after_backward"\n')
    assert not names_in_code(tree, "reshard_after_backward")
    assert names_in_code(ast.parse('d["reshard_after_backward"]'), "reshard_after_backward")
    assert names_in_code(ast.parse("plan.reshard_after_backward"), "reshard_after_backward")


@pytest.mark.parametrize("knob", COUNTED_KNOBS)
def test_a_knob_is_named_in_few_product_files(knob):
    # the private-API package is one place, split by concept (its __init__ re-exports its modules' names)
    files = {str(p.relative_to(ROOT)) if p.parent.name != "torch_private" else "runtime/ranks/torch_private/"
             for p in _sources(*PRODUCT) if names_in_code(ast.parse(p.read_text()), knob)}
    assert len(files) <= KNOB_FILES, sorted(files)


def test_no_product_function_over_the_limit():
    long = [f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
            for p in _sources(*PRODUCT) for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


MAX_UNTYPED_DICTS = 12  # figures and records cross files as dataclasses; JSON is typed as planner.artifacts.json_types


def test_few_string_keyed_dicts_of_anything_in_the_product():
    found = [f"{p.relative_to(ROOT)}:{n}" for p in _sources(*PRODUCT)
             for n, line in enumerate(p.read_text().splitlines(), 1) if "dict[str, Any]" in line]
    assert len(found) <= MAX_UNTYPED_DICTS, found


MAX_FLAT_RUNTIME_TESTS = 4  # the core's tests (apply, the loss property, the workloads) beside the rooms' folders


def test_runtime_tests_mirror_its_rooms():
    """Each room of runtime/ has its folder of tests in tests/runtime/, and few test files sit flat beside them."""
    rooms = {p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").exists()}
    tested = {p.name for p in (ROOT / "tests" / "runtime").iterdir()
              if (p / "__init__.py").exists() and any(p.glob("test_*.py"))}
    assert rooms - tested == set()
    assert len(list((ROOT / "tests" / "runtime").glob("test_*.py"))) <= MAX_FLAT_RUNTIME_TESTS


# One machine's results (a named accelerator, "the testbed", "our CPU") belong in bench/results/ and
# docs/decisions/, never in product code or what it prints.
MACHINE_WORDS = r"\b(H100|H200|A100|testbed)\b|\bour (CPU|GPU|machine)\b"


def test_no_product_file_quotes_a_machine():
    import re

    quoted = [f"{p.relative_to(ROOT)}:{n}" for p in _sources(*PRODUCT)
              for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(MACHINE_WORDS, line)]
    assert quoted == []


# What only the device module may do (runtime/ranks/device.py): read the clock, wait for the device, take a barrier,
# record an event, read the allocator's counters.
DEVICE_FILE = ROOT / "runtime" / "ranks" / "device.py"
DEVICE_CALLS = {"perf_counter", "synchronize", "barrier", "monitored_barrier", "Event", "record_event",
                "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "memory_reserved",
                "max_memory_reserved", "mem_get_info"}


def device_call_offenders(sources: dict[str, str]) -> list[str]:
    """``path:line name`` of every call in ``sources`` (path -> text) of a :data:`DEVICE_CALLS` attribute (``time.
    perf_counter()``, ``dist.barrier(...)``, ``torch.cuda.Event(...)``): the device module's work done elsewhere.
    The device module's own methods (``device.synchronize()``) are calls on a ``Device``, named the same: a call is
    flagged when made on ``time``, ``torch``, ``torch.cuda``, ``dist`` or ``torch.distributed``."""
    owners = {"time", "torch", "cuda", "dist", "distributed"}
    offenders = []
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DEVICE_CALLS
                    and isinstance(node.func.value, (ast.Name, ast.Attribute))
                    and (node.func.value.id if isinstance(node.func.value, ast.Name) else node.func.value.attr)
                    in owners):
                offenders.append(f"{path}:{node.lineno} {node.func.attr}")
    return offenders


def test_the_device_module_alone_reads_clocks_synchronizes_and_takes_barriers():
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in _sources("runtime") if p != DEVICE_FILE}
    assert device_call_offenders(sources) == []
    assert device_call_offenders({"device.py": DEVICE_FILE.read_text()})  # the checker sees the real calls


def test_the_device_check_catches_a_planted_second_timer():
    planted = ("import time\nimport torch\nimport torch.distributed as dist\n"
               "def step(run):\n    dist.barrier()\n    torch.cuda.synchronize()\n    t0 = time.perf_counter()\n"
               "    run()\n    return torch.cuda.max_memory_allocated(), time.perf_counter() - t0\n")
    assert device_call_offenders({"planted.py": planted}) == [
        "planted.py:5 barrier", "planted.py:6 synchronize", "planted.py:7 perf_counter",
        "planted.py:9 max_memory_allocated", "planted.py:9 perf_counter"]
    ours = "def f(device):\n    device.synchronize()\n    return device.clock()\n"
    assert device_call_offenders({"ours.py": ours}) == []


# One step runner (runtime/recording/steps.py): the only code that both runs a training step and times it. A
# function that calls the step (``train_step``, ``forward_backward``) and reads a clock or times a stretch is a second
# runner. One is left, for its reason: verify's ranks stand for a user's process and may load nothing of the tuner
# (``jobs.verify.TUNER_MODULES``: ``runtime.recording`` and ``runtime.measuring`` among them).
STEP_CALLS = {"train_step", "forward_backward"}
CLOCK_CALLS = {"clock", "elapsed_ms", "timed_ms", "perf_counter", "monotonic", "time", "mark", "spans_ms"}
SECOND_RUNNERS_LEFT = {"jobs/verify.py:verify_rank"}


def _own_calls(node: ast.AST) -> set[str]:
    """The names a function calls in its own body: its lambdas included, its nested functions not (each is checked
    on its own)."""
    called, stack = set(), list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(child, ast.Call):
            called.add(_called(child))
        stack.extend(ast.iter_child_nodes(child))
    return called


def step_runner_offenders(sources: dict[str, str]) -> list[str]:
    """``path:function`` of every function or method in ``sources`` (path -> text) that runs a training step and
    reads a clock in its own body (its lambdas included)."""
    offenders = []
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                called = _own_calls(node)
                if called & STEP_CALLS and called & CLOCK_CALLS:
                    offenders.append(f"{path}:{node.name}")
    return sorted(offenders)


def test_one_step_runner_times_the_training_steps():
    """The tune job's ranks and its recorder, its launches, ``confirm``, the benches and the in-loop tuner run every
    timed step through ``runtime.recording.steps`` (``StepSide``, fed the user's step or the workload's)."""
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in _sources("runtime", "jobs", "bench")}
    assert set(step_runner_offenders(sources)) == SECOND_RUNNERS_LEFT


def test_the_step_runner_check_catches_a_planted_second_runner():
    planted = ("def timed_step(workload, step, device):\n    t0 = device.clock()\n"
               "    train_step(workload, step)\n    return device.clock() - t0\n"
               "class Bench:\n    def rounds(self, w):\n        return [self.device.timed_ms(lambda: train_step(w, i))"
               " for i in range(3)]\n"
               "def untimed(workload):\n    def progress():\n        print(time.perf_counter())\n"
               "    train_step(workload, 0)\n")
    assert step_runner_offenders({"bench/planted.py": planted}) == ["bench/planted.py:rounds",
                                                                   "bench/planted.py:timed_step"]


def profile_builders(sources: dict[str, str]) -> list[str]:
    """``path:line`` of every call in ``sources`` (path -> text) that merges ranks' figures into a ``Profile``
    (``consolidate``) or runs the isolated passes (``isolated_measurements``): a recorder's two jobs."""
    return [f"{path}:{node.lineno} {_called(node)}" for path, text in sources.items()
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Call) and _called(node) in ("consolidate", "isolated_measurements")]


def test_one_recorder_serves_tune_and_the_in_loop_tuner():
    """``runtime.recording.recorder.Recorder`` alone runs the isolated passes and builds the profile, for ``record_
    profile`` (``tune``, ``profile``) and for ``AutoTuner``; benches may time the passes again, no runtime module."""
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in _sources("runtime", "jobs")
               if p.name not in ("isolated.py", "consolidation.py")}
    assert {found.split(":")[0] for found in profile_builders(sources)} == {"runtime/recording/recorder.py"}
    second = "def profile(self, gather):\n    return consolidate(gather(self.local), self.fp, {}, {}, 1, [])\n"
    assert profile_builders({"runtime/in_loop/recorder.py": second}) == ["runtime/in_loop/recorder.py:2 consolidate"]


def rank_set_ups(sources: dict[str, str]) -> list[str]:
    """``path:line`` of every call in ``sources`` (path -> text) that starts a rank's process group by itself
    (``init_rank``, ``init_process_group``) rather than through ``runtime.ranks.rank.job_rank``."""
    return [f"{path}:{node.lineno} {_called(node)}" for path, text in sources.items()
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Call) and _called(node) in ("init_rank", "init_process_group")]


# The one rank set-up's own file, the fake world a plan's fingerprint is built on (one process, no job), and the
# link sweep's collectives part (ranks on the emulated cluster's namespaces with no study, timing bare collectives).
RANK_SET_UP_LEFT = {"runtime/ranks/rank.py", "runtime/ranks/torch_private/process.py", "bench/link_sweep.py"}


def test_every_command_and_bench_starts_its_ranks_through_one_set_up():
    """``tune``, ``profile``, ``confirm``, ``calibrate``, ``verify`` and the benches start their ranks with
    ``job_rank`` (the study's ``[launch]``: backend, timeout, allocator and mesh, the control group, the shutdown)."""
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in _sources("runtime", "jobs", "bench")}
    assert {found.split(":")[0] for found in rank_set_ups(sources)} == RANK_SET_UP_LEFT
    planted = "def rank_main(config):\n    mesh = init_rank(config.launch.backend)\n"
    assert rank_set_ups({"bench/planted.py": planted}) == ["bench/planted.py:2 init_rank"]
